"""The training step's forward with its masks checked on the host (modeling.retriever.host_checked):
the same scores, loss and gradients as the forward that checks them on the device, and nothing read
back from the device in forward, loss or backward (issue 37 item 3), counted with torch.profiler."""
import copy

import pytest
import torch
from torch.profiler import profile

from dist_nce.modeling.encoder import Encoder
from dist_nce.modeling.losses import adjusted_nce_loss, check_log_q
from dist_nce.modeling.retriever import Retriever, RetrieverConfig, host_checked
from dist_nce.train.batches import trimmed

PRESETS = [("dual", None), ("poly", 3), ("multi", 3), ("som", None)]
# What makes the host wait for a GPU: reading a value back (.item(), bool(), int(), float()) and ops
# whose output shape depends on values. On a CPU they run without waiting, but the profiler records them.
READS = ("aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::nonzero")


@pytest.fixture(scope="module")
def base_encoder(tiny_model_dir):
    return Encoder.from_pretrained(tiny_model_dir)


def make(base_encoder, preset, m) -> Retriever:
    torch.manual_seed(0)
    return Retriever(RetrieverConfig(preset=preset, m=m), copy.deepcopy(base_encoder), copy.deepcopy(base_encoder))


def batch(mention_lengths, cand_lengths, seed=0):
    """Left-aligned rows cut to the longest, as the training step builds them (train.batches.trimmed)."""
    g = torch.Generator().manual_seed(seed)
    b, k = len(mention_lengths), len(cand_lengths[0])
    m_ids, m_mask = trimmed(torch.randint(1000, 3000, (b, 12), generator=g).int().numpy(),
                            torch.tensor(mention_lengths).numpy())
    c_ids, c_mask = trimmed(torch.randint(1000, 3000, (b, k, 11), generator=g).int().numpy(),
                            torch.tensor(cand_lengths).numpy())
    m_ids[:, 0] = c_ids[..., 0] = 101
    log_q = -torch.rand(b, k - 1, generator=g) - 1.0
    return m_ids, m_mask, c_ids, c_mask, log_q


def step(model, m_ids, m_mask, c_ids, c_mask, log_q, padded):
    """Forward, adjusted loss and backward of the training step; (loss, scores, gradients)."""
    model.zero_grad()
    checked = padded is not None
    scores = model(m_ids, m_mask, c_ids, c_mask, **(padded or {})).float()
    loss = adjusted_nce_loss(scores, log_q, checked=checked)
    loss.backward()
    return loss.detach(), scores.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                            if p.grad is not None}


def reads(fn) -> dict[str, int]:
    with profile() as prof:
        fn()
    out: dict[str, int] = {}
    for e in prof.events():
        if e.name in READS:
            out[e.name] = out.get(e.name, 0) + 1
    return out


@pytest.mark.parametrize("preset,m", PRESETS)
@pytest.mark.parametrize("lengths", ["padded", "full"])
def test_the_host_checked_step_equals_the_device_checked_one(base_encoder, preset, m, lengths):
    model = make(base_encoder, preset, m)
    if lengths == "padded":
        data = batch([5, 9, 2], [[3, 8, 5, 2], [6, 4, 1, 7], [2, 2, 3, 5]])
    else:
        data = batch([6, 6, 6], [[7] * 4] * 3)
    padded = host_checked(data[1], data[3])
    assert {k: padded[k] for k in ("mention_padded", "cand_padded")} == \
        {"mention_padded": lengths == "padded", "cand_padded": lengths == "padded"}
    assert torch.equal(padded["mention_lengths"], data[1].sum(-1))
    assert torch.equal(padded["cand_lengths"], data[3].sum(-1).reshape(-1))
    want = step(model, *data, padded=None)
    got = step(model, *data, padded=padded)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("preset,m", PRESETS)
def test_the_host_checked_step_reads_nothing_back(base_encoder, preset, m):
    model = make(base_encoder, preset, m)
    data = batch([5, 9, 2], [[3, 8, 5, 2], [6, 4, 1, 7], [2, 2, 3, 5]])
    padded = host_checked(data[1], data[3])
    before = reads(lambda: step(model, *data, padded=None))
    # trim_padding, the reductions' checks and transformers' look for padding, per tower; log_q's two checks
    assert sum(before.values()) >= 6, before
    assert reads(lambda: step(model, *data, padded=padded)) == {}


@pytest.mark.parametrize("preset,m", PRESETS)
@pytest.mark.parametrize("attention", ["padded", "nested"])
def test_the_packed_step_equals_the_padded_one(base_encoder, preset, m, attention):
    """RetrieverConfig.pack_tokens: both towers run on the real tokens only (modeling.packed). In float64
    the scores, loss and every gradient are the padded step's to 1e-9 of their scale (in fp32 the other
    GEMM shapes' summation orders leave up to ~8% of the scale on gradients that cancel to near zero);
    with the CPU's padded attention nothing is read back."""
    model = make(base_encoder, preset, m).double()
    torch.manual_seed(0)
    packing = Retriever(RetrieverConfig(preset=preset, m=m, pack_tokens=True, packed_attention=attention),
                        copy.deepcopy(base_encoder), copy.deepcopy(base_encoder)).double()
    packing.load_state_dict(model.state_dict())
    *data, log_q = batch([5, 9, 2], [[3, 8, 5, 2], [6, 4, 1, 7], [2, 2, 3, 5]])
    padded = host_checked(data[1], data[3])
    want = step(model, *data, log_q.double(), padded=None)
    got = step(packing, *data, log_q.double(), padded=padded)
    torch.testing.assert_close(got[0], want[0], rtol=1e-9, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-9 * float(want[1].abs().max()))
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        scale = float(want[2][name].abs().max())
        torch.testing.assert_close(got[2][name], want[2][name], rtol=0, atol=max(1e-9 * scale, 1e-15),
                                   msg=lambda e: f"{name} (max |grad| {scale:.3g}): {e}")
    if attention == "padded":
        packing.float()
        assert reads(lambda: step(packing, *data, log_q, padded=padded)) == {}


def test_lengths_are_left_out_for_rows_that_are_not_a_run():
    holed = torch.tensor([[True, False, True], [True, True, False]])
    assert host_checked(holed) == {"mention_padded": True}


def test_a_frozen_tower_step_passes_the_mention_side_alone(base_encoder):
    model = make(base_encoder, "dual", None)
    m_ids, m_mask, c_ids, c_mask, _ = batch([5, 9], [[3, 8], [6, 4]])
    with torch.no_grad():
        cached = model.encode_entities(c_ids, c_mask)
        padded = host_checked(m_mask)
        assert padded.keys() == {"mention_padded", "mention_lengths"} and padded["mention_padded"]
        want = model(m_ids, m_mask, cand_reps=cached)
        assert reads(lambda: model(m_ids, m_mask, cand_reps=cached, **padded)) == {}
        torch.testing.assert_close(model(m_ids, m_mask, cand_reps=cached, **padded), want, rtol=0, atol=1e-6)


def test_host_checked_refuses_what_the_device_checks_would():
    good = torch.tensor([[True, True], [True, False]])
    with pytest.raises(ValueError, match="mention row 1 .* has no real first token"):
        host_checked(torch.tensor([[True, True], [False, False]]))
    with pytest.raises(ValueError, match="cand row 2 .* has no real first token"):
        host_checked(good, torch.tensor([[[True, True], [True, False]], [[False, False], [True, True]]]))
    with pytest.raises(ValueError, match="last mention column is padding in every row"):
        host_checked(torch.tensor([[True, False], [True, False]]))
    with pytest.raises(ValueError, match="bool CPU tensor"):
        host_checked(good.long())
    with pytest.raises(ValueError, match="bool CPU tensor"):
        host_checked(good.to("meta"))


def test_log_q_is_checked_on_the_host_with_the_losss_messages():
    check_log_q(torch.tensor([[-0.5, -2.0]]))
    with pytest.raises(ValueError, match="non-finite"):
        check_log_q(torch.tensor([[-0.5, float("-inf")]]))
    with pytest.raises(ValueError, match="must be log-probabilities"):
        check_log_q(torch.tensor([[0.5, -1.0]]))
    scores = torch.tensor([[1.0, 0.5, 0.2]])
    with pytest.raises(ValueError, match="must be log-probabilities"):  # unchecked: the loss still checks
        adjusted_nce_loss(scores, torch.tensor([[0.5, -1.0]]))
