"""Train the joint cross-encoder reranker on a retriever's top-64 Zeshel candidates, then evaluate it.

Training: NCE over each mention's C = 64 candidates with the gold at index 0 (inserted in
place of the lowest-ranked candidate when the retriever missed it); Ray Train + DeepSpeed
workers, checkpoints and resume, TensorBoard scalars, tqdm. Evaluation: unnormalized
accuracy (all mentions) and normalized accuracy (mentions whose gold is among the
candidates) on val and test, macro over worlds as in the paper's Table 2, and micro.
Writes ``<run.output_dir>/summary.json``, the choice per mention to
``<run.output_dir>/predictions/<split>.jsonl`` (gold, prediction, the gold's rank among the candidates:
U.Acc and N.Acc recomputed from it), the reranker to ``<run.output_dir>/reranker`` and, for the
pooler head (the default), the same weights in BLINK's cross-encoder layout to
``<run.output_dir>/crossencoder_blink.bin`` (what ``crossencoder_wiki_large.bin`` is). Starting
from BLINK's released cross-encoder: ``--set model.init_from=models/crossencoder_wiki_large.bin
--set model.reranker.model=null`` (architecture read off the weights).

Candidates come from jobs/zeshel_retriever.py (``data.candidates_dir`` = its
``candidates/``; reranker_tiny_cpu.yaml's default is what ``--config
configs/zeshel/retriever_tiny_cpu.yaml`` writes, runs/zeshel_tiny/candidates) or from Zeshel's
own TF-IDF lists. ``data.num_candidates`` (C) may not exceed the lists' length (refused before
any work); a smaller C uses the top C of each list::

    .venv/bin/python jobs/zeshel_reranker.py --config configs/zeshel/reranker_tiny_cpu.yaml
    .venv/bin/python jobs/zeshel_reranker.py --config configs/zeshel/reranker_paper_gpu.yaml \\
        --set data.candidates_dir=/data/zeshel/tfidf_candidates --set data.candidates_format=tfidf

On a Ray cluster::

    ray job submit --address http://HEAD:8265 --working-dir . -- python jobs/zeshel_reranker.py \\
        --config configs/zeshel/reranker_paper_gpu.yaml \\
        --set data.candidates_dir=/mnt/shared/runs/zeshel_som_mixed50/candidates

Running the same command again resumes from the last checkpoint (same run.name and
run.storage_path). Without Ray or DeepSpeed (one GPU, say): ``--set run.backend=local`` trains
the same worker in this process with plain torch, without checkpoints. Every config field:
``--help-config``.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from dist_nce.cli.common import ConfigJob, error, hold_run, interrupted
from dist_nce.core.config import ConfigError, to_dict
from dist_nce.rerank.config import RerankJobConfig, check_inputs, with_absolute_paths

if TYPE_CHECKING:
    from dist_nce.rerank.data import RerankPlan


def check_rerun(cfg: RerankJobConfig, plan: RerankPlan | None = None) -> None:
    """A rerun of run.name whose plan (``plan``, else computed from the data as the workers compute it)
    differs from its checkpoint's is refused here, before Ray starts (raises ConfigError); the local
    backend keeps no checkpoints."""
    from dist_nce.rerank.data import load_training_set, make_plan
    from dist_nce.worker import launch

    if cfg.run.backend == "local":
        return
    try:  # a data error (a candidates file, too few mentions) is one too, said as the run would say it
        launch.check_rerun(launch.storage_uri(cfg.run.storage_path), cfg.run.name,
                           lambda: (plan or make_plan(cfg, load_training_set(cfg))).as_dict())
    except ValueError as e:
        raise ConfigError(str(e)) from None


JOB = ConfigJob(RerankJobConfig, "experiment YAML (configs/zeshel/reranker_*.yaml)", with_absolute_paths,
                lambda cfg: {"model.reranker.model": cfg.model.reranker.model}, check_inputs, prepared=check_rerun)


def main(argv: list[str] | None = None) -> int:
    ap = JOB.parser(__doc__)
    cfg = JOB.start(ap, ap.parse_args(argv))  # every key and input checked before any cluster work
    if isinstance(cfg, int):
        return cfg
    held = hold_run(cfg.run)  # one live job per run directory: a second one stops here (status 2)
    if isinstance(held, int):
        return held
    with held:
        return train(cfg)


def train(cfg: RerankJobConfig) -> int:
    """The job after its checks, on a run this process holds: plan, training, evaluation, summary."""
    start = time.perf_counter()

    from dist_nce.cluster.runtime import configure_process
    from dist_nce.core.artifacts import atomic_write_json
    from dist_nce.rerank.data import load_training_set, make_plan
    from dist_nce.rerank.loop import RESULT_FILE
    from dist_nce.rerank.trainer import accuracy_table, describe_plan
    from dist_nce.worker.tracking import finish_tracking

    configure_process(threads=None, faiss=False)  # the reranker searches nothing
    # 1. data: the plan the workers will compute too (fails here, not on the cluster)
    from dist_nce.eval.zeshel import CandidateFileError

    try:
        ts = load_training_set(cfg)
    except CandidateFileError as e:  # lists the checks could not tell from the store's: named, not a traceback
        return error(e)
    plan = make_plan(cfg, ts)
    try:
        check_rerun(cfg, plan)
    except ConfigError as e:
        return error(e)
    if cfg.run.backend == "local":
        from dist_nce.rerank.loop import local_device, run_local

        gpu = local_device(cfg).type == "cuda"
        print(f"run {cfg.run.name} (local: this process, plain torch):\n" + describe_plan(cfg, plan, ts, gpu),
              flush=True)
        done = bool(run_local(cfg).get("done"))
    else:
        import ray

        from dist_nce.cluster.fit import DoesNotFit, check_fits, workers_request
        from dist_nce.cluster.runtime import init_ray
        from dist_nce.rerank.trainer import fit, use_gpu

        init_ray()
        try:  # else Ray Train waits for workers it cannot place, then times out
            check_fits([workers_request(cfg.run, use_gpu(cfg))], ray.cluster_resources())
        except DoesNotFit as e:
            return error(e)
        print(f"run {cfg.run.name}:\n" + describe_plan(cfg, plan, ts, use_gpu(cfg)), flush=True)
        # 2. train, evaluate, export (on the workers; resumes a run with the same name)
        try:
            done = bool((fit(cfg).metrics or {}).get("done"))
        except (KeyboardInterrupt, SystemExit):  # Ctrl-C: Ray Train aborted the run
            return interrupted(cfg.run)
    out = Path(cfg.run.output_dir)
    final = json.loads((out / RESULT_FILE).read_text()) if (out / RESULT_FILE).exists() else {}
    done = done and final.get("step") == plan.total_steps
    summary = {"config": to_dict(cfg), "plan": plan.as_dict(), "done": done, "step": final.get("step"),
               "eval": {s: final["eval"][s] for s in cfg.data.eval_splits} if done else None,
               "export": final.get("export"), "blink_export": final.get("blink_export"),
               "blink_skipped": final.get("blink_skipped"), "blink_note": final.get("blink_note"),
               "seconds": round(time.perf_counter() - start, 1),
               "engine": final.get("engine"),  # device, DeepSpeed accelerator, ZeRO stage, bf16
               # The path may be inside Ray's temporary copy of the working directory: keep the content.
               "deepspeed_config": json.loads(Path(cfg.deepspeed.config).read_text(encoding="utf-8"))}
    atomic_write_json(out / "summary.json", summary)
    # 3. run.tracking: U.Acc/N.Acc and the reranker into the run the worker opened
    finish_tracking(cfg.run.tracking, str(out), cfg.run.name, summary, summary.get("export"),
                    lambda m: print(m, flush=True))
    if done:
        print(f"reranker over {cfg.data.candidates_format} candidates (C = {cfg.data.num_candidates}); macro = mean "
              "over worlds:\n" + accuracy_table(summary["eval"]))
    state = "finished" if done else f"stopped at step {summary['step']} (run again to continue)"
    print(f"{state} in {summary['seconds']} s; summary: {out / 'summary.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
