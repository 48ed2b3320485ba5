"""The ingest tokenizer without transformers (dist_nce.core.rust_tokenizer) gives the transformers
path's ids, and a KB update run in a fresh process never imports torch."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import dist_nce.core.text as text
from dist_nce.core import rust_tokenizer
from dist_nce.core.models import TOKENIZER_FILES
from dist_nce.core.records import EntityRecord, MentionRecord
from dist_nce.core.text import (encode_entities, encode_entity, encode_mentions, load_ingest_tokenizer, load_tokenizer,
                           special_ids, tokenizer_fingerprint)

from tests.core.test_text import WORDS, random_entities, random_mentions  # noqa: E402  (tests/ is on sys.path)

REPO = Path(__file__).resolve().parents[2]
LONG = " ".join(["Zürich Šuker naïve e\u0301te\u0301 東京都 ΟΔΟΣ 🙂 [SEP] [unused0] «quoted» —"] * 60)
TEXTS = ["", " ", "Hello, World!", "ÉCOLE Normale Supérieure", "Ångström", "ﬁnance ½ Ⅻ", "İstanbul",
         "a\u00adb", "zero\u200bwidth", "\x00\x01ctl\x7f", "tab\there\nnew", "x" * 250, "東京都の人口", "😀👍🏽",
         "[CLS] [SEP] [PAD] [MASK] [UNK] [unused0] [unused2]", "U.S.-based 1996-08-30", LONG, *WORDS]


@pytest.fixture(scope="module", params=["tiny", "minilm"])
def pair(request, tiny_model_dir, minilm_dir):
    model = tiny_model_dir if request.param == "tiny" else minilm_dir
    return load_ingest_tokenizer(model), load_tokenizer(model)


def test_the_fast_path_is_taken_and_is_the_same_tokenizer(pair):
    fast, hf = pair
    assert isinstance(fast, rust_tokenizer.RustTokenizer)
    assert tokenizer_fingerprint(fast) == tokenizer_fingerprint(hf)
    assert len(fast) == len(hf) and special_ids(fast) == special_ids(hf)
    assert text._splits_on_spaces(fast) and text._splits_on_spaces(hf)  # both cut long texts in windows
    mine, theirs = json.loads(fast.backend_tokenizer.to_str()), json.loads(hf.backend_tokenizer.to_str())
    for key in ("normalizer", "pre_tokenizer", "model", "added_tokens"):
        assert mine[key] == theirs[key], key


def test_ids_and_words_equal_transformers(pair):
    fast, hf = pair
    for words in (False, True):
        assert text._tokenize(fast, TEXTS, words) == text._tokenize(hf, TEXTS, words)


@pytest.mark.parametrize("max_len", [8, 32, 128])
def test_entity_and_mention_rows_equal_transformers(pair, max_len):
    fast, hf = pair
    ents = random_entities(seed=max_len, n=80) + [EntityRecord(str(i), t, t + " " + LONG) for i, t in enumerate(TEXTS)]
    for strip in (False, True):
        assert (encode_entities(fast, ents, max_len, strip) == encode_entities(hf, ents, max_len, strip)).all()
    assert [encode_entity(fast, r.title, r.description, max_len) for r in ents[:20]] == \
        [encode_entity(hf, r.title, r.description, max_len) for r in ents[:20]]
    mentions = random_mentions(seed=max_len, n=80) + [MentionRecord(str(i), LONG, t, LONG) for i, t in enumerate(TEXTS)]
    assert (encode_mentions(fast, mentions, max_len) == encode_mentions(hf, mentions, max_len)).all()


def _copy_tokenizer(src: str, dst: Path, files=TOKENIZER_FILES) -> Path:
    dst.mkdir()
    for name in files:
        if (Path(src) / name).exists():
            shutil.copy(Path(src) / name, dst / name)
    return dst


def test_vocab_only_directory_falls_back_to_transformers(tmp_path, minilm_dir):
    model = _copy_tokenizer(minilm_dir, tmp_path / "vocab_only", ("vocab.txt", "tokenizer_config.json"))
    assert rust_tokenizer.load(model) is None
    tok = load_ingest_tokenizer(model)
    assert not isinstance(tok, rust_tokenizer.RustTokenizer)
    assert tokenizer_fingerprint(tok)["sha256"] == tokenizer_fingerprint(load_tokenizer(minilm_dir))["sha256"]


@pytest.mark.parametrize("change", ["cased_config", "wordpiece_limit", "other_class", "added_token"])
def test_files_that_disagree_fall_back(tmp_path, minilm_dir, change):
    model = _copy_tokenizer(minilm_dir, tmp_path / change)
    config = json.loads((model / "tokenizer_config.json").read_text())
    spec = json.loads((model / "tokenizer.json").read_text())
    if change == "cased_config":  # transformers 5 would take this normalizer, tokenizer.json says lowercase
        config["do_lower_case"] = False
    elif change == "wordpiece_limit":
        spec["model"]["max_input_chars_per_word"] = 50
    elif change == "other_class":
        config["tokenizer_class"] = "DistilBertTokenizer"
    else:
        spec["added_tokens"].append({**spec["added_tokens"][-1], "id": 30522, "content": "zz", "special": False})
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "tokenizer.json").write_text(json.dumps(spec))
    assert rust_tokenizer.load(model) is None


def test_a_bare_string_is_refused(pair):
    with pytest.raises(TypeError, match="list of texts"):
        pair[0]("a text", add_special_tokens=False, split_special_tokens=True)


def test_an_update_never_imports_torch(tmp_path, tiny_model_dir):
    """In the update process and in its ingest workers: stand-in ``torch`` and ``transformers``
    packages first on the path leave a mark for each process importing them, and fail it."""
    from kb_delta_helpers import entities, prepare_store

    store = prepare_store(tmp_path, "store", entities(range(100, 140)), tiny_model_dir, golds=[100, 101])
    stubs, marks = tmp_path / "stubs", tmp_path / "marks"
    marks.mkdir()
    for name in ("torch", "transformers"):
        (stubs / name).mkdir(parents=True)
        (stubs / name / "__init__.py").write_text(
            f"import os, pathlib\npathlib.Path(os.environ['IMPORT_MARKS'], '{name}-' + str(os.getpid())).touch()\n"
            f"raise ImportError('the KB update imported {name}')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(stubs), str(REPO)]), "IMPORT_MARKS": str(marks)}
    for workers, first in ((1, 500), (2, 600)):  # in process; in spawned ingest workers (two files: two chunks)
        adds = []
        for part in range(workers):
            adds += ["--add", str(tmp_path / f"add{first}-{part}.json")]
            lines = entities(range(first + 10 * part, first + 10 * part + 10), seed=part).values()
            Path(adds[-1]).write_text("".join(v + "\n" for v in lines))
        (tmp_path / "remove.txt").write_text(f"{first // 5}\n")
        done = subprocess.run([sys.executable, "-m", "kb.delta", "--store", str(store), *adds, "--remove",
                               str(tmp_path / "remove.txt"), "--model-dir", tiny_model_dir, "--workers", str(workers),
                               "--no-progress"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert f"KB version {workers}: +{10 * workers} -1" in done.stdout
        assert not list(marks.iterdir()), done.stderr


def test_a_hub_id_is_refused_without_loading_anything():
    with pytest.raises(FileNotFoundError, match=r"^bert-base-uncased: tokenizer directory not found .*never downloads"):
        load_ingest_tokenizer("bert-base-uncased")
