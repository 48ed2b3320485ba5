"""Negative prefetching and per-epoch mining against a fake service with the NegativeService API."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dist_nce.modeling.scoring import Reps
from dist_nce.sampling.modes import sampler_for
from dist_nce.train.pipeline import (
    EpochNegatives, NegativePrefetcher, StepNegatives, StepRequest, mention_encoder, mine_epoch,
)
from tests.train.fakes import FakeService

SAMPLING = sampler_for("mixed", 3, 66.7)  # 2 hard + 1 random


class Weights:
    """Stands for the model: ``encode`` embeds the current weight version in the reps."""

    def __init__(self):
        self.version = 0

    def encode(self, idx: np.ndarray) -> Reps:
        return Reps(torch.full((len(idx), 4), float(self.version)))


def request(step: int) -> StepRequest:
    idx = np.array([2 * step, 2 * step + 1])
    return StepRequest(step, idx, torch.from_numpy(idx % 7), torch.from_numpy(idx), 1000 + step)


def run(depth: int, steps: int = 6):
    service, weights = FakeService(), Weights()
    pf = NegativePrefetcher(service, SAMPLING, weights.encode, request, end_step=steps, depth=depth)
    pf.start(0)
    got = []
    for t in range(steps):
        assert pf.in_flight() == list(range(t, min(t + depth, steps)))
        req, res, wait = pf.get(t)
        got.append((req.step, res.negatives.ids.clone()))
        weights.version += 1  # the optimizer step of t
        pf.advance(t)
    return service, got


@pytest.mark.parametrize("depth", [0, 1, 2, 3])
def test_prefetched_batches_are_mined_p_steps_ahead_with_the_weights_of_then(depth):
    service, got = run(depth)
    assert [s for s, _ in got] == list(range(6))
    mines = [c for c in service.calls if c[0] == "mine"]
    assert len(mines) == 6  # each batch mined exactly once, nothing past the end
    for step, (_, reps, gold, seed, keys) in enumerate(mines):
        assert seed == 1000 + step and keys.tolist() == [2 * step, 2 * step + 1]
        # batch t >= P is encoded right after the optimizer step of t - P, i.e. with weights
        # version t - P + 1 (P - 1 updates older than those that train on it); earlier ones at start
        expected = step if depth == 0 else (step - depth + 1 if step >= depth else 0)
        assert float(reps[0, 0]) == expected
    # The same negatives whatever the depth: they depend on the request, not on timing.
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, run(0)[1]))


def test_only_get_blocks_and_the_wait_is_what_it_measures():
    service, weights = FakeService(), Weights()
    now = [0.0]
    pf = NegativePrefetcher(service, SAMPLING, weights.encode, request, 4, depth=2, clock=lambda: now[0])
    pf.start(0)
    assert not [c for c in service.calls if c[0] == "result"]  # submitting never waits

    class SlowFuture:
        def __init__(self, inner):
            self.inner = inner

        def result(self, timeout=None):
            now[0] += 0.25
            return self.inner.result()

    pf._pending = type(pf._pending)((r, SlowFuture(f)) for r, f in pf._pending)
    _, _, wait = pf.get(0)
    assert wait == pytest.approx(0.25)


def test_submitting_times_the_encode_apart_from_the_request_and_the_call():
    service, weights = FakeService(), Weights()
    now = [0.0]

    def encode(idx):  # 0.5 s on the clock, as a device read-back would take
        now[0] += 0.5
        return weights.encode(idx)

    def slow_request(step):
        now[0] += 0.25
        return request(step)

    pf = NegativePrefetcher(service, SAMPLING, encode, slow_request, 4, depth=2, clock=lambda: now[0])
    pf.start(0)  # two submits
    assert pf.encode_s == pytest.approx(1.0) and pf.submit_s == pytest.approx(1.5)


def test_reset_drops_in_flight_requests_and_remines_them():
    service, weights = FakeService(), Weights()
    pf = NegativePrefetcher(service, SAMPLING, weights.encode, request, 10, depth=3)
    pf.start(0)
    pf.get(0)
    weights.version = 7
    pf.reset(1)  # e.g. a sync refresh before step 1
    assert pf.in_flight() == [1, 2, 3]
    mines = [c for c in service.calls if c[0] == "mine"]
    assert [float(m[1][0, 0]) for m in mines[-3:]] == [7.0, 7.0, 7.0]
    with pytest.raises(AssertionError, match="out of order"):
        pf.get(2)


def test_in_flight_negatives_restore_a_restarted_prefetcher_exactly():
    # Uninterrupted: 6 steps at depth 2. Interrupted: a checkpoint after step 2 keeps the
    # negatives of steps 3 and 4 (mined with weights the checkpoint does not have); the
    # restarted prefetcher trains on those and mines step 5 onwards as the first run did.
    _, straight = run(2)
    service, weights = FakeService(), Weights()
    pf = NegativePrefetcher(service, SAMPLING, weights.encode, request, end_step=6, depth=2)
    pf.start(0)
    for t in range(3):
        pf.get(t)
        weights.version += 1
        pf.advance(t)
    saved = StepNegatives.from_tensors(pf.in_flight_negatives().tensors())  # through the checkpoint format
    assert list(saved.steps) == [3, 4] and saved.version.tolist() == [0, 0]

    again = NegativePrefetcher(FakeService(), SAMPLING, weights.encode, request, end_step=6, depth=2)
    again.start(3, saved)
    assert again.in_flight() == [3, 4] and not again.service.calls  # nothing mined again
    got = []
    for t in range(3, 6):
        req, res, _ = again.get(t)
        got.append((req.step, res.negatives.ids))
        weights.version += 1
        again.advance(t)
    assert all(s == t and torch.equal(a, b) for (s, a), (t, b) in zip(got, straight[3:]))
    mined = [c for c in again.service.calls if c[0] == "mine"]
    assert len(mined) == 1 and float(mined[0][1][0, 0]) == 4.0  # step 5, with the weights after step 3
    # Negatives saved for other steps (an older checkpoint's) are not used.
    other = NegativePrefetcher(FakeService(), SAMPLING, weights.encode, request, end_step=6, depth=2)
    other.start(2, saved)
    assert other.in_flight() == [2, 3] and len(other.service.calls) == 2


def test_mine_epoch_in_requests_equals_one_request():
    service = FakeService()
    mentions = np.arange(30).reshape(5, 6)  # 5 steps x 6 mentions per worker
    kw = dict(gold=lambda i: torch.from_numpy(i % 11), keys=lambda i: torch.from_numpy(i * 10), seed=lambda c: c)
    whole, _ = mine_epoch(service, SAMPLING, Weights().encode, mentions, request_size=100, **kw)
    service.served = 4
    ticks = iter(range(100))  # a clock that advances 1 s a reading: each wait for a result reads it twice
    chunked, wait = mine_epoch(service, SAMPLING, Weights().encode, mentions, request_size=7, max_in_flight=3,
                               clock=lambda: float(next(ticks)), **kw)
    assert whole.ids.shape == (5, 6, 3) and torch.equal(whole.ids, chunked.ids)
    assert torch.equal(whole.hard, chunked.hard) and chunked.version.tolist() == [4] * 5
    assert len([c for c in service.calls if c[0] == "mine"]) == 1 + 5  # ceil(30 / 7) requests
    step = chunked.step(2)
    assert torch.equal(step.negatives.ids, chunked.ids[2]) and step.version == 4
    assert wait == 5.0  # the time blocked on each of the 5 results, summed


def test_epoch_negatives_round_trip_through_tensors():
    e = EpochNegatives(torch.arange(12).view(2, 2, 3), torch.rand(2, 2, 3), torch.rand(2, 2, 3) > 0.5,
                       torch.tensor([3, 4]), epoch=5)
    back = EpochNegatives.from_tensors(e.tensors())
    assert back.epoch == 5 and all(torch.equal(a, b) for a, b in zip(e[:4], back[:4]))


def test_mention_encoder_runs_in_eval_mode_and_restores_the_mode(tiny_model_dir):
    from dist_nce.modeling.retriever import Retriever, RetrieverConfig

    model = Retriever.build(RetrieverConfig(mention_model=tiny_model_dir))
    tokens = np.zeros((3, 6), np.int32)
    tokens[:, :3] = [[101, 2000, 102], [101, 2001, 102], [101, 2002, 102]]
    lengths = np.array([3, 3, 3])
    model.train()
    reps = mention_encoder(model, lambda i: tokens[i], lengths)(np.array([2, 0]))
    assert model.training and reps.vecs.shape == (2, 32) and not reps.vecs.requires_grad
    with torch.no_grad():
        model.eval()
        ref = model.encode_mentions(torch.tensor(tokens[[2, 0], :3]).long(), torch.ones(2, 3, dtype=torch.bool))
    assert torch.allclose(reps.vecs, ref.vecs)
