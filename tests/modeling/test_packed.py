"""Packed (unpadded) encoder forward (modeling.packed, issue 37 items 1 and 5): the real tokens' states
and every gradient equal the padded forward's, with both attentions over the packed rows (``nested``:
sdpa over nested jagged rows, FlashAttention varlen on CUDA; ``padded``: the model's own attention over
rows padded to the longest), for each base attention (sdpa, eager, the native CPU kernel and its
forced fallback), in fp32 tightly and in bf16 within its rounding; and nothing read back from the device."""
import copy

import pytest
import torch
from torch.profiler import profile

from dist_nce.modeling import packed
from dist_nce.modeling.encoder import Encoder

READS = ("aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::nonzero")
LENGTHS = [11, 3, 1, 7, 11, 5]  # the longest fills the width, one row is [CLS] alone


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    return Encoder.from_pretrained(tiny_model_dir).eval()


def rows(lengths, width=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 3000, (len(lengths), width), generator=g)
    lengths = torch.tensor(lengths)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    ids[:, 0] = 101
    ids[~mask] = 0
    return ids, mask, lengths


def switched(base, attention, impl="sdpa"):
    enc = copy.deepcopy(base)
    enc.model.set_attn_implementation(impl)
    enc.use_packing(attention)
    return enc


def test_plan_pack_unpack_round_trip():
    ids, mask, lengths = rows(LENGTHS)
    plan = packed.plan(lengths, ids.shape[1], "cpu")
    assert plan.tokens == sum(LENGTHS) and plan.max_len == 11 and plan.min_len == 1
    assert plan.cu_seqlens.tolist() == [0, 11, 14, 15, 22, 33, 38]
    assert plan.positions[:14].tolist() == list(range(11)) + [0, 1, 2]
    flat = packed.pack(ids, plan)
    assert flat.tolist() == ids[mask].tolist()
    back = packed.unpack(flat, plan)
    assert torch.equal(back, ids * mask)
    x = torch.randn(len(LENGTHS), 11, 4)
    assert torch.equal(packed.unpack(packed.pack(x, plan), plan), x * mask[..., None])


def test_plan_refuses_what_it_cannot_pack():
    with pytest.raises(ValueError, match="1..5"):
        packed.plan(torch.tensor([0, 3]), 5, "cpu")
    with pytest.raises(ValueError, match="1..5"):
        packed.plan(torch.tensor([6, 3]), 5, "cpu")
    with pytest.raises(ValueError, match="on the host"):
        packed.plan(torch.tensor([2, 3], device="meta"), 5, "cpu")
    with pytest.raises(ValueError, match="'nested', 'padded'"):
        packed.resolve_attention("flash", torch.device("cpu"))
    assert packed.resolve_attention("auto", torch.device("cpu")) == "padded"
    assert packed.resolve_attention("auto", torch.device("cuda")) == "nested"


def test_lengths_of_only_runs_from_the_start():
    _, mask, lengths = rows(LENGTHS)
    assert torch.equal(packed.lengths_of(mask), lengths)
    holed = mask.clone()
    holed[0, 4] = False
    assert packed.lengths_of(holed) is None
    left = torch.tensor([[False, True, True]])
    assert packed.lengths_of(left) is None


@pytest.mark.parametrize("attention", ["nested", "padded"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_states_and_gradients_equal_the_padded_forward(base, attention, impl):
    ids, mask, lengths = rows(LENGTHS)
    types = (torch.arange(11)[None, :] >= 4).long().expand(len(LENGTHS), -1) * mask
    ref = copy.deepcopy(base)
    ref.model.set_attn_implementation(impl)
    enc = switched(base, attention, impl)
    weight = torch.randn(len(LENGTHS), 11, base.hidden_size, generator=torch.Generator().manual_seed(1))
    outs = []
    for model, kw in ((ref, {}), (enc, {"lengths": lengths})):
        model.zero_grad()
        states, out_mask = model(ids, mask, types, **kw)
        assert torch.equal(out_mask, mask)
        (states * weight * mask[..., None]).sum().backward()
        outs.append((states.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (s_ref, g_ref), (s_pk, g_pk) = outs
    torch.testing.assert_close(s_pk[mask], s_ref[mask], rtol=1e-5, atol=1e-5)
    assert not s_pk[~mask].any()  # padding: zeros
    assert g_ref.keys() == g_pk.keys() and g_ref
    for name in g_ref:
        torch.testing.assert_close(g_pk[name], g_ref[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("attention", ["nested", "padded"])
def test_packed_bf16_is_within_rounding_of_fp32(base, attention):
    ids, mask, lengths = rows(LENGTHS, seed=2)
    enc = switched(base, attention)
    with torch.no_grad():
        ref = base(ids, mask).states
        with torch.autocast("cpu", torch.bfloat16):
            low = enc(ids, mask, lengths=lengths).states.float()
    err = (low[mask] - ref[mask]).abs().max()
    assert err < 0.05 * ref[mask].abs().max(), float(err)


def test_unpacked_calls_run_the_base_implementation_unchanged(base):
    ids, mask, lengths = rows(LENGTHS, seed=3)
    enc = switched(base, "padded")
    assert enc.model.config._attn_implementation == "dist_nce_packed_sdpa"
    with torch.no_grad():
        assert torch.equal(enc(ids, mask).states, base(ids, mask).states)
    enc.use_packing(None)  # lengths are then ignored
    with torch.no_grad():
        assert torch.equal(enc(ids, mask, lengths=lengths).states, base(ids, mask).states)


@pytest.mark.parametrize("native", ["on", "off"])
def test_packed_over_the_native_cpu_attention(tiny_model_dir, monkeypatch, native):
    """The shards' bf16 kernel (or, forced off, its sdpa fallback) as the base of the padded attention."""
    from dist_nce.kernels.attention import NAME, use_native_attention

    if native == "off":
        monkeypatch.setenv("DIST_NCE_NATIVE", "off")
    enc = Encoder.from_pretrained(tiny_model_dir).eval()
    ref = Encoder.from_pretrained(tiny_model_dir).eval()
    if use_native_attention(enc.model) is not None and native == "on":
        pytest.skip("native attention unavailable on this CPU (tested forced off)")
    if native == "on":
        assert enc.model.config._attn_implementation == NAME
    enc.use_packing("padded")
    enc, ref = enc.to(torch.bfloat16), ref.to(torch.bfloat16)
    ids, mask, lengths = rows([64, 17, 40, 1], width=64, seed=4)
    with torch.no_grad():
        got = enc(ids, mask, lengths=lengths).states.float()
        want = ref(ids, mask).states.float()
    err = (got[mask] - want[mask]).abs().max()
    assert err < 0.05 * want[mask].abs().max(), float(err)


def test_packed_forward_and_backward_read_nothing_back(base):
    """The CPU's attention over packed rows. (``nested`` on a CPU is torch's row-by-row fallback, which
    reads the offsets; on CUDA it is FlashAttention varlen: counted by benchmarks/gpu_train.py.)"""
    ids, mask, lengths = rows(LENGTHS, seed=5)
    enc = switched(base, "padded").train()

    def run():
        states, _ = enc(ids, mask, lengths=lengths)
        states[:, 0].sum().backward()

    run()  # warm
    with profile() as prof:
        run()
    found = [e.name for e in prof.events() if e.name in READS]
    assert found == [], found


def test_packing_refuses_rows_it_was_not_planned_for(base):
    ids, mask, lengths = rows(LENGTHS)
    enc = switched(base, "padded")
    with pytest.raises(ValueError, match="lengths give 5 rows"):
        enc(ids, mask, lengths=lengths[:5])
    with pytest.raises(ValueError, match="not a transformers model"):
        packed.enable(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="not switched"):
        packed.forward(base.model, ids, packed.plan(lengths, 11, "cpu"))
