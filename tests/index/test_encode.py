"""index/encode.py: the precision of a shard's encodes (service.encode_weights, encode_dtype), compile auto,
encoders readied as a shard readies them, and batches without padding given no attention mask.

The encode loop itself is covered in tests/actors/test_shard.py (as the shard runs it)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import dist_nce.index.encode as encode_module
from dist_nce.actors.config import ServiceConfig
from dist_nce.core.config import ConfigError, from_dict
from dist_nce.index.encode import (Precision, autocast_dtype, compile_encoder, compile_wanted, encode_batch,
                                   encode_precision, encode_rows, prepare_encoder, static_batch_shape, static_shapes,
                                   transformer_layers)
from dist_nce.modeling.encoder import Encoder
from dist_nce.modeling.retriever import EntityEncoder
from dist_nce.modeling.scoring import ScoreSpec

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
BF16, FP32 = torch.bfloat16, torch.float32


def bf16_tolerance(layers: int) -> float:
    """Relative L2 error per row allowed for a bf16 forward (the bound benchmarks/gpu_encode.py checks on
    the GPU): bf16 keeps 8 significant bits (unit roundoff 2^-8), and the residual stream is rounded to
    bf16 after the embeddings and after each of the 2 L sub-layers, roundings that add in quadrature;
    1.5x that for the worst of a few dozen rows."""
    return 1.5 * 2.0 ** -8 * (2 * layers + 1) ** 0.5


class Rows:
    """What encode_rows reads of a store (num_entities, max_len, lengths, token_ids): rows of varied
    length, some batches with padding and some without."""

    def __init__(self, lengths: list[int], width: int, vocab: int = 1000, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.max_len = width
        self._lengths = np.asarray(lengths, dtype=np.int32)
        self.ids = np.zeros((len(lengths), width), dtype=np.int32)
        for i, n in enumerate(lengths):
            self.ids[i, :n] = rng.integers(1000, vocab, size=n) if vocab > 1000 else rng.integers(3, vocab, size=n)

    @property
    def num_entities(self) -> int:
        return len(self._lengths)

    def lengths(self, rows) -> np.ndarray:
        return self._lengths[np.asarray(rows)]

    def token_ids(self, rows) -> np.ndarray:
        return self.ids[np.asarray(rows)]


# 8 rows of 16 tokens (batches of 4 without padding), then 8 of varied length
ROWS = Rows([16] * 8 + [16, 12, 9, 9, 5, 16, 3, 7], 16, vocab=30000)


def entity_state(model_dir: str, noise: float = 0.0, seed: int = 0, preset: str = "dual", m: int | None = None) -> dict:
    state = EntityEncoder(Encoder.from_pretrained(model_dir), ScoreSpec.preset(preset, m=m)).state()
    if noise:
        g = torch.Generator().manual_seed(seed)
        state["weights"] = {k: v + noise * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
                            for k, v in state["weights"].items()}
    return state


def ready(state: dict, precision: Precision) -> EntityEncoder:
    encoder = EntityEncoder.from_state(state)
    prepare_encoder(encoder, precision, "model", False, CPU)
    return encoder


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.double() - want.double()).norm(dim=1) / want.double().norm(dim=1)).max())


# --------------------------------------------------------------------------- settings


def test_encode_precision_resolves_the_settings(monkeypatch):
    assert encode_precision("bf16", "fp32", CPU) == Precision(FP32, BF16)  # autocast over fp32 weights
    assert encode_precision("fp32", "fp32", CPU) == Precision(FP32, None)
    for dtype in ("auto", "bf16"):  # bf16 weights: the whole forward in bf16, no autocast
        assert encode_precision(dtype, "bf16", CPU) == Precision(BF16, None)
    # auto on a CPU: bf16 autocast over fp32 weights where oneDNN has bf16 kernels (AVX512-BF16/AMX),
    # fp32 elsewhere (AVX2-only CI machines); both branches forced, whatever this CPU has
    monkeypatch.setattr(encode_module, "cpu_has_fast_bf16", lambda: True)
    assert autocast_dtype("auto", CPU) is BF16
    assert encode_precision("auto", "auto", CPU) == Precision(FP32, BF16)
    monkeypatch.setattr(encode_module, "cpu_has_fast_bf16", lambda: False)
    assert autocast_dtype("auto", CPU) is None
    assert encode_precision("auto", "auto", CPU) == Precision(FP32, None)
    monkeypatch.undo()
    # the probe itself: where torch's own probe says bf16 (any AVX512BW CPU), a CPU without bf16 units (an
    # AVX512-without-BF16 server's flags, or this machine's with the mask hiding them) encodes in fp32
    import dist_nce.kernels.build as native

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512bw", "avx512_vnni"}))
    assert encode_precision("auto", "auto", CPU) == Precision(FP32, None)
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx512bw", "avx512_bf16", "amx_bf16"}))
    assert encode_precision("auto", "auto", CPU) == Precision(FP32, BF16)
    monkeypatch.setenv("DIST_NCE_NATIVE_MASK", "avx512_bf16,amx_bf16")
    assert encode_precision("auto", "auto", CPU) == Precision(FP32, None)
    monkeypatch.undo()
    assert encode_precision("bf16", "auto", CPU) == Precision(FP32, BF16)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert encode_precision("auto", "auto", CUDA) == Precision(BF16, None)  # a GPU holds bf16 weights
    assert encode_precision("bf16", "auto", CUDA) == Precision(BF16, None)
    assert encode_precision("fp16", "auto", CUDA) == Precision(FP32, torch.float16)
    assert encode_precision("fp32", "auto", CUDA) == Precision(FP32, None)
    assert encode_precision("bf16", "fp32", CUDA) == Precision(FP32, BF16)
    # a GPU that only emulates bf16 (V100, T4: torch's default answer counts emulation) encodes in fp32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert encode_precision("auto", "auto", CUDA) == Precision(FP32, None)
    # what manifests record
    assert Precision(BF16, None).compute is BF16 and Precision(BF16, None).label == "bfloat16"
    assert Precision(FP32, BF16).label == "bfloat16" and Precision(FP32, None).label == "float32"
    with pytest.raises(ValueError, match="encode_weights bf16 runs the encode in bf16, but encode_dtype is 'fp32'"):
        encode_precision("fp32", "bf16", CPU)
    with pytest.raises(ValueError, match="encode_weights must be one of auto, fp32, bf16; got 'fp8'"):
        encode_precision("auto", "fp8", CPU)


def test_compile_auto_is_off_where_compiling_measured_slower():
    # H100, BERT-large: eager bf16 58.6% of the bf16 peak, the whole model compiled 39.0% (gpu_encode)
    assert compile_wanted("auto", CUDA) is True and compile_wanted("auto", CPU) is False
    assert compile_wanted(True, CPU) is True and compile_wanted(False, CUDA) is False
    with pytest.raises(ValueError, match="encode_compile must be true, false or auto"):
        compile_wanted("always", CPU)


def test_service_config_checks_the_encode_settings():
    config = from_dict(ServiceConfig, {})
    assert config.encode_weights == "auto" and config.encode_compile == "auto"
    assert from_dict(ServiceConfig, {"encode_compile": True}).encode_compile is True
    assert from_dict(ServiceConfig, {"encode_weights": "bf16", "encode_dtype": "bf16"}).encode_weights == "bf16"
    with pytest.raises(ConfigError, match="encode_weights: 'fp8' is not one of"):
        from_dict(ServiceConfig, {"encode_weights": "fp8"})
    with pytest.raises(ConfigError, match="encode_compile: value 'always' matches none of"):
        from_dict(ServiceConfig, {"encode_compile": "always"})
    with pytest.raises(ConfigError, match="encode_weights bf16 runs the encode in bf16, but encode_dtype is 'fp16'"):
        from_dict(ServiceConfig, {"encode_weights": "bf16", "encode_dtype": "fp16"})
    with pytest.raises(ValueError, match="encode_dtype is 'fp32'"):
        ServiceConfig(encode_weights="bf16", encode_dtype="fp32").validate()


# --------------------------------------------------------------------------- bf16 weights


def test_bf16_weights_encode_like_autocast_within_bf16_rounding(tiny_model_dir):
    state = entity_state(tiny_model_dir)
    exact = encode_rows(ready(state, Precision(FP32, None)), ROWS, 4, CPU, None, "float32").vecs
    autocast = encode_rows(ready(state, Precision(FP32, BF16)), ROWS, 4, CPU, BF16, "float32").vecs
    held = ready(state, encode_precision("auto", "bf16", CPU))
    assert all(p.dtype == BF16 for p in held.parameters())
    assert held.encoder.model.embeddings.position_ids.dtype == torch.int64  # index buffers stay integers
    bf16 = encode_rows(held, ROWS, 4, CPU, None, "float32").vecs
    assert bf16.dtype == FP32 and bf16.shape == exact.shape
    tol = bf16_tolerance(held.encoder.model.config.num_hidden_layers)
    assert 0 < rel_error(bf16, exact) <= tol, "bf16 was applied, within bf16 rounding of fp32"
    assert rel_error(bf16, autocast) <= tol
    cos = torch.nn.functional.cosine_similarity(bf16, exact, dim=1)
    assert float(cos.min()) > 1 - tol ** 2


def test_a_refresh_swaps_weights_into_a_bf16_encoder_in_place(tiny_model_dir):
    first, second = entity_state(tiny_model_dir), entity_state(tiny_model_dir, noise=0.05, seed=1)
    precision = encode_precision("auto", "bf16", CPU)
    held = ready(first, precision)
    before = encode_rows(held, ROWS, 4, CPU, None, "float32").vecs
    tensors = {name: p.data_ptr() for name, p in held.named_parameters()}
    held.load_state(second)  # outside inference mode, as a shard's refresh does
    assert {name: p.data_ptr() for name, p in held.named_parameters()} == tensors  # the same tensors, new values
    assert all(p.dtype == BF16 for p in held.parameters())
    after = encode_rows(held, ROWS, 4, CPU, None, "float32").vecs
    fresh = encode_rows(ready(second, precision), ROWS, 4, CPU, None, "float32").vecs
    assert torch.equal(after, fresh), "the next encode sees the swapped weights, as a freshly built encoder"
    assert rel_error(after, before) > 10 * bf16_tolerance(2)  # and the two states are far apart


# --------------------------------------------------------------------------- batches without padding


@pytest.mark.parametrize("preset,m", [("dual", None), ("multi", 3), ("som", None)])
def test_a_batch_without_padding_encodes_alike_without_the_mask(tiny_model_dir, preset, m):
    encoder = EntityEncoder.from_state(entity_state(tiny_model_dir, preset=preset, m=m))
    ids = torch.from_numpy(ROWS.token_ids(np.arange(8)))
    real = torch.ones(ids.shape, dtype=torch.bool)
    seen = []
    hf = encoder.encoder.model
    hook = hf.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs.get("attention_mask")),
                                        with_kwargs=True)
    with torch.inference_mode():
        masked = encode_batch(encoder, ids, real)
        unmasked = encode_batch(encoder, ids, real, padded=False)
    hook.remove()
    assert seen[0] is not None and seen[1] is None  # the transformer got no mask at all
    torch.testing.assert_close(unmasked.vecs, masked.vecs, rtol=1e-5, atol=1e-6)
    assert (unmasked.mask is None) == (masked.mask is None)
    if masked.mask is not None:
        assert torch.equal(unmasked.mask, masked.mask)


def test_encode_rows_keeps_the_mask_off_cuda(tiny_model_dir, monkeypatch):
    # the mask decides sdpa's kernel on CUDA only; CPUs keep today's path (hooks, native attention)
    import dist_nce.index.encode as encode_mod

    calls = []
    real_batch = encode_mod.encode_batch
    monkeypatch.setattr(encode_mod, "encode_batch", lambda e, ids, real, padded=True:
                        calls.append(padded) or real_batch(e, ids, real, padded))
    encoder = EntityEncoder.from_state(entity_state(tiny_model_dir))
    encode_rows(encoder, ROWS, 4, CPU, None, "float32")
    assert calls == [True] * 4


# --------------------------------------------------------------------------- compiled layer by layer


def test_a_layer_compiled_encoder_encodes_like_eager_with_one_graph_for_every_layer(tiny_model_dir):
    # compile_encoder(layers=True), what encode_compile does on CUDA: each transformer layer compiled
    # (static shapes), the embeddings and the attention mask eager; the layers share one graph
    import torch._dynamo

    first, second = entity_state(tiny_model_dir), entity_state(tiny_model_dir, noise=0.05, seed=1)
    precision = Precision(FP32, None)
    eager = ready(first, precision)
    compiled = EntityEncoder.from_state(first)
    prepare_encoder(compiled, precision, "model", True, CPU, layers=True)
    stack = transformer_layers(compiled)
    assert stack is compiled.encoder.model.encoder.layer and len(stack) >= 2
    assert all(layer._compiled_call_impl is not None for layer in stack)
    assert getattr(compiled.encoder.model, "_compiled_call_impl", None) is None  # the model itself stays eager
    full = Rows([16] * 8, 16, vocab=30000)  # batches without padding: one shape, the mask eager (None)
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    got = encode_rows(compiled, full, 4, CPU, None, "float32").vecs
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1  # one graph, every layer
    torch.testing.assert_close(got, encode_rows(eager, full, 4, CPU, None, "float32").vecs, rtol=1e-4, atol=1e-5)
    compiled.load_state(second)  # a refresh swaps the weights in place: the compiled layers see them
    fresh = ready(second, precision)
    torch.testing.assert_close(encode_rows(compiled, full, 4, CPU, None, "float32").vecs,
                               encode_rows(fresh, full, 4, CPU, None, "float32").vecs, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- static shapes of a compiled encoder


def test_static_batch_shape_rounds_to_a_handful_of_lengths():
    shape = static_batch_shape
    assert [shape(3, n, 4, 128)[1] for n in (1, 31, 32, 33, 64, 65, 100, 128)] == [32, 32, 32, 64, 64, 96, 128, 128]
    assert shape(3, 7, 512, 128) == (512, 32)  # the short last batch is filled up to the batch size
    for width in (16, 24, 40, 128, 130, 512):  # at most 4 lengths, each a multiple of 8 or the width itself
        lengths = {shape(1, n, 1, width)[1] for n in range(1, width + 1)}
        assert len(lengths) <= 4 and max(lengths) == width and all(t % 8 == 0 or t == width for t in lengths)
        assert all(shape(1, n, 1, width)[1] >= n for n in range(1, width + 1))
    assert sorted({shape(1, n, 1, 130)[1] for n in range(1, 131)}) == [40, 80, 120, 130]
    with pytest.raises(ValueError, match="rows"):
        shape(5, 3, 4, 16)


# rows of 1..40 tokens (store width 40) in batches of 8, the last one of 5 rows
RAGGED = Rows([int(n) for n in np.random.default_rng(3).permutation(np.arange(1, 41))[:37]], 40, vocab=30000)


def spy_compile(monkeypatch) -> list[tuple[tuple[int, ...], bool]]:
    """Make ``nn.Module.compile`` wrap the layer's call in a spy (eager) instead of dynamo: returns the
    (hidden states shape, masked) of every call that reaches a "compiled" layer."""
    seen = []

    def fake_compile(fn, *args, **kwargs):
        def spy(hidden, *rest, **kw):
            mask = kw.get("attention_mask", rest[0] if rest else None)
            seen.append((tuple(hidden.shape), mask is not None))
            return fn(hidden, *rest, **kw)
        return spy

    monkeypatch.setattr(torch, "compile", fake_compile)
    return seen


@pytest.mark.parametrize("preset,m", [("dual", None), ("multi", 3), ("som", None)])
def test_a_static_shape_encoder_sees_a_handful_of_shapes_and_encodes_like_the_plain_path(
        tiny_model_dir, monkeypatch, preset, m):
    # issue 35 item 5: every (batch, longest) shape was a compile, past dynamo's limit of 8 on a GPU refresh
    state = entity_state(tiny_model_dir, preset=preset, m=m)
    plain = EntityEncoder.from_state(state)
    want = encode_rows(plain, RAGGED, 8, CPU, None, "float32")
    seen = spy_compile(monkeypatch)
    compiled = EntityEncoder.from_state(state)
    compile_encoder(compiled, layers=True)
    assert static_shapes(compiled) and not static_shapes(plain)
    got = encode_rows(compiled, RAGGED, 8, CPU, None, "float32")
    layers = len(transformer_layers(compiled))
    assert len(seen) == 5 * layers  # 37 rows: 5 batches, each through every layer
    # 16 = ceil(40 / 4) rounded up to a multiple of 8; the last batch of 5 rows filled up to 8;
    # a mask throughout on a CPU (what the plain path does too)
    assert {shape[:2] for shape, _ in seen} == {(8, 16), (8, 32), (8, 40)}
    assert all(masked for _, masked in seen)
    torch.testing.assert_close(got.vecs, want.vecs, rtol=1e-5, atol=1e-5)
    assert (got.mask is None) == (want.mask is None)
    if want.mask is not None:
        assert torch.equal(got.mask, want.mask)
    # fewer rows than a batch: one batch of all of them, not padded up to the batch size
    seen.clear()
    few = Rows([5, 19, 3], 40, vocab=30000)
    torch.testing.assert_close(encode_rows(compiled, few, 8, CPU, None, "float32").vecs,
                               encode_rows(plain, few, 8, CPU, None, "float32").vecs, rtol=1e-5, atol=1e-5)
    assert {s[:2] for s, _ in seen} == {(3, 32)}
    # fill_to (a shard encoding a KB delta): batches filled up to the refresh's batch, whatever the rows
    for rows, fill_to, want_batches in ((few, 8, {8}), (RAGGED, 8, {8}), (RAGGED, 4, {4})):
        seen.clear()
        torch.testing.assert_close(encode_rows(compiled, rows, 8, CPU, None, "float32", fill_to=fill_to).vecs,
                                   encode_rows(plain, rows, 8, CPU, None, "float32").vecs, rtol=1e-5, atol=1e-5)
        assert {shape[0] for shape, _ in seen} == want_batches
        assert len(seen) == -(-rows.num_entities // min(8, fill_to)) * layers
    with pytest.raises(ValueError, match="fill_to"):
        encode_rows(compiled, few, 8, CPU, None, "float32", fill_to=0)


def test_a_layer_compiled_encoder_compiles_one_graph_per_length_bucket(tiny_model_dir):
    # the real thing on a CPU (inductor): rows of 37 different lengths and a ragged last batch make
    # 3 graphs (lengths 16, 32, 40, batch 8), not one per (batch, longest) shape
    import torch._dynamo

    state = entity_state(tiny_model_dir)
    compiled = EntityEncoder.from_state(state)
    prepare_encoder(compiled, Precision(FP32, None), "model", True, CPU, layers=True)
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    got = encode_rows(compiled, RAGGED, 8, CPU, None, "float32").vecs
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 3
    torch.testing.assert_close(got, encode_rows(EntityEncoder.from_state(state), RAGGED, 8, CPU, None,
                                                "float32").vecs, rtol=1e-4, atol=1e-5)


def test_a_bf16_trained_state_and_its_fp32_export_have_one_fingerprint():
    """DeepSpeed bf16 publishes bf16 weights; the export holds the same numbers in fp32: one encoding."""
    from dist_nce.index.encode import state_fingerprint
    from dist_nce.modeling.retriever import entity_state

    torch.manual_seed(0)
    bf16 = {"w": torch.randn(16, 8).bfloat16(), "b": torch.randn(8).bfloat16(), "ids": torch.arange(4)}
    def state(weights):
        return entity_state({"model_type": "bert", "hidden_size": 8}, ScoreSpec(), True, weights)

    exported = {k: (v.float() if v.is_floating_point() else v) for k, v in bf16.items()}
    assert state_fingerprint(state(bf16)) == state_fingerprint(state(exported))
    nudged = dict(exported, w=exported["w"].clone())
    nudged["w"][0, 0] += 2.0 ** -20  # no longer a bf16 value: another model
    assert state_fingerprint(state(nudged)) != state_fingerprint(state(exported))
    nan = dict(exported, b=exported["b"].clone())
    nan["b"][0] = float("nan")
    assert state_fingerprint(state(nan)) != state_fingerprint(state(exported))


# --------------------------------------------------------------------------- packed encodes


@pytest.mark.parametrize("preset,m", [("dual", None), ("multi", 3), ("som", None)])
def test_a_packed_encoder_encodes_like_the_padded_path(tiny_model_dir, preset, m):
    """service.encode_pack (issue 37 item 2): only each batch's real tokens through the encoder; the same
    vectors (and SOM masks) as the padded path, fp32 to rounding and bf16 within its tolerance."""
    state = entity_state(tiny_model_dir, preset=preset, m=m)
    plain, packed = EntityEncoder.from_state(state), EntityEncoder.from_state(state)
    assert prepare_encoder(packed, Precision(FP32, None), "model", False, CPU, pack=True) == "dist_nce_packed_sdpa"
    want = encode_rows(plain, RAGGED, 8, CPU, None, "float32")
    got = encode_rows(packed, RAGGED, 8, CPU, None, "float32")
    torch.testing.assert_close(got.vecs, want.vecs, rtol=1e-5, atol=1e-5)
    assert (got.mask is None) == (want.mask is None)
    if want.mask is not None:
        assert torch.equal(got.mask, want.mask)
    low = encode_rows(packed, RAGGED, 8, CPU, BF16, "float32")
    flat = (lambda r: r.vecs.reshape(-1, r.vecs.shape[-1]))
    keep = flat(want).norm(dim=1) > 0  # SOM's padded positions are zeros in both
    assert rel_error(flat(low)[keep], flat(want)[keep]) < bf16_tolerance(2)


def test_packing_is_not_compiled():
    assert compile_wanted("auto", CUDA, pack=True) is False and compile_wanted("auto", CUDA) is True
    with pytest.raises(ValueError, match="encode_pack and service.encode_compile: true cannot both be on"):
        from_dict(ServiceConfig, {"encode_pack": True, "encode_compile": True})
    assert from_dict(ServiceConfig, {"encode_pack": True}).encode_pack is True
    with pytest.raises(ValueError, match="a packed encoder is not compiled"):
        prepare_encoder(EntityEncoder(Encoder.from_config({"model_type": "bert", "hidden_size": 16,
                                                           "num_hidden_layers": 1, "num_attention_heads": 2,
                                                           "intermediate_size": 32, "vocab_size": 50}),
                                      ScoreSpec.preset("dual")), Precision(FP32, None), "model", True, CPU,
                        pack=True)
