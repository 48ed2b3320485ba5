"""EntityStore / MentionTable: memory-mapped gathers, source-id lookups, slices, manifest checks.

The store is built once per module with ``kb.prepare`` from a small KILT-format file;
every fast path is compared with a plain reading of the Arrow parts (``to_pylist``).
"""
from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from dist_nce.core.artifacts import ArtifactMismatch
from kb.prepare import PrepareConfig, prepare
from kb.source_index import SourceIndex, argsort_keys, build_source_index, fixed_width_keys
from kb.store import EntityStore, MentionTable, read_arrow

N_ENTITIES = 157
ROWS_PER_PART = 20  # several parts, so gathers straddle part boundaries


def _kilt_line(i: int, rng: random.Random) -> str:
    title = f"Page {i} ({rng.choice(['film', 'band', 'city'])})"
    body = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "river", "north"]) for _ in range(rng.randint(0, 60)))
    return json.dumps({"_id": str(i), "wikipedia_id": str(3 * i + 11), "wikipedia_title": title,
                       "text": [title + "\n", body + "\n", "Section::::History.\n"], "anchors": [],
                       "categories": "x,y", "history": {"revid": i}})


def _aida_line(i: int, wid: str, title: str) -> str:
    return json.dumps({"id": f"doc{i}:{i}", "input": f"some left words [START_ENT] {title} [END_ENT] right side",
                       "output": [{"answer": title, "provenance": [{"wikipedia_id": wid, "title": title}]}],
                       "meta": {"left_context": "some left words", "mention": title, "right_context": "right side"}})


@pytest.fixture(scope="module")
def built(tmp_path_factory, minilm_dir):
    root = tmp_path_factory.mktemp("store")
    rng = random.Random(0)
    (root / "ks.json").write_text("".join(_kilt_line(i, rng) + "\n" for i in range(N_ENTITIES)))
    aida = root / "aida"
    aida.mkdir()
    lines = [_aida_line(i, str(3 * i + 11), f"Page {i}") for i in range(12)] + [_aida_line(99, "5", "Nowhere")]
    (aida / "aidayago2-train-kilt.jsonl").write_text("\n".join(lines) + "\n")
    cfg = PrepareConfig(out=str(root / "out"), kilt_ks=str(root / "ks.json"), aida_dir=str(aida),
                        model_dir=minilm_dir, rows_per_part=ROWS_PER_PART, chunk_size="3K", progress=False,
                        entity_max_len=24)
    prepare(cfg, log=lambda s: None)
    return root / "out"


@pytest.fixture(scope="module")
def reference(built):
    """Every entity row as plain Python, read part by part without the store."""
    rows = []
    for name in json.loads((built / "manifest.json").read_text())["entities"]["parts"]:
        rows += read_arrow(built / "entities" / name).to_pylist()
    return rows


def test_rows_and_parts_are_consistent(built, reference):
    store = EntityStore(built)
    assert store.num_entities == len(reference) == N_ENTITIES
    assert [r["row_id"] for r in reference] == list(range(N_ENTITIES))
    assert len(store.manifest["entities"]["parts"]) == -(-N_ENTITIES // ROWS_PER_PART)
    assert store.max_len == 24


def test_gather_4x64_matches_reference(built, reference):
    store = EntityStore(built)
    rows = np.random.default_rng(0).integers(0, N_ENTITIES, size=(4, 64))
    got = store.token_ids(rows)
    assert got.shape == (4, 64, 24) and got.dtype == np.int32
    want = np.array([[reference[r]["token_ids"] for r in row] for row in rows], dtype=np.int32)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(store.lengths(rows), [[reference[r]["length"] for r in row] for row in rows])
    assert store.titles(rows[:2, :3]) == [[reference[r]["title"] for r in row] for row in rows[:2, :3]]
    assert store.source_ids(rows[0]) == [reference[r]["source_id"] for r in rows[0]]
    assert store.worlds([0, 1]) == [None, None]


def test_lengths_count_non_pad_tokens(built):
    store = EntityStore(built)
    tokens = store.token_ids(np.arange(N_ENTITIES))
    np.testing.assert_array_equal(store.lengths(np.arange(N_ENTITIES)), (tokens != 0).sum(1))
    assert (tokens[:, 0] == 101).all()  # [CLS]


def test_gather_is_memory_mapped_not_loaded(built):
    before = pa.total_allocated_bytes()
    store = EntityStore(built)
    store.token_ids(np.arange(N_ENTITIES))
    # Mapped pages do not come from Arrow's allocator; a read_all into memory would.
    assert pa.total_allocated_bytes() - before < 4096
    _, tokens, _ = next(store.iter_batches(8))
    assert not tokens.flags.owndata  # a view of the mapping, not a copy


def test_out_of_range_rows_are_refused(built):
    store = EntityStore(built)
    with pytest.raises(IndexError, match="row id 157 out of range"):
        store.token_ids([0, N_ENTITIES])
    with pytest.raises(IndexError):
        store.token_ids([-1])
    with pytest.raises(TypeError):
        store.token_ids([0.5])


def test_source_id_lookup_including_missing(built, reference):
    store = EntityStore(built)
    truth = {r["source_id"]: r["row_id"] for r in reference}
    queries = [reference[5]["source_id"], "999999999999", "", "1\0", reference[156]["source_id"], "12", "x" * 40,
               reference[0]["source_id"]]
    np.testing.assert_array_equal(store.rows_for_source_ids(queries), [truth.get(q, -1) for q in queries])
    every = list(truth)
    np.testing.assert_array_equal(store.rows_for_source_ids(every), [truth[k] for k in every])
    assert store.rows_for_source_ids([]).shape == (0,)


def test_title_lookup(built, reference):
    store = EntityStore(built)
    titles = [reference[3]["title"], "No Such Page", reference[100]["title"]]
    np.testing.assert_array_equal(store.rows_for_titles(titles), [3, -1, 100])


def test_slice_is_a_row_range_view(built):
    store = EntityStore(built)
    view = store.slice(30, 95)
    assert view.num_entities == 65 and (view.start, view.stop) == (30, 95)
    local = np.array([[0, 64], [9, 10]])
    np.testing.assert_array_equal(view.token_ids(local), store.token_ids(local + 30))
    ids = store.source_ids([29, 30, 94, 95])
    np.testing.assert_array_equal(view.rows_for_source_ids(ids), [-1, 0, 64, -1])
    inner = view.slice(10, 20)
    np.testing.assert_array_equal(inner.token_ids([0, 9]), store.token_ids([40, 49]))
    with pytest.raises(IndexError):
        view.token_ids([65])
    with pytest.raises(IndexError):
        store.slice(10, N_ENTITIES + 1)


def test_iter_batches_covers_view_without_straddling_parts(built):
    store = EntityStore(built)
    view = store.slice(15, 130)
    seen = []
    for rows, tokens, lengths in view.iter_batches(16):
        np.testing.assert_array_equal(tokens, view.token_ids(rows))
        np.testing.assert_array_equal(lengths, view.lengths(rows))
        assert len({(r + 15) // ROWS_PER_PART for r in rows}) == 1
        seen += rows.tolist()
    assert seen == list(range(115))


def test_opening_a_store_and_reading_it_imports_no_pandas(built):
    """Every shard, job and Serve replica opens a store: pyarrow's to_numpy imports pandas (~0.6 s of
    CPU per process) for columns that are plain buffers in the mapped file (kb.arrow_view)."""
    probe = (
        "import sys\nimport numpy as np\nfrom kb.store import EntityStore, MentionTable\n"
        f"s = EntityStore({str(built)!r})\nrows = np.arange(s.num_entities)\n"
        "s.token_ids(rows); s.lengths(rows); s.slice(30, 50).token_ids([0, 19])\n"
        "assert (s.rows_for_source_ids(s.source_ids([0, 45])) == [0, 45]).all()\n"
        f"MentionTable({str(built)!r}, 'train').gold_rows\n"
        "print('pandas' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "False", "opening a store imported pandas"


def test_mention_table(built):
    store = EntityStore(built)
    table = MentionTable(built, "train")
    assert table.num_mentions == 13 and table.max_len == 32
    assert table.token_ids([[0, 1]]).shape == (1, 2, 32)
    gold = table.gold_rows
    assert gold.dtype == np.int64
    np.testing.assert_array_equal(gold[:12], store.rows_for_source_ids([str(3 * i + 11) for i in range(12)]))
    assert gold[12] == -1 and table.gold_status[12] == "missing"
    assert table.mention_ids[12] == "doc99:99"
    assert table.worlds == [None] * 13 and table.categories == [None] * 13
    with pytest.raises(KeyError, match="no mention split 'dev'"):
        MentionTable(built, "dev")


def _copy(built, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(built, dst)
    return dst


def _edit_manifest(path, **changes):
    m = json.loads((path / "manifest.json").read_text())
    m.update(changes)
    (path / "manifest.json").write_text(json.dumps(m))


def test_refuses_other_tokenizer_and_schema(built, tmp_path):
    sha = EntityStore(built).manifest["tokenizer_sha256"]
    EntityStore(built, tokenizer_sha256=sha)
    with pytest.raises(ArtifactMismatch, match="(?s)tokenizer_sha256.*re-run jobs/prepare_kb.py"):
        EntityStore(built, tokenizer_sha256="0" * 64)
    with pytest.raises(ArtifactMismatch, match="tokenizer_sha256"):
        MentionTable(built, "train", tokenizer_sha256="0" * 64)
    with pytest.raises(ArtifactMismatch, match="entity_max_len"):
        EntityStore(built, expect={"entity_max_len": 128})
    copy = _copy(built, tmp_path)
    _edit_manifest(copy, schema_version=0)
    with pytest.raises(ArtifactMismatch, match="schema_version"):
        EntityStore(copy)
    _edit_manifest(copy, schema_version=1, kind="embeddings")
    with pytest.raises(ArtifactMismatch, match="kind"):
        EntityStore(copy)
    (copy / "manifest.json").unlink()
    with pytest.raises(ArtifactMismatch, match="no manifest"):
        EntityStore(copy)


def test_refuses_parts_that_disagree_with_manifest(built, tmp_path):
    copy = _copy(built, tmp_path)
    m = json.loads((copy / "manifest.json").read_text())
    m["entities"]["count"] += 1
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactMismatch, match="rows, manifest says"):
        EntityStore(copy)


def test_fixed_width_keys_match_python_encoding():
    ids = ["1", "12", "", "héllo", "9" * 7]
    keys = fixed_width_keys(pa.array(ids).slice(0), 7)
    assert keys.dtype == np.dtype("S7")
    assert keys.tolist() == [s.encode("utf-8") for s in ids]
    sliced = fixed_width_keys(pa.array(ids).slice(1, 3), 7)
    assert sliced.tolist() == [b"12", b"", "héllo".encode()]
    with pytest.raises(ValueError, match="longer than"):
        fixed_width_keys(pa.array(ids), 3)
    with pytest.raises(ValueError, match="NUL"):
        fixed_width_keys(pa.array(["a\0b"]), 3)


def test_source_index_against_dict_reference():
    rng = random.Random(1)
    ids = [str(rng.randint(0, 500)) for _ in range(300)] + ["ABCDEF0123456789", "7"]
    index = SourceIndex(build_source_index(pa.array(ids)))
    first = {}
    for row, sid in enumerate(ids):
        first.setdefault(sid, row)  # duplicates: the lowest row wins
    queries = [str(q) for q in range(-5, 520)] + ["ABCDEF0123456789", "ABCDEF012345678", "0" + ids[0]]
    np.testing.assert_array_equal(index.lookup(queries), [first.get(q, -1) for q in queries])


@pytest.mark.parametrize("width", [3, 8, 13])
def test_argsort_keys_equals_numpy_string_sort(width):
    rng = np.random.default_rng(width)
    alphabet = np.frombuffer("09AFaf\u00e9\u4e2d".encode(), dtype=np.uint8)  # includes bytes >= 0x80
    ids = []
    for _ in range(2000):
        n = int(rng.integers(1, width + 1))
        ids.append(bytes(rng.choice(alphabet[alphabet > 0], size=n)))
    ids += ids[:300]  # duplicates: stability matters
    keys = np.array(ids, dtype=f"S{width}")
    np.testing.assert_array_equal(argsort_keys(keys), np.argsort(keys, kind="stable"))
    text = pa.array([k.decode("latin-1") for k in ids])  # any str; fixed_width_keys re-encodes as UTF-8
    built = fixed_width_keys(text, 2 * width)
    assert built.tolist() == [k.decode("latin-1").encode() for k in ids]
