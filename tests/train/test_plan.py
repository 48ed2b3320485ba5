"""The training plan: derived quantities and the deterministic data order."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dist_nce.core.config import from_dict
from dist_nce.sampling.keys import query_keys, request_seed
from dist_nce.train.config import TrainJobConfig
from dist_nce.train.plan import (
    DataOrder, eligible_mentions, epoch_order, make_plan, sampling, stop_step,
)


def cfg(**over) -> TrainJobConfig:
    d = {"optim": {"batch_size": 4, "epochs": 3, "seed": 7}, "run": {"num_workers": 2},
         "negatives": {"mode": "mixed", "p": 50, "num_candidates": 64}}
    for key, value in over.items():
        section, name = key.split("__")
        d.setdefault(section, {})[name] = value
    return from_dict(TrainJobConfig, d)


def test_sampling_split_follows_the_paper():
    def split(s):
        return s.n_hard, s.n_random, s.p_mixed

    assert split(sampling("mixed", 50, 64)) == (32, 31, 50.0)  # 31.5 rounds half up
    assert split(sampling("hard", 50, 64)) == (63, 0, None)
    assert split(sampling("random", 50, 64)) == (0, 63, None)
    assert sampling("mixed", 0, 64).n_hard == 0
    with pytest.raises(ValueError, match="negatives.mode"):
        sampling("hardest", 50, 64)


def test_missing_gold_is_excluded_and_counted():
    gold = np.array([3, -1, 5, -1, 0, 9])
    idx, excluded = eligible_mentions(gold)
    assert idx.tolist() == [0, 2, 4, 5] and excluded == 2
    idx, excluded = eligible_mentions(gold, max_mentions=3)
    assert idx.tolist() == [0, 2] and excluded == 1


def test_plan_quantities():
    gold = np.where(np.arange(23) % 5 == 0, -1, np.arange(23))  # 5 missing, 18 eligible
    plan = make_plan(cfg(), gold, num_entities=1000)
    assert (plan.train_mentions, plan.excluded_missing_gold, plan.split_mentions) == (18, 5, 23)
    assert (plan.global_batch, plan.per_worker_batch, plan.steps_per_epoch) == (4, 2, 4)  # tail of 2 dropped
    assert (plan.total_steps, plan.epochs, plan.n_hard, plan.n_random) == (12, 3, 32, 31)
    capped = make_plan(cfg(optim__max_steps=5), gold, 1000)
    assert (capped.total_steps, capped.epochs) == (5, 2)
    assert stop_step(plan, 0) == 12 and stop_step(plan, 7) == 7 and stop_step(plan, 99) == 12


def test_the_printed_plan_says_when_max_steps_cut_the_epochs_short():
    from pathlib import Path

    from dist_nce.train.trainer import describe_plan

    gold = np.arange(18)
    ds = str(Path(__file__).resolve().parents[2] / "configs" / "deepspeed" / "zero2_fp32.json")

    def steps_line(**over) -> str:
        c = cfg(deepspeed__config=ds, **over)
        text = describe_plan(c, make_plan(c, gold, 1000), [(0, 500), (500, 1000)], 0, gpu=False)
        return next(line.strip() for line in text.splitlines() if line.strip().startswith("steps:"))

    assert steps_line() == "steps: 4 per epoch x 3 epochs = 12"
    assert steps_line(optim__max_steps=5) == "steps: 4 per epoch x 2 epochs, capped by optim.max_steps at 5"
    assert steps_line(optim__max_steps=8) == "steps: 4 per epoch x 2 epochs = 8"


def test_plan_refuses_what_cannot_run():
    with pytest.raises(ValueError, match="cannot fill one global batch of 4"):
        make_plan(cfg(), np.array([1, -1, 2]), 1000)
    with pytest.raises(ValueError, match="K-1 = 63 negatives need at least 64 entities"):
        make_plan(cfg(), np.arange(8), 50)


def test_every_epoch_is_a_permutation_partitioned_over_workers():
    gold = np.arange(40)
    plan = make_plan(cfg(), gold, 1000)
    order = DataOrder(plan, eligible_mentions(gold)[0])
    seen_epochs = []
    for epoch in range(plan.epochs):
        steps = range(epoch * plan.steps_per_epoch, (epoch + 1) * plan.steps_per_epoch)
        per_step = [np.concatenate([order.mentions(t, r) for r in range(2)]) for t in steps]
        flat = np.concatenate(per_step)
        assert len(set(flat.tolist())) == len(flat) == 40  # each mention once per epoch
        for t, batch in zip(steps, per_step):
            assert len(batch) == plan.global_batch
        assert np.array_equal(order.epoch(epoch, 1), np.stack([order.mentions(t, 1) for t in steps]))
        seen_epochs.append(flat)
    assert not np.array_equal(seen_epochs[0], seen_epochs[1])  # reshuffled each epoch
    # The order is a pure function of (seed, epoch): a fresh object (a resumed worker) agrees.
    again = DataOrder(plan, eligible_mentions(gold)[0])
    assert np.array_equal(again.mentions(9, 0), order.mentions(9, 0))
    assert not np.array_equal(epoch_order(np.arange(40), 8, 0), epoch_order(np.arange(40), 7, 0))


def test_query_keys_and_request_seeds_are_unique_and_stable():
    keys = torch.cat([query_keys(e, np.arange(100), 100) for e in range(3)])
    assert keys.dtype == torch.int64 and len(keys.unique()) == 300
    seeds = {request_seed(0, e, t, r) for e in range(3) for t in range(20) for r in range(4)}
    assert len(seeds) == 240 and all(0 <= s < 2 ** 63 for s in seeds)
    # Stable across processes and releases: a run resumed from an older checkpoint must mine with the seeds
    # its first part used (NumPy keeps SeedSequence's output fixed), so the values are pinned.
    assert request_seed(5, 1, 2, 3) == 5935399399268843021 and request_seed(0, 0, 0, 0) == 7896617691693857887
