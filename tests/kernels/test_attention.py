"""The native bf16 attention (dist_nce/kernels/attention.py, native/attention_bf16.c): against a
float64 softmax attention of the same bf16 inputs over shapes, masks and strides; threads;
the custom op under torch.library's checks and torch.compile; a transformers BERT switched
to it (used under inference, sdpa under autograd or fp32); and the service's choice.

The dispatching entry (``hf_attention``) is checked against the reference twice: on the kernel
where it runs (skipped elsewhere, with the reason), and on sdpa with ``DIST_NCE_NATIVE=off`` on
every CPU, which also checks that the switch keeps every call off the kernel."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from dist_nce.index.encode import choose_attention
from dist_nce.kernels import attention as na
from dist_nce.kernels import build as native

NATIVE_REASON = na.unavailable_reason()
needs_native = pytest.mark.skipif(NATIVE_REASON is not None, reason=f"native attention unavailable: {NATIVE_REASON}")


@pytest.fixture(params=["native", "fallback"])
def path(request, monkeypatch) -> str:
    """Which path ``hf_attention`` must take: the kernel, or sdpa with the kernel switched off."""
    if request.param == "native" and NATIVE_REASON is not None:
        pytest.skip(f"native attention unavailable: {NATIVE_REASON}")
    if request.param == "fallback":
        monkeypatch.setenv(native.SWITCH, "off")
    return request.param


class SelfAttention(torch.nn.Module):
    """What ``hf_attention`` reads of a transformers attention module: an encoder's, in eval."""

    is_causal = False


def dispatched(monkeypatch, path: str, q, k, v, mask=None, scale=None) -> torch.Tensor:
    """``hf_attention`` of the inputs, after checking it ran on ``path``."""
    calls = count_calls(monkeypatch)
    out, _ = na.hf_attention(SelfAttention().eval(), q, k, v, mask, scaling=scale)
    assert len(calls) == (path == "native")
    return out


def qkv(B: int, H: int, W: int, D: int, seed: int = 0, scale: float = 1.0):
    """q, k, v [B, H, W, D] bf16 as a transformer makes them: views of one [B, W, 3, H, D] projection."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, W, 3, H, D, generator=g) * scale).bfloat16()
    return tuple(x[:, :, i].transpose(1, 2) for i in range(3))


def reference(q, k, v, mask=None, scale=None):
    """float64 softmax attention of the bf16 inputs -> [B, W, H, D]; rows with no key give 0."""
    s = q.double() @ k.double().transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.nan_to_num(s.softmax(-1), nan=0.0)
    return (p @ v.double()).transpose(1, 2)


def padding(B: int, W: int, seed: int) -> torch.Tensor:
    lengths = torch.randint(1, W + 1, (B,), generator=torch.Generator().manual_seed(seed))
    return (torch.arange(W)[None, :] < lengths[:, None])[:, None, None, :]


@pytest.mark.parametrize("B,H,W,D", [(3, 2, 5, 16), (2, 3, 37, 32), (4, 2, 64, 64), (2, 1, 1, 48), (2, 2, 130, 32),
                                     (5, 12, 112, 32)])
@pytest.mark.parametrize("masking", ["none", "padding", "general"])
def test_matches_float64_attention_within_bf16_rounding(B, H, W, D, masking, path, monkeypatch):
    q, k, v = qkv(B, H, W, D, seed=W + D)
    mask = {"none": None, "padding": padding(B, W, W),
            "general": torch.rand(B, 1, W, W, generator=torch.Generator().manual_seed(D)) < 0.6}[masking]
    if mask is not None:
        mask = mask | (torch.arange(W)[None, None, None, :] == 0)  # every row keeps a key
    got = dispatched(monkeypatch, path, q, k, v, mask)
    assert got.shape == (B, W, H, D) and got.dtype == torch.bfloat16 and got.is_contiguous()
    want = reference(q, k, v, None if mask is None else mask.expand(B, 1, W, W))
    # bf16 output (2^-9 relative) and bf16 probabilities (2^-9 of each term): within 2^-8 of max |v|
    err = (got.double() - want).abs().max().item()
    assert err <= 2 ** -8 * v.abs().max().item(), err
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
    assert (got.double() - sdpa.double()).abs().max().item() <= 2 ** -7 * v.abs().max().item()


def test_wrong_probabilities_would_fail_the_tolerance(path, monkeypatch):
    # negative control for the test above: attention at temperature 1.1 is outside its tolerance
    q, k, v = qkv(4, 2, 64, 32, seed=1, scale=2.0)
    got = dispatched(monkeypatch, path, q, k, v, scale=32 ** -0.5 * 1.1).double()
    assert (got - reference(q, k, v)).abs().max().item() > 2 ** -8 * v.abs().max().item()


def test_a_row_without_keys_is_zero_and_others_match_the_reference(path, monkeypatch):
    q, k, v = qkv(2, 2, 20, 16, seed=3)
    mask = torch.ones(2, 1, 20, 20, dtype=torch.bool)
    mask[1, 0, 7] = False  # query 7 of sequence 1 may attend nothing
    got = dispatched(monkeypatch, path, q, k, v, mask)
    assert (got[1, 7] == 0).all()
    err = (got.double() - reference(q, k, v, mask)).abs().max().item()
    assert err <= 2 ** -8 * v.abs().max().item(), err


@needs_native
def test_strides_scale_default_and_threads_do_not_change_bits():
    q, k, v = qkv(6, 3, 45, 32, seed=4)
    mask = padding(6, 45, 4)
    base = na.attention(q, k, v, mask)
    assert torch.equal(na.attention(q.contiguous(), k.contiguous(), v.contiguous(), mask), base)
    assert torch.equal(na.attention(q, k, v, mask.expand(6, 1, 45, 45).contiguous()), base)
    assert torch.equal(na.attention(q, k, v, mask, scale=32 ** -0.5), base)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert torch.equal(na.attention(q, k, v, mask), base)
    finally:
        torch.set_num_threads(before)


@needs_native
def test_a_row_without_keys_leaves_the_others_bits_alone():
    q, k, v = qkv(2, 2, 20, 16, seed=3)
    mask = torch.ones(2, 1, 20, 20, dtype=torch.bool)
    mask[1, 0, 7] = False
    keep = torch.ones(2, 20, dtype=torch.bool)
    keep[1, 7] = False
    assert torch.equal(na.attention(q, k, v, mask)[keep], na.attention(q, k, v)[keep])


def test_bad_inputs_are_refused_with_the_reason():
    # checked before the kernel is loaded: the same answer on every CPU
    q, k, v = qkv(2, 2, 8, 16)
    with pytest.raises(ValueError, match="bf16"):
        na.attention(q.float(), k, v)
    with pytest.raises(ValueError, match="one shape"):
        na.attention(q, k[:, :, :4], v)
    q24 = torch.zeros(1, 1, 4, 24, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 16"):
        na.attention(q24, q24, q24)
    with pytest.raises(ValueError, match="mask"):
        na.attention(q, k, v, torch.ones(2, 2, 8, 8, dtype=torch.bool))


@needs_native
def test_custom_op_passes_torch_library_checks_and_compiles():
    q, k, v = qkv(2, 2, 12, 16, seed=5)
    mask = padding(2, 12, 5).expand(2, 1, 12, 12)[:, 0]
    torch.library.opcheck(na._attention_op, (q, k, v, mask, 0.25))
    torch.library.opcheck(na._attention_op, (q, k, v, None, 0.25))
    compiled = torch.compile(lambda a, b, c, m: na.attention(a, b, c, m), dynamic=True, fullgraph=True)
    m4 = padding(2, 12, 5)
    assert torch.equal(compiled(q, k, v, m4), na.attention(q, k, v, m4))


# --------------------------------------------------------------------------- transformers


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    from dist_nce.core.models import make_tiny_bert
    from transformers import AutoModel

    path = make_tiny_bert(tmp_path_factory.mktemp("bert"), hidden_size=64, num_heads=2, num_layers=2, seed=3)
    return AutoModel.from_pretrained(path, local_files_only=True).eval()


def batch(B: int = 4, W: int = 23):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1000, 2000, (B, W), generator=g)
    mask = (torch.arange(W)[None, :] < torch.tensor([W, W - 5, 9, 2][:B])[:, None]).long()
    return ids, mask


def count_calls(monkeypatch) -> list:
    calls = []
    real = na.attention

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(na, "attention", counted)
    return calls


def switched(bert):
    """A copy of ``bert`` on the kernel's attention interface whatever the CPU (use_native_attention
    switches only where the kernel runs): the calls the kernel does not cover reach sdpa anyway."""
    model = copy.deepcopy(bert)
    na._register()
    model.set_attn_implementation(na.NAME)
    return model


@needs_native
def test_a_switched_bert_encodes_like_sdpa_under_inference(bert, monkeypatch):
    native = copy.deepcopy(bert)
    assert na.use_native_attention(native) is None
    assert native.config._attn_implementation == na.NAME
    calls = count_calls(monkeypatch)
    ids, mask = batch()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = bert(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        got = native(input_ids=ids, attention_mask=mask).last_hidden_state.float()
    assert len(calls) == bert.config.num_hidden_layers
    real = mask.bool()
    # both are bf16 computations of the same function: close on real tokens, as two bf16 runs are
    torch.testing.assert_close(got[real], want[real], rtol=0.05, atol=0.05)
    assert (got[real] - want[real]).abs().mean() < 0.01


def test_a_switched_bert_uses_sdpa_under_autograd_and_in_fp32(bert, monkeypatch):
    model = switched(bert)
    calls = count_calls(monkeypatch)
    ids, mask = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autograd recording: the kernel has no backward
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    out.float().sum().backward()
    assert model.encoder.layer[0].attention.self.query.weight.grad is not None
    with torch.inference_mode():  # fp32: sdpa, and exactly the sdpa model's answer
        got = model(input_ids=ids, attention_mask=mask).last_hidden_state
        want = bert(input_ids=ids, attention_mask=mask).last_hidden_state
    assert not calls
    assert torch.equal(got, want)


def test_switch_off_keeps_every_call_on_sdpa(bert, monkeypatch):
    # even where the kernel runs: unavailable with the switch as the reason, no model switched
    # to it, and a model switched before encodes exactly as the sdpa model does
    monkeypatch.setenv(native.SWITCH, "off")
    assert na.unavailable_reason() == "DIST_NCE_NATIVE=off"
    model = copy.deepcopy(bert)
    assert na.use_native_attention(model) == "DIST_NCE_NATIVE=off"
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(native.NativeUnavailable, match="DIST_NCE_NATIVE=off"):
        na.use_native_attention(model, required=True)
    q, k, v = qkv(2, 2, 8, 16)
    with pytest.raises(native.NativeUnavailable, match="DIST_NCE_NATIVE=off"):
        na.attention(q, k, v)
    on_kernel = switched(bert)
    calls = count_calls(monkeypatch)
    ids, mask = batch()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = on_kernel(input_ids=ids, attention_mask=mask).last_hidden_state
        want = bert(input_ids=ids, attention_mask=mask).last_hidden_state
    assert not calls
    assert torch.equal(got, want)


def fresh_encoder(bert):
    from dist_nce.modeling.encoder import Encoder
    from dist_nce.modeling.retriever import EntityEncoder
    from dist_nce.modeling.scoring import ScoreSpec

    return EntityEncoder(Encoder(copy.deepcopy(bert)), ScoreSpec.preset("dual"), True)


@needs_native
def test_choose_attention_auto_takes_the_kernel_where_it_runs(bert):
    assert choose_attention(fresh_encoder(bert), "auto", torch.device("cpu"), torch.bfloat16) == na.NAME
    assert choose_attention(fresh_encoder(bert), "native", torch.device("cpu"), torch.bfloat16) == na.NAME


def test_choose_attention_follows_the_setting_without_the_kernel(bert, monkeypatch):
    monkeypatch.setenv(native.SWITCH, "off")
    cpu = torch.device("cpu")
    assert choose_attention(fresh_encoder(bert), "model", cpu, torch.bfloat16) == "sdpa"
    assert choose_attention(fresh_encoder(bert), "auto", cpu, None) == "sdpa"  # fp32 encodes keep the model's
    with pytest.raises(ValueError, match="encode_attention: native: the encode does not run in bf16"):
        choose_attention(fresh_encoder(bert), "native", cpu, None)
    assert choose_attention(fresh_encoder(bert), "auto", cpu, torch.bfloat16) == "sdpa"
    with pytest.raises(ValueError, match="encode_attention: native: DIST_NCE_NATIVE=off"):
        choose_attention(fresh_encoder(bert), "native", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="auto, native or model"):
        choose_attention(fresh_encoder(bert), "flash", cpu, torch.bfloat16)
