"""Driver side of reranker training: TorchTrainer wiring, the printed plan, the result table."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dist_nce.core.config import to_dict
from dist_nce.rerank.config import RerankJobConfig
from dist_nce.rerank.data import RerankPlan, TrainingSet
from dist_nce.worker.launch import fit_and_release, make_torch_trainer, use_gpu  # noqa: F401 (re-exported)


def fit(cfg: RerankJobConfig):
    """Train (or resume: same run.name and storage_path) on ``run.num_workers`` workers; the ray.train Result."""
    from dist_nce.rerank.loop import train_func

    return fit_and_release(make_torch_trainer(train_func, cfg, {"job": to_dict(cfg)}))


def describe_plan(cfg: RerankJobConfig, plan: RerankPlan, ts: TrainingSet, gpu: bool) -> str:
    ds = json.loads(Path(cfg.deepspeed.config).read_text())
    stage = cfg.deepspeed.zero_stage if cfg.deepspeed.zero_stage is not None else \
        ds.get("zero_optimization", {}).get("stage", 0)
    bf16 = cfg.deepspeed.bf16 if cfg.deepspeed.bf16 is not None else ds.get("bf16", {}).get("enabled", False)
    r = cfg.model.reranker
    c = ts.candidates
    lines = [
        f"model: joint cross-encoder ({r.head} head) from {cfg.model.init_from or r.model or 'MiniLM'}, pairs of "
        f"L = {r.max_len} tokens",
        f"worker: this process, plain torch (no DeepSpeed), {'bf16 autocast' if bf16 else 'fp32'} on "
        f"{'GPU' if gpu else 'CPU'}" if cfg.run.backend == "local" else
        f"workers: {plan.num_workers} x DeepSpeed ZeRO-{stage} {'bf16' if bf16 else 'fp32'} on "
        f"{'GPU (NCCL)' if gpu else 'CPU (gloo)'}",
        f"global batch: {plan.global_batch} mentions = {plan.num_workers} workers x {plan.per_worker_batch}, "
        f"C = {plan.num_candidates} candidates each ({plan.global_batch * plan.num_candidates} pairs per step)",
        f"candidates: {cfg.data.candidates_format} ({ts.source}); {c.n_unknown_documents:,} unknown document ids "
        f"dropped, {c.n_truncated:,} lists cut to C",
        f"training mentions: {plan.train_mentions:,} of {plan.split_mentions:,} ({plan.excluded_missing_gold:,} "
        f"excluded: gold not in the KB); gold inserted for {plan.gold_inserted:,} the retriever missed",
        f"steps: {plan.steps_per_epoch:,} per epoch x {plan.epochs} epochs = {plan.total_steps:,}",
    ]
    return "\n".join("  " + line for line in lines)


def accuracy_table(reports: dict[str, Any]) -> str:
    """split x (U.Acc, N.Acc) macro over worlds and micro, with the candidates' recall@C and the
    retriever's R@1 on the same mentions (macro: what U.Acc macro has to beat)."""
    lines = [f"{'split':<8}{'mentions':>9}{'U.Acc macro':>13}{'N.Acc macro':>13}{'U.Acc micro':>13}"
             f"{'N.Acc micro':>13}{'cand. R macro':>15}{'retr. R@1 macro':>17}"]
    for split, rep in reports.items():
        u, n = rep["unnormalized_accuracy"], rep["normalized_accuracy"]
        rec = next(v for k, v in rep.items() if k.startswith("candidate_recall@"))
        r1 = rep["retriever_recall@1"]["macro"]
        lines.append(f"{split:<8}{rep['n_mentions']:>9}{u['macro']:>13.4f}{n['macro']:>13.4f}{u['micro']:>13.4f}"
                     f"{n['micro']:>13.4f}{rec['macro']:>15.4f}{r1:>17.4f}")
    return "\n".join(lines)
