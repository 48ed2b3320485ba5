"""The training plan: derived quantities and the deterministic data order (pure functions).

Everything a worker needs to know WHICH mentions it trains on at global step ``t`` is a
pure function of the config, the training split and ``t``:

* eligible mentions: those whose gold entity is in the KB (``gold_row >= 0``); the others
  are excluded and counted (docs/design.md section 8: counted and reported, never silently dropped);
* epoch ``e`` visits the eligible mentions in a permutation seeded by ``(seed, e)``; step
  ``t`` of the run is step ``t % steps_per_epoch`` of epoch ``t // steps_per_epoch`` and
  takes ``global_batch`` consecutive mentions of that permutation (the tail that does not
  fill a global batch is dropped, so every worker takes the same number of steps);
* worker ``r`` takes slice ``[r * b, (r + 1) * b)`` of the global batch, ``b`` the
  per-worker batch.

So resuming at step ``t`` needs nothing but ``t``: no sampler state is checkpointed. The
negatives of a mention are made reproducible the same way: its Gumbel noise is keyed by
``query_key = epoch * num_mentions + mention index`` (fresh noise every epoch, the same
noise after a restart) and each request's seed by ``(seed, epoch, step, rank)``
(:mod:`dist_nce.sampling.keys`).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from dist_nce.sampling.modes import sampler_for
from dist_nce.sampling.samplers import Sampler
from dist_nce.train.config import TrainJobConfig


# Settings a resumed run must share with its checkpoint besides the plan's quantities: how the weights are
# scored and what they are trained towards. Before, a rerun that changed one resumed as if nothing had, and a
# finished run rerun so re-reported its trained weights under the new settings (a dual run scored as SOM, a run
# at lr 5e-4 recorded as 1e-2), overwriting its summary and candidates. Not here: what only changes speed or
# bookkeeping (dtypes, packing, prefetch, refresh cadence, evaluation, logging), and where the initial weights
# come from (model paths, init_from: a resume loads the checkpoint's weights, and a path differs between two
# `ray job submit --working-dir` copies of the same project; another architecture fails the load itself).
RESUME_SETTINGS = ("model.retriever.preset", "model.retriever.m", "model.freeze_entity_encoder", "optim.lr",
                   "optim.weight_decay", "optim.warmup_proportion", "optim.grad_clip", "negatives.adjusted_loss",
                   "negatives.temperature")


def settings_of(cfg: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    """{dotted key: value} of ``cfg`` (a config dataclass) for each of ``keys``."""
    out = {}
    for key in keys:
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        out[key] = value
    return out


def sampling(mode: str, p: float, num_candidates: int) -> Sampler:
    """The sampler of ``negatives.mode`` for K = ``num_candidates`` (K-1 negatives): random, hard, or
    mixed-p with ``negatives.num_hard(p, K-1)`` hard and the rest random (``dist_nce.sampling.modes``)."""
    return sampler_for(mode, num_candidates - 1, p)


@dataclass(frozen=True)
class TrainPlan:
    num_workers: int
    per_worker_batch: int
    global_batch: int
    num_candidates: int
    n_hard: int
    n_random: int
    num_entities: int
    split_mentions: int  # all mentions of the training split (query keys range over these)
    train_mentions: int  # eligible: gold in the KB (after max_train_mentions)
    excluded_missing_gold: int
    steps_per_epoch: int
    epochs: int
    total_steps: int  # the LR schedule's length: epochs * steps_per_epoch, capped by max_steps
    seed: int
    # The prepared store's identity (sha256 of its manifest): resuming on a store prepared
    # again (other synthetic settings, new sources) would silently continue on other data.
    data_fingerprint: str = ""
    settings: dict[str, Any] = field(default_factory=dict)  # RESUME_SETTINGS' values (worker.checkpoint)
    # The KB version whose golds give the data order: the store's current one when the run starts (a gold a
    # KB delta added before it is trained on), kept for the whole run and its resumptions, so that deltas
    # taken meanwhile never move the order and a resumed run replays it (checkpoints before it: 0).
    order_kb_version: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def is_epoch_start(self, step: int) -> bool:
        return step % self.steps_per_epoch == 0


ORDER_KB_VERSION = "order_kb_version"  # train_loop_config key: a fresh run's TrainPlan.order_kb_version


def eligible_mentions(gold_rows: np.ndarray, max_mentions: int = 0) -> tuple[np.ndarray, int]:
    """(indices of mentions with a gold in the KB [n] int64, number excluded for a missing gold).

    ``max_mentions`` > 0 keeps the first N mentions of the split before filtering.
    """
    gold = np.asarray(gold_rows, dtype=np.int64)
    if max_mentions:
        gold = gold[:max_mentions]
    keep = np.flatnonzero(gold >= 0).astype(np.int64)
    return keep, int(len(gold) - len(keep))


def make_plan(cfg: TrainJobConfig, gold_rows: np.ndarray, num_entities: int, data_fingerprint: str = "",
              order_kb_version: int = 0) -> TrainPlan:
    """Derived quantities of a run; raises ValueError when the data cannot fill one step. ``gold_rows``: [N]
    the training split's golds at KB version ``order_kb_version`` (-1: none)."""
    eligible, excluded = eligible_mentions(gold_rows, cfg.data.max_train_mentions)
    global_batch = cfg.optim.batch_size
    steps_per_epoch = len(eligible) // global_batch
    if steps_per_epoch == 0:
        raise ValueError(f"{len(eligible)} training mentions with a gold in the KB ({excluded} excluded) "
                         f"cannot fill one global batch of {global_batch}")
    s = sampling(cfg.negatives.mode, cfg.negatives.p, cfg.negatives.num_candidates)
    if s.num_negatives > num_entities - 1:
        raise ValueError(f"K-1 = {s.num_negatives} negatives need at least {s.num_negatives + 1} entities; "
                         f"the KB has {num_entities}")
    total = steps_per_epoch * cfg.optim.epochs
    if cfg.optim.max_steps:
        total = min(total, cfg.optim.max_steps)
    return TrainPlan(
        num_workers=cfg.run.num_workers, per_worker_batch=cfg.per_worker_batch, global_batch=global_batch,
        num_candidates=cfg.negatives.num_candidates, n_hard=s.n_hard, n_random=s.n_random,
        num_entities=int(num_entities), split_mentions=int(len(gold_rows)), train_mentions=len(eligible),
        excluded_missing_gold=excluded, steps_per_epoch=steps_per_epoch,
        epochs=math.ceil(total / steps_per_epoch), total_steps=total, seed=cfg.optim.seed,
        data_fingerprint=data_fingerprint, settings=settings_of(cfg, RESUME_SETTINGS),
        order_kb_version=int(order_kb_version),
    )


def stop_step(plan: TrainPlan, stop_after: int) -> int:
    """Last step (exclusive) of this job: the plan's end, or ``stop_after`` steps of the run."""
    return min(plan.total_steps, stop_after) if stop_after else plan.total_steps


def epoch_order(eligible: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """The eligible mention indices in epoch ``epoch``'s order (a seeded permutation)."""
    rng = np.random.Generator(np.random.PCG64([seed, epoch]))
    return eligible[rng.permutation(len(eligible))]


def worker_slice(plan: TrainPlan, rank: int) -> slice:
    return slice(rank * plan.per_worker_batch, (rank + 1) * plan.per_worker_batch)


def step_mentions(plan: TrainPlan, order: np.ndarray, step: int, rank: int) -> np.ndarray:
    """Worker ``rank``'s mention indices [b] at global ``step`` (``order`` = that epoch's order)."""
    pos = step % plan.steps_per_epoch
    batch = order[pos * plan.global_batch:(pos + 1) * plan.global_batch]
    return batch[worker_slice(plan, rank)]


def epoch_mentions(plan: TrainPlan, order: np.ndarray, rank: int) -> np.ndarray:
    """[steps_per_epoch, b]: worker ``rank``'s mentions for every step of one epoch."""
    used = order[:plan.steps_per_epoch * plan.global_batch].reshape(plan.steps_per_epoch, plan.global_batch)
    return used[:, worker_slice(plan, rank)]


class DataOrder:
    """Caches each epoch's permutation; ``mentions(step, rank)`` is the worker's batch."""

    def __init__(self, plan: TrainPlan, eligible: np.ndarray):
        if len(eligible) != plan.train_mentions:
            raise ValueError(f"{len(eligible)} eligible mentions, the plan has {plan.train_mentions}")
        self.plan, self.eligible = plan, eligible
        self._cache: dict[int, np.ndarray] = {}

    def order(self, epoch: int) -> np.ndarray:
        if epoch not in self._cache:
            self._cache = {epoch: epoch_order(self.eligible, self.plan.seed, epoch)}
        return self._cache[epoch]

    def mentions(self, step: int, rank: int) -> np.ndarray:
        return step_mentions(self.plan, self.order(self.plan.epoch_of(step)), step, rank)

    def epoch(self, epoch: int, rank: int) -> np.ndarray:
        return epoch_mentions(self.plan, self.order(epoch), rank)
