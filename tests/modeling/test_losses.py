"""dist_nce.modeling.losses against the cross-entropy and hand-written formulas."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dist_nce.modeling.losses import adjusted_nce_loss, nce_loss


def _scores(b=4, k=6, seed=0, dtype=torch.float64):
    return torch.randn(b, k, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _by_hand(scores, temperature=1.0):
    """mean_b -log( exp(s_b0 / tau) / sum_k exp(s_bk / tau) ), written out."""
    e = torch.exp(scores / temperature)
    return (-torch.log(e[:, 0] / e.sum(1))).mean()


def test_whole_label_set_without_duplicates_is_cross_entropy():
    g = torch.Generator().manual_seed(1)
    n, b = 7, 5
    full = torch.randn(b, n, generator=g, dtype=torch.float64)  # scores over every label
    gold = torch.randint(0, n, (b,), generator=g)
    # candidates: the gold first, then every other label once, in a random order
    cand = torch.stack([torch.cat([gold[i:i + 1], torch.tensor([y for y in torch.randperm(n, generator=g).tolist()
                                                                if y != gold[i]])]) for i in range(b)])
    assert all(len(set(row.tolist())) == n for row in cand)
    torch.testing.assert_close(nce_loss(full.gather(1, cand)), F.cross_entropy(full, gold))


@pytest.mark.parametrize("temperature", [1.0, 0.05, 3.0])
def test_value_and_gradient_match_hand_written_formula(temperature):
    s1 = _scores().requires_grad_()
    s2 = s1.detach().clone().requires_grad_()
    ours, ref = nce_loss(s1, temperature=temperature), _by_hand(s2, temperature)
    torch.testing.assert_close(ours, ref)
    ours.backward()
    ref.backward()
    torch.testing.assert_close(s1.grad, s2.grad)
    # and the closed form: dJ/ds = (softmax(s / tau) - e_0) / (B tau)
    onehot = torch.zeros_like(s1).index_fill_(1, torch.tensor([0]), 1.0)
    closed = (torch.softmax(s1.detach() / temperature, 1) - onehot) / (s1.shape[0] * temperature)
    torch.testing.assert_close(s1.grad, closed)


def test_reductions():
    s = _scores()
    per = nce_loss(s, reduction="none")
    assert per.shape == (4,)
    torch.testing.assert_close(per.mean(), nce_loss(s))
    torch.testing.assert_close(per.sum(), nce_loss(s, reduction="sum"))


def test_adjusted_with_uniform_nu_is_a_shifted_plain_loss():
    """nu = 1/(N-1): J_ADJ(s) = J_HARD(s_1 - c, s_2..s_K) = J_HARD(s_1, s_2 + c..s_K + c), c = log((N-1)/(K-1))."""
    b, k, n = 4, 6, 1000
    s = _scores(b, k)
    log_q = torch.full((b, k - 1), -math.log(n - 1), dtype=s.dtype)
    c = math.log((n - 1) / (k - 1))
    shifted = s.clone()
    shifted[:, 0] -= c
    torch.testing.assert_close(adjusted_nce_loss(s, log_q), nce_loss(shifted))
    raised = s.clone()
    raised[:, 1:] += c
    torch.testing.assert_close(adjusted_nce_loss(s, log_q), nce_loss(raised))
    assert (adjusted_nce_loss(s, log_q, reduction="none") > nce_loss(s, reduction="none")).all()
    # written out directly: -s_1 + log(exp s_1 + (N-1)/(K-1) sum_k>1 exp s_k)
    direct = (-s[:, 0] + torch.log(torch.exp(s[:, 0]) + (n - 1) / (k - 1) * torch.exp(s[:, 1:]).sum(1))).mean()
    torch.testing.assert_close(adjusted_nce_loss(s, log_q), direct)


def test_adjusted_equals_plain_when_negatives_are_the_rest_of_the_labels():
    b, k = 3, 5  # N = K: uniform nu over the other K-1 labels gives (K-1) nu = 1
    s = _scores(b, k)
    log_q = torch.full((b, k - 1), -math.log(k - 1), dtype=s.dtype)
    torch.testing.assert_close(adjusted_nce_loss(s, log_q), nce_loss(s))


def test_adjusted_gradient_matches_hand_written_formula():
    s1 = _scores(seed=3).requires_grad_()
    s2 = s1.detach().clone().requires_grad_()
    log_q = torch.log_softmax(_scores(4, 5, seed=4), dim=1)
    adjusted_nce_loss(s1, log_q, temperature=0.5).backward()
    k = s2.shape[1]
    logits = torch.cat([s2[:, :1] / 0.5, s2[:, 1:] / 0.5 - torch.log((k - 1) * torch.exp(log_q))], 1)
    _by_hand(logits).backward()
    torch.testing.assert_close(s1.grad, s2.grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_scores_give_fp32_loss(dtype):
    s = _scores(dtype=torch.float32)
    low = nce_loss(s.to(dtype))
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, nce_loss(s.to(dtype).float()))


@pytest.mark.parametrize(
    "call,match",
    [(lambda: nce_loss(torch.zeros(4)), r"\[B, K\]"),
     (lambda: nce_loss(torch.zeros(2, 3, 4)), r"\[B, K\]"),
     (lambda: nce_loss(torch.zeros(4, 3, dtype=torch.long)), "float"),
     (lambda: nce_loss(torch.zeros(4, 1)), "no negative"),
     (lambda: nce_loss(torch.zeros(4, 3), temperature=0.0), "temperature"),
     (lambda: nce_loss(torch.zeros(4, 3), reduction="avg"), "reduction"),
     (lambda: adjusted_nce_loss(torch.zeros(4, 3), torch.zeros(4, 3)), r"\[B, K-1\] = \[4, 2\]"),
     (lambda: adjusted_nce_loss(torch.zeros(4, 3), torch.full((4, 2), -math.inf)), "non-finite"),
     (lambda: adjusted_nce_loss(torch.zeros(4, 3), torch.full((4, 2), 0.5)), "probabilities passed")],
)
def test_bad_input_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
