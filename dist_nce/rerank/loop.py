"""The reranker's training worker (each Ray Train / DeepSpeed worker runs it), as one story.

    data      the training set (candidates file -> rows, gold first) and the plan
    model     the cross-encoder in a DeepSpeed engine (ZeRO 0-3, bf16 or fp32)
    resume    engine + RNG + step from ray.train.get_checkpoint()
    loop      batch -> pairs [b, C, L] -> scores [b, C] -> NCE (gold at 0) -> backward -> step
    finish    evaluation on val/test (ranks split the mentions), export (reranker/ and BLINK's
              crossencoder_blink.bin), final report

Unlike the retriever there is no negative service: the candidates are fixed by the
retriever that wrote them. Device, accelerator, engine, resume, logging and checkpoints are
the scaffold shared with the retriever (``dist_nce.worker.scaffold``). ``run.backend: local``
runs the same worker in the job's own process with plain torch (:func:`run_local`,
``dist_nce.worker.local``): no Ray, no DeepSpeed, no checkpoints.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from dist_nce.core.artifacts import atomic_write_json, write_manifest
from dist_nce.eval.metrics import PAD
from dist_nce.eval.zeshel import PREDICTION_FIELDS, rerank, reranker_report, write_predictions
from dist_nce.modeling.blink import BlinkCheckpointError
from dist_nce.modeling.blink_crossencoder import blink_layout_note, export_blink_crossencoder
from dist_nce.modeling.losses import nce_loss
from dist_nce.modeling.reranker import Reranker, RerankerConfig
from dist_nce.modeling.resolve import load_reranker
from dist_nce.rerank.config import RerankJobConfig
from dist_nce.rerank.data import EvalSet, MentionRows, data_order, load_eval_sets, load_training_set, make_plan
from dist_nce.train.evaluate import rank_slice
from dist_nce.train.model import full_state_dict
from dist_nce.train.plan import stop_step
from dist_nce.worker.local import LocalWorker
from dist_nce.worker.scaffold import WorkerScaffold, worker_main

MODEL_DIR = "reranker"
BLINK_FILE = "crossencoder_blink.bin"  # BLINK's CrossEncoderModule layout, beside MODEL_DIR
# The worker's final result (plan, per-split reports, export); nested, so a file rather than a
# ray.train.report metric.
RESULT_FILE = "result.json"
PREDICTIONS_DIR = "predictions"  # <split>.jsonl per evaluated split: the reranker's choice per mention
PREDICTIONS_KIND = "rerank_predictions"


def build_reranker(cfg: RerankJobConfig, seed: int) -> Reranker:
    """Pretrained encoder + a new score layer (seeded), or a saved reranker (``init_from``: a
    reranker directory, or a BLINK cross-encoder file, its architecture and tokenizer from
    ``model.reranker.model`` when set) trained under the job's settings (:func:`with_job_settings`)."""
    torch.manual_seed(seed)
    if cfg.model.init_from:
        return with_job_settings(load_reranker(cfg.model.init_from, config=cfg.model.reranker), cfg.model.reranker,
                                 cfg.model.init_from)
    return Reranker.build(cfg.model.reranker)


def with_job_settings(reranker: Reranker, want: RerankerConfig, source: str) -> Reranker:
    """``reranker`` (loaded from ``source``) under the job's ``model.reranker`` (:mod:`dist_nce.rerank.start`)."""
    from dist_nce.rerank.start import job_config

    config = job_config(reranker.config, want, source,
                        getattr(reranker.model.config, "max_position_embeddings", None))
    reranker.config = config
    reranker.dropout.p = config.dropout
    return reranker


def export_reranker(reranker: Reranker, output_dir: str | Path) -> dict[str, Any]:
    """Write the final reranker (``reranker/``) and, for the pooler head on BERT, BLINK's
    cross-encoder layout (``crossencoder_blink.bin``, its ``.layout.json`` and ``.architecture.json``); returns
    {"model": dir, "blink": file or None[, "blink_skipped": why][, "blink_note": what BLINK's
    scores of a packed reranker do not reproduce]}."""
    out = Path(output_dir)
    reranker.save_pretrained(out / MODEL_DIR)
    paths: dict[str, Any] = {"model": str(out / MODEL_DIR), "blink": None}
    try:
        paths["blink"] = str(export_blink_crossencoder(reranker, out / BLINK_FILE))
    except BlinkCheckpointError as e:  # head 'cls', or a non-BERT encoder
        paths["blink_skipped"] = str(e)
        return paths
    note = blink_layout_note(reranker.config)
    if note is not None:  # the weights are BLINK's keys, but not its input layout: say so where the run reports
        paths["blink_note"] = note
    return paths


def train_func(config: dict[str, Any]) -> None:
    """Ray Train entry point; ``config`` = {"job": RerankJobConfig as a dict}."""
    worker_main(RerankJobConfig, config, RerankWorker)


def candidate_scores(engine: Any, reranker: Reranker, mention_tokens: np.ndarray, entity_tokens: np.ndarray,
                     cands: np.ndarray, device: torch.device) -> torch.Tensor:
    """scores [b, C] of the pairs (mention, candidate); empty slots (-1) get -inf.

    mention_tokens [b, Tm], entity_tokens [b, C, Te]: prepared-store rows; ``engine`` is the
    DeepSpeed engine (or the module itself) whose forward takes Pairs.
    """
    pairs = reranker.pairs(mention_tokens, entity_tokens)
    scores = engine(type(pairs)(*(t.to(device) for t in pairs))).float()
    return scores.masked_fill(torch.from_numpy(cands < 0).to(scores.device), float("-inf"))


def evaluate_sets(module: Reranker, sets: Sequence[EvalSet], num_candidates: int, batch_size: int, rank: int = 0,
                  world: int = 1, all_gather: Callable[[Any], list[Any]] | None = None, progress: bool = False,
                  predictions_dir: str | Path | None = None) -> dict[str, Any] | None:
    """Accuracy of the reranker on each set; every rank calls it, rank 0 gets {split: report}.

    Only mentions whose gold is among the candidates are scored: any other is wrong
    whatever the reranker picks (prediction -1), so skipping them changes no metric. Each
    rank reranks an equal-length slice of those mentions (``rank_slice``: equal forwards,
    as ZeRO-3 requires) and rank 0 gathers the predictions; with ``predictions_dir`` it writes
    them there, ``<split>.jsonl`` (:func:`dist_nce.eval.zeshel.write_predictions`) and a manifest.
    """
    out: dict[str, Any] = {}
    was_training = module.training
    try:
        for s in sets:
            hits = np.flatnonzero(s.candidates.gold_pos >= 0).astype(np.int64)
            mine, n_real = rank_slice(hits, rank, world)
            pred = rerank(module, MentionRows(s.mentions, mine), s.store, s.candidates.rows[mine], batch_size,
                          progress=progress and rank == 0)[:n_real]
            parts = all_gather(pred) if world > 1 else [pred]
            if rank == 0:
                full = np.full(len(s.candidates.gold_pos), PAD, dtype=np.int64)
                full[hits] = np.concatenate(parts)
                out[s.split] = {"candidates_file": s.source, **reranker_report(
                    full, s.candidates, np.asarray(s.mentions.gold_rows), s.worlds, num_candidates)}
                if predictions_dir is not None:
                    path = Path(predictions_dir) / f"{s.split}.jsonl"
                    write_predictions(path, full, s.candidates, s.mentions, s.store)
                    out[s.split]["predictions_file"] = str(path)
    finally:
        module.train(was_training)
    if rank == 0 and predictions_dir is not None and sets:
        write_manifest(predictions_dir, PREDICTIONS_KIND, 1, splits=[s.split for s in sets],
                       candidates={s.split: s.source for s in sets}, num_candidates=num_candidates,
                       fields=list(PREDICTION_FIELDS))
    return out if rank == 0 else None


class RerankWorker(WorkerScaffold):
    label = "reranker worker"
    ckpt_prefix = "dist_nce_rerank_ckpt_"
    mean_keys = ("train/loss", "train/accuracy", "train/gold_score")

    def setup(self) -> None:
        from dist_nce.core.text import tokenizer_fingerprint

        cfg = self.cfg
        reranker = build_reranker(cfg, cfg.optim.seed)
        sha = tokenizer_fingerprint(reranker.tokenizer)["sha256"]
        self.train = load_training_set(cfg, sha)
        self.plan = make_plan(cfg, self.train)
        self.check_world()
        self.order = data_order(self.plan)
        self.end = stop_step(self.plan, cfg.run.stop_after_steps)  # type: ignore[arg-type]
        self.eval_sets = load_eval_sets(cfg, sha)
        self.make_engine(reranker)

    def train_step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        pos = self.order.mentions(step, self.rank)
        cands = self.train.cands[pos]
        m_tok = self.train.mentions.token_ids(self.train.mention_idx[pos])
        e_tok = self.train.store.token_ids(np.where(cands >= 0, cands, 0))
        lr = self.optimizer.param_groups[0]["lr"]
        scores = candidate_scores(self.engine, self.module, m_tok, e_tok, cands, self.device)
        loss = nce_loss(scores)  # eq. 7 over the C candidates, gold in column 0
        self.engine.backward(loss)
        self.engine.step()
        self.state.step = step + 1
        s = scores.detach()
        real = torch.from_numpy(cands[:, 1:] >= 0).to(s.device)
        return {"train/loss": float(loss.detach()), "train/lr": lr,
                "train/accuracy": float((s.argmax(dim=1) == 0).float().mean()),
                "train/gold_score": float(s[:, 0].mean()),
                "train/negative_score": float(s[:, 1:][real].mean()) if bool(real.any()) else 0.0,
                "train/gold_inserted": float(self.train.inserted[pos].mean()),
                "time/step_s": time.perf_counter() - t0}

    def finish(self) -> dict[str, Any]:
        cfg = self.cfg
        done = self.state.step >= self.plan.total_steps
        out: dict[str, Any] = {"step": self.state.step, "done": done, "plan": self.plan.as_dict(),
                               "engine": self.engine_info()}
        if done:
            t0 = time.perf_counter()
            out["eval"] = evaluate_sets(self.module, self.eval_sets, cfg.data.num_candidates, cfg.run.eval_batch_size,
                                        self.rank, self.world, self.comm.all_gather, cfg.run.progress,
                                        Path(cfg.run.output_dir) / PREDICTIONS_DIR)
            if self.rank == 0:
                self.log.write(f"evaluated {', '.join(s.split for s in self.eval_sets)} in "
                               f"{time.perf_counter() - t0:.1f} s")
            sd = full_state_dict(self.module, self.zero3, self.rank)
            if self.rank == 0:
                final = build_reranker(cfg, cfg.optim.seed)
                final.load_state_dict(sd, strict=True)
                paths = export_reranker(final, cfg.run.output_dir)
                out["export"] = paths["model"]
                out["blink_export"] = paths["blink"]
                for key in ("blink_skipped", "blink_note"):
                    if key in paths:
                        out[key] = paths[key]
            self.comm.barrier()
        if self.rank == 0:
            atomic_write_json(Path(cfg.run.output_dir) / RESULT_FILE, out)
        self.end_checkpoint({"step": self.state.step, "done": done})
        return out


class LocalRerankWorker(LocalWorker, RerankWorker):
    """The reranker worker on a plain torch engine, alone in this process."""


def local_device(cfg: RerankJobConfig) -> torch.device:
    """``run.use_gpu`` (null: a GPU if torch sees one) as this process's device."""
    want = cfg.run.use_gpu if cfg.run.use_gpu is not None else torch.cuda.is_available()
    if want and not torch.cuda.is_available():
        raise RuntimeError("run.use_gpu=true but torch sees no CUDA device in this process")
    return torch.device("cuda" if want else "cpu")


def run_local(cfg: RerankJobConfig) -> dict[str, Any]:
    """Train, evaluate and export in this process (``run.backend: local``); the worker's final
    result, also written to ``<run.output_dir>/result.json`` as the Ray workers do."""
    return LocalRerankWorker(cfg, 0, 1, local_device(cfg)).run()
