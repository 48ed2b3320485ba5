"""EntityShard as a plain object (no Ray): encode loop, persist-then-swap, reload, refusal.

The Ray actor is this same class (``dist_nce.actors.shard.start_shard``); tests/actors/
test_service.py covers what only Ray adds (threads, restarts, retries).
"""
from __future__ import annotations

import json
import random
import threading

import numpy as np
import pytest
import torch

from dist_nce.actors.config import ServiceConfig
from dist_nce.actors.shard import EntityShard, NoIndexError, VersionUnavailable
from dist_nce.index.config import IndexConfig
from dist_nce.index.encode import autocast_dtype, encode_rows, length_sorted_batches, state_fingerprint, store_fingerprint
from dist_nce.index.versions import shard_dir_name, version_dir_name
from dist_nce.kernels.attention import unavailable_reason as attention_unavailable
from dist_nce.modeling.encoder import Encoder
from dist_nce.modeling.retriever import EntityEncoder, RetrieverConfig
from dist_nce.modeling.scoring import ScoreSpec
from kb.prepare import PrepareConfig, prepare
from kb.store import EntityStore

N = 90
WORDS = "river north castle album band film league station county party war song".split()
D = 32  # tiny_model_dir hidden size


def write_kilt(path, n: int, seed: int = 0) -> None:
    """KILT knowledge-source lines with descriptions of 0-40 words (varied token lengths)."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        title = f"{rng.choice(WORDS).title()} {i}"
        body = " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 40)))
        lines.append(json.dumps({"_id": str(i), "wikipedia_id": str(1000 + i), "wikipedia_title": title,
                                 "text": [title + "\n", body + "\n"], "anchors": [], "categories": "",
                                 "history": {}}))
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("shard_store")
    write_kilt(root / "ks.json", N)
    prepare(PrepareConfig(out=str(root / "store"), kilt_ks=str(root / "ks.json"), model_dir=tiny_model_dir,
                          entity_max_len=24, rows_per_part=32, progress=False), log=lambda s: None)
    return str(root / "store")


def entity_state(model_dir: str, preset: str = "dual", m: int | None = None, noise: float = 0.0, seed: int = 0):
    spec = ScoreSpec.preset(preset, m=m)
    state = EntityEncoder(Encoder.from_pretrained(model_dir), spec).state()
    if noise:
        g = torch.Generator().manual_seed(seed)
        state["weights"] = {k: v + noise * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
                            for k, v in state["weights"].items()}
    return state


@pytest.fixture(scope="module")
def states(tiny_model_dir):
    return [entity_state(tiny_model_dir), entity_state(tiny_model_dir, noise=0.05, seed=1),
            entity_state(tiny_model_dir, noise=0.05, seed=2)]


def make_shard(store_dir, root, rows=(30, 75), shard=1, preset="dual", m=None, **cfg) -> EntityShard:
    config = ServiceConfig(**{"encode_dtype": "fp32", "encode_batch_size": 8, **cfg})
    config.index = IndexConfig(backend="torch", chunk_rows=16)
    retriever = RetrieverConfig(preset=preset, m=m, storage_dtype="float32")
    return EntityShard(store_dir, rows, shard, 3, retriever, config, str(root), D)


QUERIES = torch.randn(5, D, generator=torch.Generator().manual_seed(0))
GOLD = torch.tensor([31, 0, 74, -1, 50])


# --------------------------------------------------------------------------- the encode loop


@pytest.mark.parametrize("preset,m", [("dual", None), ("multi", 3), ("som", None)])
def test_encode_rows_equals_encoding_each_row_alone(store_dir, tiny_model_dir, preset, m):
    store = EntityStore(store_dir).slice(10, 50)
    encoder = EntityEncoder.from_state(entity_state(tiny_model_dir, preset, m))
    done = []
    reps = encode_rows(encoder, store, batch_size=7, device=torch.device("cpu"), autocast=None,
                       storage_dtype="float32", progress=done.append)
    assert done[-1] == 40 and done == sorted(done)
    lengths = store.lengths(np.arange(40))
    for row in range(40):
        ids = torch.from_numpy(store.token_ids([row])[:, :lengths[row]])
        alone = encoder(ids, torch.ones_like(ids, dtype=torch.bool))
        vec = reps.vecs[row]
        if preset == "dual":
            assert reps.mask is None
            torch.testing.assert_close(vec, alone.vecs[0], atol=2e-5, rtol=1e-4)
            continue
        width = m if preset == "multi" else store.max_len
        real = int(min(lengths[row], width))
        assert vec.shape == (width, D)
        assert reps.mask[row].tolist() == [True] * real + [False] * (width - real)
        torch.testing.assert_close(vec[:real], alone.vecs[0, :real], atol=2e-5, rtol=1e-4)
        assert not vec[real:].any(), "padded positions are stored as zeros"


def test_bf16_autocast_encoding_stays_close_to_fp32(store_dir, tiny_model_dir):
    store = EntityStore(store_dir).slice(0, 30)
    encoder = EntityEncoder.from_state(entity_state(tiny_model_dir))
    cpu = torch.device("cpu")
    exact = encode_rows(encoder, store, 8, cpu, None, "float32").vecs
    fast = encode_rows(encoder, store, 8, cpu, torch.bfloat16, "float32").vecs
    # bf16 rounds the matmul inputs to 8 mantissa bits (LayerNorm stays fp32 under autocast).
    rel = (fast - exact).norm(dim=1) / exact.norm(dim=1)
    assert 0 < float(rel.max()) < 0.01, "bf16 was applied, and stays within 1%"
    assert autocast_dtype("fp32", cpu) is None and autocast_dtype("bf16", cpu) is torch.bfloat16
    with pytest.raises(ValueError, match="encode_dtype"):
        autocast_dtype("int8", cpu)


def test_encode_rows_runs_without_autograd(store_dir, tiny_model_dir):
    encoder = EntityEncoder.from_state(entity_state(tiny_model_dir))
    seen = []
    encoder.register_forward_pre_hook(lambda module, args: seen.append(torch.is_inference_mode_enabled()))
    encode_rows(encoder, EntityStore(store_dir).slice(0, 20), 8, torch.device("cpu"), None, "float32")
    assert seen and all(seen)


def test_a_compiled_encoder_encodes_like_eager_and_sees_swapped_weights(store_dir, states, tmp_path):
    # service.encode_compile: the shard compiles its encoder once; a refresh swaps the weights in
    # place, and the compiled graph must encode with the NEW weights (no stale constants)
    eager = make_shard(store_dir, tmp_path / "eager")
    compiled = make_shard(store_dir, tmp_path / "compiled", encode_compile=True)
    for version, state in enumerate(states[:2]):
        want = eager.refresh(state, version)
        got = compiled.refresh(state, version)
        assert want == got == version
        a = eager.score_rows(QUERIES, torch.arange(30, 75).expand(5, -1), version=version)
        b = compiled.score_rows(QUERIES, torch.arange(30, 75).expand(5, -1), version=version)
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert hasattr(compiled._encoder.encoder.model, "_compiled_call_impl")  # nn.Module.compile() ran
    assert compiled._encoder.encoder.model._compiled_call_impl is not None
    # the two states encode differently, so equality above is not trivially the first weights twice
    first = EntityEncoder.from_state(states[0])
    assert not torch.allclose(first.encoder.model.embeddings.word_embeddings.weight,
                              compiled._encoder.encoder.model.embeddings.word_embeddings.weight)


@pytest.mark.skipif(attention_unavailable() is not None, reason="native attention unavailable")
def test_a_bf16_shard_encodes_with_the_native_attention_like_sdpa(store_dir, states, tmp_path):
    # service.encode_attention auto: bf16 encodes on this CPU run the native kernel; the version's
    # manifest says which attention encoded it; the reps agree with sdpa's within bf16 rounding
    native = make_shard(store_dir, tmp_path / "native", encode_dtype="bf16")
    model = make_shard(store_dir, tmp_path / "model", encode_dtype="bf16", encode_attention="model")
    assert native.refresh(states[1], 0) == model.refresh(states[1], 0) == 0
    used = {name: json.loads((tmp_path / name / shard_dir_name(1, 3) / version_dir_name(0) / "manifest.json")
                             .read_text())["encode_attention"] for name in ("native", "model")}
    assert used == {"native": "dist_nce_bf16", "model": "sdpa"}
    rows = torch.arange(30, 75).expand(5, -1)
    a = model.score_rows(QUERIES, rows, version=0)
    b = native.score_rows(QUERIES, rows, version=0)
    torch.testing.assert_close(b, a, rtol=0.03, atol=0.03)


def test_length_sorted_batches_cover_every_row_once_longest_first():
    lengths = np.array([3, 9, 9, 1, 5, 7, 2])
    batches = length_sorted_batches(lengths, 3)
    assert [len(b) for b in batches] == [3, 3, 1]
    assert sorted(np.concatenate(batches).tolist()) == list(range(7))
    flat = lengths[np.concatenate(batches)]
    assert (np.diff(flat) <= 0).all()


# --------------------------------------------------------------------------- persist, swap, reload


def test_refresh_persists_and_a_restarted_shard_reloads_instead_of_encoding(store_dir, states, tmp_path):
    first = make_shard(store_dir, tmp_path)
    assert first.status()["served"] == -1
    with pytest.raises(NoIndexError, match="no index yet"):
        first.topk(QUERIES, 3)
    assert first.refresh(states[0], 0) == 0
    st = first.status()
    assert (st["served"], st["source"], st["encodes"], st["persisted"]) == (0, "encoded", 1, [0])
    manifest = json.loads((tmp_path / shard_dir_name(1, 3) / version_dir_name(0) / "manifest.json").read_text())
    assert manifest["rows"] == [30, 75] and manifest["n"] == 45 and manifest["shape"] == [45, D]
    assert manifest["encoder_fingerprint"] == state_fingerprint(states[0])
    assert manifest["store_fingerprint"] == store_fingerprint(store_dir)
    want = first.gumbel_topk(QUERIES, 6, GOLD, 7, torch.arange(5))

    again = make_shard(store_dir, tmp_path)  # what Ray's restart does: __init__ with the same arguments
    st = again.status()
    assert (st["served"], st["source"], st["encodes"]) == (0, "reloaded", 0)
    got = again.gumbel_topk(QUERIES, 6, GOLD, 7, torch.arange(5))
    assert torch.equal(got.ids, want.ids) and torch.equal(got.keys, want.keys) and got.version == 0
    assert again.refresh(states[0], 0) == 0 and again.status()["encodes"] == 0, "same weights: nothing to do"


def test_versions_only_increase_and_the_previous_one_stays_available(store_dir, states, tmp_path):
    shard = make_shard(store_dir, tmp_path, keep_versions=2)
    answers = {}
    for v in range(3):
        shard.refresh(states[v], v)
        answers[v] = shard.topk(QUERIES, 4, GOLD)
        assert answers[v].version == v
    st = shard.status()
    assert (st["served"], st["held"], st["persisted"]) == (2, [1, 2], [1, 2])
    old = shard.topk(QUERIES, 4, GOLD, version=1)
    assert old.version == 1 and torch.equal(old.ids, answers[1].ids) and torch.equal(old.scores, answers[1].scores)
    with pytest.raises(VersionUnavailable, match="does not hold version 0"):
        shard.topk(QUERIES, 4, GOLD, version=0)
    with pytest.raises(ValueError, match="versions must increase"):
        shard.refresh(states[0], 1)
    # The served number with other weights is refused too: encoding over it gave one number two encodings
    # while the other shards still served the first (a search merged over shards mixed them).
    with pytest.raises(ValueError, match="serves already from other weights; versions must increase"):
        shard.refresh(states[0], 2)
    assert shard.refresh(states[2], 2) == 2 and shard.status()["encodes"] == 3, "the same weights: nothing to do"
    # An evicted version that is still persisted comes back from disk.
    restarted = make_shard(store_dir, tmp_path, keep_versions=2)
    assert restarted.status()["held"] == [2]
    again = restarted.topk(QUERIES, 4, GOLD, version=1)
    assert again.version == 1 and torch.equal(again.scores, answers[1].scores)


def test_going_back_to_a_version_leaves_the_newer_ones_to_be_made_again(store_dir, states, tmp_path):
    """A rerun goes back to its checkpoint's version (use_version) and replays the steps that made the newer
    ones, numbered as before (actors.sequencer): one made from the same weights is reused, one made otherwise
    is encoded over, and until then no query is answered from the one on disk (it may be replaced), nor
    does a restarted shard serve it (PersistedVersions.ceiling)."""
    shard = make_shard(store_dir, tmp_path, keep_versions=3)
    for v in range(3):
        shard.refresh(states[v], v)
    answers = {v: shard.topk(QUERIES, 4, GOLD, version=v) for v in range(3)}
    assert shard.use_version(0) == 0 and shard.status()["held"] == [0]  # the newer ones left memory
    with pytest.raises(VersionUnavailable, match="does not hold version 2"):  # on disk, newer than served
        shard.topk(QUERIES, 4, GOLD, version=2)
    # Nor does the shard restarted (by Ray, mid-rerun): it used to serve the killed run's version 2 again.
    assert make_shard(store_dir, tmp_path, keep_versions=3).status()["served"] == 0
    encodes = shard.status()["encodes"]
    assert shard.refresh(states[1], 1) == 1 and shard.status()["encodes"] == encodes  # the replay: reused
    assert shard.topk(QUERIES, 4, GOLD).scores.tolist() == answers[1].scores.tolist()
    assert make_shard(store_dir, tmp_path, keep_versions=3).status()["served"] == 1
    assert shard.refresh(states[0], 2) == 2 and shard.status()["encodes"] == encodes + 1  # other weights
    again = shard.topk(QUERIES, 4, GOLD, version=2)
    assert again.scores.tolist() == answers[0].scores.tolist() != answers[2].scores.tolist()
    assert make_shard(store_dir, tmp_path, keep_versions=3).topk(QUERIES, 4, GOLD).scores.tolist() == \
        answers[0].scores.tolist(), "version 2 on disk is the new one"


def test_a_persisted_version_that_does_not_match_is_refused(store_dir, states, tmp_path):
    shard = make_shard(store_dir, tmp_path)
    shard.refresh(states[0], 0)
    shard.refresh(states[1], 1)
    manifest_path = tmp_path / shard_dir_name(1, 3) / version_dir_name(1) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["store_fingerprint"] = "0" * 64  # as if made from another prepared store
    manifest_path.write_text(json.dumps(manifest))

    restarted = make_shard(store_dir, tmp_path)
    st = restarted.status()
    assert st["served"] == 0, "falls back to the previous version"
    assert len(st["refused"]) == 1 and "version 1" in st["refused"][0] and "store_fingerprint" in st["refused"][0]

    other_rows = make_shard(store_dir, tmp_path, rows=(30, 70))  # same shard slot, another split
    st = other_rows.status()
    assert st["served"] == -1 and all("'rows'" in r for r in st["refused"]) and len(st["refused"]) == 2
    with pytest.raises(NoIndexError):
        other_rows.topk(QUERIES, 3)
    other_spec = make_shard(store_dir, tmp_path, preset="multi", m=3)
    assert other_spec.status()["served"] == -1 and "'spec'" in other_spec.status()["refused"][-1]


def test_score_rows_answers_owned_rows_and_nan_elsewhere(store_dir, states, tmp_path):
    shard = make_shard(store_dir, tmp_path)
    shard.refresh(states[0], 0)
    rows = torch.tensor([[30, 74, 75, 3], [40, 0, 41, 89], [31, 32, 33, 34], [29, 30, 60, 61], [50, 50, 51, 1]])
    got = shard.score_rows(QUERIES, rows, version=0)
    owned = (rows >= 30) & (rows < 75)
    assert torch.isnan(got[~owned]).all()
    index = shard._index(0)
    want = index.score_rows(QUERIES, torch.where(owned, rows, 30))
    assert torch.equal(got[owned], want[owned])


def test_a_state_of_another_model_is_refused(store_dir, tiny_model_dir, states, tmp_path):
    shard = make_shard(store_dir, tmp_path)
    with pytest.raises(ValueError, match="spec"):
        shard.refresh(entity_state(tiny_model_dir, "multi", 3), 0)
    wide = EntityShard(store_dir, (0, 30), 0, 3, RetrieverConfig(storage_dtype="float32"),
                       ServiceConfig(encode_dtype="fp32"), str(tmp_path), 64)
    with pytest.raises(ValueError, match="hidden size 32.*d=64"):
        wide.refresh(states[0], 0)


def test_searches_during_a_refresh_answer_from_the_old_version_until_the_swap(store_dir, states, tmp_path):
    shard = make_shard(store_dir, tmp_path, encode_batch_size=1)  # slow refresh: one row per forward
    shard.refresh(states[0], 0)
    ref = {0: shard.topk(QUERIES, 5, GOLD)}
    thread = threading.Thread(target=shard.refresh, args=(states[1], 1))
    thread.start()
    seen = []
    while thread.is_alive():
        seen.append(shard.topk(QUERIES, 5, GOLD))
    waited = shard.topk(QUERIES, 5, GOLD, version=1, wait_s=30)
    thread.join()
    ref[1] = shard.topk(QUERIES, 5, GOLD)
    versions = [r.version for r in seen] + [waited.version]
    assert versions == sorted(versions) and versions[-1] == 1 and 0 in versions
    for r in seen + [waited]:  # each answer is exactly one version's answer, never a mixture
        assert torch.equal(r.ids, ref[r.version].ids) and torch.equal(r.scores, ref[r.version].scores)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_packed_shard_encodes_like_a_padded_one(store_dir, states, tmp_path, dtype):
    # service.encode_pack: a refresh through the shard with only the real tokens through the encoder (over
    # the native kernel in bf16 where the CPU has it); the manifest says so; the same scores within rounding
    padded = make_shard(store_dir, tmp_path / "padded", encode_dtype=dtype)
    packed = make_shard(store_dir, tmp_path / "packed", encode_dtype=dtype, encode_pack=True)
    assert padded.refresh(states[1], 0) == packed.refresh(states[1], 0) == 0
    used = json.loads((tmp_path / "packed" / shard_dir_name(1, 3) / version_dir_name(0) / "manifest.json")
                      .read_text())["encode_attention"]
    assert used == ("dist_nce_packed_dist_nce_bf16" if dtype == "bf16" and attention_unavailable() is None
                    else "dist_nce_packed_sdpa")
    rows = torch.arange(30, 75).expand(5, -1)
    tol = 1e-4 if dtype == "fp32" else 0.03
    torch.testing.assert_close(packed.score_rows(QUERIES, rows, version=0), padded.score_rows(QUERIES, rows, version=0),
                               rtol=tol, atol=tol)
