"""What each cell's run left behind (``summary.json``, ``metrics.jsonl``) -> one flat row of numbers.

Metric names (fractions in [0, 1]; the report prints percent):

* Zeshel retriever: ``val/R@k``, ``test/R@k`` (own world, macro over worlds: the Zeshel
  protocol), ``val/R@1``, ``test/R@1`` (own-world top-1, macro), ``heldout/R@k`` and, where the
  run's eval_k has 1, ``heldout/R@1`` (unseen mentions of the train worlds, each ranked over all the train
  worlds' entities together, micro: the trainer's dev, not the own-world protocol of val and test);
* reranker: ``val/U.Acc``, ``val/N.Acc``, ``test/U.Acc``, ``test/N.Acc`` (macro over worlds),
  the candidates' recall ``val/cand_R``, ``test/cand_R``, and the retriever's R@1 on the same
  mentions ``val/retriever_R@1``, ``test/retriever_R@1``;
* AIDA: ``dev/accuracy`` and ``dev/R@k`` for the run's ``eval_k``;
* every trained retriever: ``bias/final`` and ``bias/final_se`` (the live monitor's last
  measurement, on the trained model), ``bias/mean`` over the run's measurements, and
  ``bias/cost``: a measurement's seconds over the seconds of the ``bias.every_steps`` training
  steps between two (median logged step time), the monitor's share at the run's cadence;
* every trained retriever: ``train/step_s`` (the median logged step time: the whole step, waits for
  negatives and refreshes included) and ``train/steps_per_s`` (its inverse), what a fresher index costs
  (issue 36's staleness ablation).

Curves: ``{metric: {step: value}}`` from the trainer's dev evaluations (``dev/*`` every
``run.eval_every_steps``, ``dev_before`` at step 0, ``dev_after`` at the end) and the bias monitor.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

EVAL_SPLITS = ("val", "test")


def _metrics(d: Path) -> dict[int, dict[str, float]]:
    from dist_nce.worker.tb import read_metrics

    p = d / "metrics.jsonl"
    return read_metrics(p) if p.exists() else {}


def curves(d: Path, summary: Mapping[str, Any]) -> dict[str, dict[int, float]]:
    """``{name: {step: value}}`` for every dev metric and ``bias/norm`` (+ its SE) of a trainer run."""
    out: dict[str, dict[int, float]] = {}
    m = _metrics(d)
    for step, values in sorted(m.items()):
        for k, v in values.items():
            for prefix in ("dev/", "dev_after/", "dev_before/"):
                if k.startswith(prefix) and k[len(prefix):].startswith(("recall@", "accuracy")):
                    out.setdefault("dev/" + k[len(prefix):], {})[step] = v
            if k in ("bias/norm", "bias/norm_se", "bias/noise_floor"):
                out.setdefault(k, {})[step] = v
    before = summary.get("dev_before") or {}
    for k, v in before.items():
        if isinstance(v, (int, float)) and k.startswith(("recall@", "accuracy")):
            out.setdefault("dev/" + k, {}).setdefault(0, float(v))
    return out


def _bias(d: Path, summary: Mapping[str, Any]) -> dict[str, float]:
    m = _metrics(d)
    steps = sorted(s for s, v in m.items() if "bias/norm" in v)
    if not steps:
        return {}
    last = m[steps[-1]]
    out = {"bias/final": last["bias/norm"], "bias/final_se": last.get("bias/norm_se", math.nan),
           "bias/mean": sum(m[s]["bias/norm"] for s in steps) / len(steps), "bias/measurements": float(len(steps))}
    # Cost at the run's cadence: one measurement per bias.every_steps steps. The trainer logs the
    # time of the steps it logs (every run.log_every_steps), a sample of its step times.
    every = summary["config"]["bias"]["every_steps"]
    step_s = sorted(v["time/step_s"] for v in m.values() if "time/step_s" in v)
    seconds = [m[s]["bias/seconds"] for s in steps if "bias/seconds" in m[s]]
    if every and step_s and seconds:
        out["bias/cost"] = (sum(seconds) / len(seconds)) / (every * step_s[len(step_s) // 2])
    return out


def _speed(d: Path) -> dict[str, float]:
    step_s = sorted(v["time/step_s"] for v in _metrics(d).values() if "time/step_s" in v)
    if not step_s:
        return {}
    median = step_s[len(step_s) // 2]
    return {"train/step_s": median, "train/steps_per_s": 1.0 / median if median > 0 else math.nan}


def zeshel_row(d: Path, summary: Mapping[str, Any]) -> dict[str, float]:
    k = summary["config"]["zeshel"]["k"]
    row: dict[str, float] = {}
    for split in EVAL_SPLITS:
        rep = (summary.get("zeshel") or {}).get(split)
        if rep:
            row[f"{split}/R@{k}"] = rep["own_world"][f"recall@{k}"]["macro"]
            row[f"{split}/R@1"] = rep["own_world"]["accuracy"]["macro"]
            row[f"{split}/n"] = rep["own_world"]["n_mentions"]
    dev = summary.get("dev_after") or {}
    for cut in dict.fromkeys((k, 1)):
        if f"recall@{cut}" in dev:
            row[f"heldout/R@{cut}"] = dev[f"recall@{cut}"]
    return {**row, **_bias(d, summary), **_speed(d)}


def reranker_row(d: Path, summary: Mapping[str, Any]) -> dict[str, float]:
    row: dict[str, float] = {}
    for split, rep in (summary.get("eval") or {}).items():
        row[f"{split}/U.Acc"] = rep["unnormalized_accuracy"]["macro"]
        row[f"{split}/N.Acc"] = rep["normalized_accuracy"]["macro"]
        row[f"{split}/cand_R"] = next(v for k, v in rep.items() if k.startswith("candidate_recall@"))["macro"]
        if "retriever_recall@1" in rep:  # runs before it was recorded have only the reranker's side
            row[f"{split}/retriever_R@1"] = rep["retriever_recall@1"]["macro"]
        row[f"{split}/n"] = rep["n_mentions"]
    return row


def aida_row(d: Path, summary: Mapping[str, Any]) -> dict[str, float]:
    dev = summary.get("dev_after") or {}
    row = {f"dev/{k.replace('recall@', 'R@')}": float(v) for k, v in dev.items()
           if isinstance(v, (int, float)) and k.startswith(("recall@", "accuracy"))}
    before = summary.get("dev_before") or {}
    row.update({f"dev_before/{k.replace('recall@', 'R@')}": float(v) for k, v in before.items()
                if isinstance(v, (int, float)) and k.startswith(("recall@", "accuracy"))})
    return {**row, **_bias(d, summary), **_speed(d)}


ROWS = {"zeshel": zeshel_row, "reranker": reranker_row, "aida": aida_row}
