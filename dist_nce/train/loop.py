"""The training worker: what each Ray Train (DeepSpeed) worker runs, as one story.

    data      the prepared store, the training split's eligible mentions, the plan
    model     the retriever, wrapped in a DeepSpeed engine (ZeRO 0-3, bf16 or fp32)
    resume    engine + RNG + step + index bookkeeping from ray.train.get_checkpoint()
    negatives a prefetcher (pipelined) or the epoch's mined negatives (per_epoch)
    loop      refresh when due -> negatives -> batch -> scores [B, K] -> NCE -> backward -> step
              (+ every bias.every_steps: Theorem 1's bias on a probe set, bias.monitor)
    finish    final refresh with the final weights, dev evaluation, export, report

``train_func`` is TorchTrainer's ``train_loop_per_worker``. Device, accelerator, collectives,
resume, logging and checkpoint files are the scaffold shared with the reranker
(``dist_nce.worker.scaffold``); :class:`Worker` takes the Ray calls as arguments so one
process can run it too (tests, benchmarks).
"""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

from dist_nce.actors.protocols import NegativeSource
from dist_nce.bias.monitor import BiasMonitor
from dist_nce.core.text import tokenizer_fingerprint
from dist_nce.index.encode import store_fingerprint
from dist_nce.modeling.losses import adjusted_nce_loss, check_log_q, nce_loss
from dist_nce.modeling.retriever import host_checked
from dist_nce.sampling.keys import query_keys, request_seed
from dist_nce.sampling.negatives import Negatives
from dist_nce.train import checkpoint
from dist_nce.train.batches import assemble_batch
from dist_nce.train.config import TrainJobConfig
from dist_nce.train.entity_cache import FrozenEntityCache
from dist_nce.train.evaluate import evaluate
from dist_nce.train.kb_follow import KbFollower
from dist_nce.train.model import build_retriever, export_model, full_state_dict, standalone_copy
from dist_nce.train.pipeline import (
    EpochNegatives, NegativePrefetcher, StepNegatives, StepRequest, mention_encoder, mine_epoch,
)
from dist_nce.train.plan import ORDER_KB_VERSION, DataOrder, eligible_mentions, make_plan, sampling, stop_step
from dist_nce.train.refresh import Publisher, refresh_due
from dist_nce.worker.checkpoint import saved_plan
from dist_nce.worker.device_time import DeviceSpan
from dist_nce.worker.scaffold import WorkerScaffold, worker_main


def train_func(config: dict[str, Any]) -> None:
    """Ray Train entry point; ``config`` = {"job": TrainJobConfig as a dict, "service": NegativeService,
    "order_kb_version": the KB version of a fresh run's data order (``train.trainer.order_kb_version``)}."""
    worker_main(TrainJobConfig, config, lambda cfg, *a, **kw: Worker(
        cfg, config["service"], *a, order_kb_version=config.get(ORDER_KB_VERSION), **kw))


class Worker(WorkerScaffold):
    mean_keys = ("train/loss", "train/gold_score", "train/negative_score", "time/negatives_wait_s")
    state_cls = checkpoint.TrainState

    def __init__(self, cfg: TrainJobConfig, service: NegativeSource, rank: int, world: int, device: torch.device | str,
                 report: Callable[..., None] | None = None, get_checkpoint: Callable[[], Any] | None = None,
                 order_kb_version: int | None = None):
        super().__init__(cfg, rank, world, device, report, get_checkpoint)
        self.service = service
        self.order_kb_version = order_kb_version  # None: the KB version the service serves
        self.epoch_neg: EpochNegatives | None = None
        self.restored_pending: StepNegatives | None = None
        self.prefetcher: NegativePrefetcher | None = None

    # ------------------------------------------------------------------ the story (WorkerScaffold.run)

    def setup(self) -> None:
        self.load_data()
        self.build_model()

    def before_training(self) -> None:
        self.setup_negatives()
        if self.cfg.run.evaluate_before and self.state.step == 0 and self.state.dev_before is None:
            self.state.dev_before = self.evaluate("dev_before", step=0)

    # ------------------------------------------------------------------ setup

    def load_data(self) -> None:
        from kb.store import MentionTable

        cfg, d = self.cfg, self.cfg.data
        self.train = MentionTable(d.prepared_dir, d.train_split)
        self.dev = MentionTable(d.prepared_dir, d.dev_split)
        self.kb = KbFollower(self.service, d.prepared_dir, d.train_split)  # the KB version the shards serve
        # The data order comes from the golds of the KB version the run started at (TrainPlan.order_kb_version:
        # a resumed run reads it from its checkpoint), so KB deltas taken meanwhile never move it and a resumed
        # run replays it; golds a later delta removed are skipped per batch (train.kb_follow).
        resumed = self.get_checkpoint()
        order = int(saved_plan(resumed).get("order_kb_version", 0)) if resumed is not None else \
            self.kb.kb_version if self.order_kb_version is None else int(self.order_kb_version)
        golds = MentionTable(d.prepared_dir, d.train_split, kb_version=order).gold_rows
        # train_gold: the rows mining excludes (a gold a delta removed stays excluded; the batch skips it)
        self.store, self.train_gold, self.train_len = self.kb.store, self.kb.mining_gold, self.train.lengths
        eligible, _ = eligible_mentions(golds, d.max_train_mentions)
        self.plan = make_plan(cfg, golds, self.store.num_entities, store_fingerprint(d.prepared_dir), order)
        self.check_world()
        self.order = DataOrder(self.plan, eligible)
        self.probe = eligible[:cfg.bias.probe_mentions]  # the bias monitor's fixed probe set
        self.end = stop_step(self.plan, cfg.run.stop_after_steps)
        n_dev = min(len(self.dev), d.max_dev_mentions) if d.max_dev_mentions else len(self.dev)
        self.dev_idx = np.arange(n_dev, dtype=np.int64)
        self.sampling = sampling(cfg.negatives.mode, cfg.negatives.p, cfg.negatives.num_candidates)

    def build_model(self) -> None:
        cfg = self.cfg
        retriever = build_retriever(cfg.model, cfg.optim.seed)
        want = self.store.manifest["tokenizer_sha256"]
        if tokenizer_fingerprint(retriever.tokenizer)["sha256"] != want:
            raise ValueError(f"{cfg.data.prepared_dir} was prepared with another tokenizer than the model's; "
                             "prepare the KB with the model's tokenizer")
        self.make_engine(retriever)
        self.entity_cache: FrozenEntityCache | None = None
        if cfg.model.entity_cache:
            if self.zero3:  # the entity tower is partitioned across workers; the cache encodes outside forward
                raise ValueError("model.entity_cache: not supported under ZeRO-3 (deepspeed.config "
                                 f"{cfg.deepspeed.config}); use ZeRO 0-2")
            self.entity_cache = FrozenEntityCache(self.module.entity_side, cfg.service.encode_batch_size,
                                                  self.device)

    def restore(self, directory: str) -> checkpoint.TrainState:
        state, self.epoch_neg = checkpoint.load(self.engine, directory, self.rank, self.plan.as_dict())
        self.restored_pending = checkpoint.load_pending(directory, self.rank)
        return state

    def setup_negatives(self) -> None:
        cfg = self.cfg
        self.encode = mention_encoder(self.module, self.train.token_ids, self.train_len, self.device)
        self.publisher = Publisher(self.service, self.module, self.state.book, self.rank, self.zero3,
                                   wait=cfg.refresh.mode == "sync", barrier=self.comm.barrier,
                                   broadcast=self.comm.broadcast)
        # The shards may serve another version than the checkpoint's (one published after the
        # checkpoint this run restarted from). Serve the checkpoint's version again when the
        # shards still hold it, so the replayed steps see the index they saw the first time;
        # otherwise rebuild the index from the current weights so negatives and bookkeeping agree.
        want = self.state.book.version
        # A KB delta served after the checkpoint's last refresh has a version of its own, above the book's; the
        # checkpoint's negatives may name rows only its KB holds (and the run trained on that KB): serve it
        # again, not the refresh below it.
        want = max(want, self.state.index_version)
        served = self.comm.broadcast(self.service.version() if self.rank == 0 else None)
        if served != want and self.state.step == 0:
            # A fresh run on a store changed by KB deltas: the driver served version `want` from the initial
            # weights and then the deltas on top (NegativeService.ensure_encoded). Same weights, current KB.
            same = self.comm.broadcast(self.service.same_weights(want, served) if self.rank == 0 else None)
            if same:
                self.state.book.record(served, 0)
                want = served
        if served != want:
            restored = self.comm.broadcast(self.service.use_version(want) if self.rank == 0 else None)
            if restored:
                self.log.write(f"index served version {served}; serving version {want} again, the one this "
                               f"checkpoint trained with")
            else:
                newest = self.comm.broadcast(max(s["served"] for s in self.service.status()) if self.rank == 0
                                             else None)
                self.log.write(f"index serves version {served}, this run expects {want} (no longer held): "
                               "re-encoding the KB with the current weights")
                self.state.book.skip_past(newest)
                self.publisher.publish(self.state.step, wait=True)
        # The KB of the index version served (rank 0 may have changed it); a resumed rank, the one it followed at
        # its checkpoint, up to that (a delta served before the checkpoint is followed when a step first uses
        # its negatives, as in the run this one replays).
        followed = self.state.followed if self.state.step and len(self.state.followed) == self.world else None
        self._follow_kb(None, start=True, resume=None if followed is None else followed[self.rank])
        if self.state.kb_version != self.kb.kb_version and self.state.step:
            self.log.write(f"KB version {self.kb.kb_version} served; the checkpoint trained with "
                           f"{self.state.kb_version}")
        stored = self.kb.store_kb_version()
        served_kb = min([int(s["kb_version"]) for s in self.service.status() if s.get("kb_version") is not None],
                        default=self.kb.kb_version)
        if self.state.step and stored > served_kb:
            # A delta taken after this checkpoint: the shards went back to the checkpoint's KB with its index.
            self.log.write(f"the store is at KB version {stored}, this run serves {served_kb} (its "
                           f"checkpoint's): to serve it again, python -m dist_nce.train.kb_control "
                           f"{self.cfg.run.output_dir} --kb-version {stored}")
        self.monitor = BiasMonitor(self.service, self.sampling, self.encode, self.probe,
                                   torch.from_numpy(self.train_gold[self.probe]), cfg.bias.draws,
                                   self.plan.seed) if cfg.bias.every_steps else None
        if cfg.negatives.schedule == "pipelined":
            # Ahead up to the run's last step, not this job's (run.stop_after_steps): the end checkpoint then
            # holds the negatives the uninterrupted run mines for the next job's first steps.
            self.prefetcher = NegativePrefetcher(self.service, self.sampling, self.encode, self.request,
                                                 self.plan.total_steps, cfg.negatives.prefetch)
            self.prefetcher.start(self.state.step, self.restored_pending)

    # ------------------------------------------------------------------ negatives

    def request(self, step: int) -> StepRequest:
        idx = self.order.mentions(step, self.rank)
        epoch = self.plan.epoch_of(step)
        return StepRequest(step, idx, torch.from_numpy(self.train_gold[idx]),
                           query_keys(epoch, idx, self.plan.split_mentions),
                           request_seed(self.plan.seed, epoch, step, self.rank))

    def mine_epoch(self, epoch: int) -> float:
        p = self.plan
        mentions = self.order.epoch(epoch, self.rank)
        self.log.write(f"epoch {epoch}: mining {mentions.size} x {self.sampling.num_negatives} negatives per worker")
        neg, wait = mine_epoch(
            self.service, self.sampling, self.encode, mentions,
            gold=lambda idx: torch.from_numpy(self.train_gold[idx]),
            keys=lambda idx: query_keys(epoch, idx, p.split_mentions),
            seed=lambda c: request_seed(p.seed, epoch, c, self.rank),
            request_size=self.cfg.negatives.request_size)
        self.epoch_neg = neg._replace(epoch=epoch)
        self.epoch_gold = self.train_gold  # the golds this epoch was mined with
        return wait

    def negatives(self, step: int) -> tuple[np.ndarray, Tensor, Any, float]:
        """(mention indices [b], the golds they were mined with [b], mined negatives, seconds blocked on
        the service) for ``step``."""
        if self.prefetcher is not None:
            req, mined, wait = self.prefetcher.get(step)
            return req.mentions, req.gold, mined, wait
        epoch = self.plan.epoch_of(step)
        wait = 0.0
        if self.epoch_neg is None or self.epoch_neg.epoch != epoch:
            wait = self.mine_epoch(epoch)
        idx = self.order.mentions(step, self.rank)
        gold = getattr(self, "epoch_gold", self.train_gold)  # restored mid-epoch: the golds served now
        return idx, torch.from_numpy(gold[idx]), self.epoch_neg.step(step % self.plan.steps_per_epoch), wait

    def _follow_kb(self, version: int | None, start: bool = False, resume: list[int] | None = None) -> None:
        """Follow the KB version behind index ``version`` (None: ask the shards now; ``start``: the version
        they serve at the worker's start, or with ``resume`` [KB version, index version seen] the checkpoint's;
        train.kb_follow)."""
        if not start:
            changed = self.kb.follow(version)
        else:
            changed = self.kb.follow_served() if resume is None else self.kb.resume(*resume)
        if changed:
            self.store, self.train_gold = self.kb.store, self.kb.mining_gold
            self.log.write(f"following KB version {self.kb.kb_version}")
        self.state.kb_version = self.kb.kb_version

    def _live_part(self, idx: np.ndarray, gold: Tensor, negatives: Negatives) -> tuple[np.ndarray, Tensor, Negatives,
                                                                                      int]:
        """The mentions whose mined gold is still their live gold (train.kb_follow), and how many were skipped.
        A batch left empty keeps its rows, with its loss zeroed by the caller (skipped == len(idx))."""
        keep = self.kb.keep(idx, gold)
        skipped = int((~keep).sum())
        if skipped and skipped < len(idx):
            idx, gold, negatives = idx[keep.numpy()], gold[keep], Negatives(*(t[keep] for t in negatives))
        self.kb.skipped += skipped
        return idx, gold, negatives, skipped

    # ------------------------------------------------------------------ one step

    def loss(self, scores: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
        """The step's loss; ``log_q`` was checked on the host (:meth:`train_step`)."""
        n = self.cfg.negatives
        if n.adjusted_loss:
            return adjusted_nce_loss(scores, log_q, temperature=n.temperature, checked=True)
        return nce_loss(scores, temperature=n.temperature)

    def train_step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        refresh_wait0 = self.publisher.wait_s
        # P = 0 submits inside get()
        submit0, encode0 = (self.prefetcher.submit_s, self.prefetcher.encode_s) if self.prefetcher else (0.0, 0.0)
        if refresh_due(self.cfg.refresh, self.cfg.model.freeze_entity_encoder, self.plan, step):
            self.publisher.publish(step)
            if self.publisher.wait and self.prefetcher is not None:
                self.prefetcher.reset(step)  # sync: every batch from here on uses the new index
        t1 = time.perf_counter()
        idx, gold, mined, wait = self.negatives(step)
        t2 = time.perf_counter()
        # Random-only mining asks no shard (version -1): look at the shards every 16 steps instead.
        self._follow_kb(mined.version if mined.version >= 0 else (None if step % 16 == 0 else -1))
        idx, gold, negatives, skipped = self._live_part(idx, gold, mined.negatives)
        host = assemble_batch(self.train.token_ids(idx), self.train_len[idx], self.store, gold, negatives)
        # What the forward and the loss would otherwise read back from the device (a host-GPU
        # synchronisation each), checked here on the host copies: the step then reads back only its logs.
        padded = host_checked(host.mention_mask, None if self.entity_cache is not None else host.cand_mask)
        if self.cfg.negatives.adjusted_loss:
            check_log_q(host.log_q)
        batch = host.to(self.device)
        t3 = time.perf_counter()
        span = DeviceSpan(self.device)
        span.start()
        lr = self.optimizer.param_groups[0]["lr"]
        if self.entity_cache is not None:
            scores = self.engine(batch.mention_ids, batch.mention_mask, **padded,
                                 cand_reps=self.entity_cache.candidates(self.store, batch.candidates)).float()
        else:
            scores = self.engine(batch.mention_ids, batch.mention_mask, batch.cand_ids, batch.cand_mask,
                                 **padded).float()
        loss = self.loss(scores, batch.log_q)
        if skipped == len(idx):  # every gold of the batch removed: no signal, the step keeps the schedule
            loss = loss * 0.0
        self.engine.backward(loss)
        self.engine.step()
        span.stop()
        t4 = time.perf_counter()
        if self.prefetcher is not None:
            self.prefetcher.advance(step)
        t5 = time.perf_counter()
        self.state.step = step + 1
        s = scores.detach()
        # one read back for the three logged values
        logged, gold_score, negative_score = torch.stack([loss.detach().float(), s[:, 0].mean(),
                                                          s[:, 1:].mean()]).tolist()
        # after that read-back, so the span's events are done: the device's wall time from the forward's first
        # kernel to the optimizer step's last (compute_s stops when the host has queued them)
        device_s = span.seconds()
        return {
            "train/loss": logged, "train/lr": lr,
            "train/gold_score": gold_score, "train/negative_score": negative_score,
            "time/step_s": t5 - t0, "time/negatives_wait_s": wait, "time/batch_s": t3 - t2,
            "time/compute_s": t4 - t3, "time/refresh_s": t1 - t0,
            "time/refresh_wait_s": self.publisher.wait_s - refresh_wait0,
            "time/mine_submit_s": (self.prefetcher.submit_s - submit0) if self.prefetcher else 0.0,
            "time/mine_encode_s": (self.prefetcher.encode_s - encode0) if self.prefetcher else 0.0,
            "index/version": mined.version, "index/staleness": self.state.book.staleness(step, mined.version),
            "index/published": self.state.book.version,
            "kb/version": self.kb.kb_version, "kb/removed_gold_skipped": skipped,
            **({} if device_s is None else {"time/compute_device_s": device_s}),
        }

    def progress_postfix(self, metrics: dict[str, float]) -> dict[str, Any]:
        return {"loss": f"{metrics['train/loss']:.3f}", "v": int(metrics["index/version"]),
                "wait": f"{metrics['time/negatives_wait_s']:.2f}s"}

    def during_training(self, step: int, done: int, metrics: dict[str, float]) -> None:
        if self.monitor is not None and done % self.cfg.bias.every_steps == 0:
            bias = self.monitor.measure(done, self.rank)  # every rank encodes (ZeRO-3); rank 0 measures
            if bias is not None:
                self.log.log(step, bias)
        run = self.cfg.run
        if run.eval_every_steps and done % run.eval_every_steps == 0 and done < self.plan.total_steps:
            self.evaluate("dev", step=done)  # dev metrics are indexed by optimizer steps taken

    # ------------------------------------------------------------------ evaluation, checkpoints, end

    def evaluate(self, name: str, step: int) -> dict[str, Any] | None:
        t0 = time.perf_counter()
        out = evaluate(self.module, self.dev, self.dev_idx, self.service, self.cfg.run.eval_k,
                       self.cfg.run.eval_batch_size, self.rank, self.world, self.comm.all_gather)
        if out is not None:
            out["seconds"] = round(time.perf_counter() - t0, 2)
            self.log.log(step, {f"{name}/{k}": v for k, v in out.items() if isinstance(v, (int, float))})
            self.log.write(f"{name} @ step {step}: " + ", ".join(
                f"{k} {v:.4f}" for k, v in out.items() if k.startswith(("recall", "accuracy"))))
        return out

    def checkpoint_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        mid_epoch = self.state.step % self.plan.steps_per_epoch != 0
        tensors = checkpoint.extra_tensors(
            self.rank, self.epoch_neg if mid_epoch else None,  # a new epoch mines afresh
            self.prefetcher.in_flight_negatives() if self.prefetcher is not None else None)
        # Asked once the negatives saved with it are in (in_flight_negatives waits for them), by every rank (rank
        # 0 writes the state all ranks restore): no shard served a newer version when they were mined, so a
        # resume that serves this one (setup_negatives) holds every row they name, a KB delta's added rows too.
        # A collective, as the save is. The state is written after this returns.
        served = max(int(s["served"]) for s in self.service.status())
        self.state.index_version = max(self.comm.all_gather(served))
        self.state.followed = [list(f) for f in self.comm.all_gather([self.kb.kb_version, self.kb.seen])]
        return tensors

    def finish(self) -> dict[str, Any]:
        cfg, state = self.cfg, self.state
        done = state.step >= self.plan.total_steps
        out: dict[str, Any] = {"step": state.step, "done": done, "plan": self.plan.as_dict(),
                               "dev_before": state.dev_before,
                               "engine": self.engine_info()}
        if done:
            if not cfg.model.freeze_entity_encoder:
                self.publisher.publish(state.step, wait=True)  # the KB snapshot of the final weights
            out["index_version"] = state.book.version
            out["dev_after"] = self.evaluate("dev_after", step=state.step)
            if cfg.run.export:
                sd = full_state_dict(self.module, self.zero3, self.rank)
                if self.rank == 0:
                    out["export"] = export_model(standalone_copy(self.module, sd), cfg.run.output_dir)
                self.comm.barrier()
        self.end_checkpoint(_flat(out))
        return out


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dict -> {"a/b": v}; what ray.train.report shows best."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out
