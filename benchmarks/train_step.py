"""Where a training step's time goes, and what prefetching negatives and DeepSpeed cost or save.

One process trains with the real pieces of dist_nce/train (a Worker with world size 1: the
DeepSpeed engine, the store, the batch assembly) against a real NegativeService (local
Ray, its shards in their own processes), in three modes measured in the same run:

* ``prefetch``: negatives requested P steps ahead (negatives.prefetch), collected just
  before their batch: the time blocked on the service should be a small part of a step;
* ``sync``: the same steps with P = 0 (encode the batch, mine, wait, then train);
* ``plain``: a plain PyTorch loop (AdamW, LambdaLR, clip_grad_norm_) over the SAME
  assembled batches from the same initial weights, against DeepSpeed's forward/backward/step.

Per step: waiting for negatives (blocked in ``result()``), encoding mentions + submitting a
request (``mine_submit``; the worker's own compute, overlapped with nothing), batch
assembly, forward, backward, optimizer; ``negatives %`` is their sum's share of a step. Prints a table, saves
benchmarks/results/train_step.json (with the machine's load: read ratios on a shared machine)::

    .venv/bin/python -m benchmarks.train_step                       # MiniLM, configs/aida/tiny_cpu.yaml
    .venv/bin/python -m benchmarks.train_step --steps 30 --set negatives.num_candidates=16

With ``--refresh async`` (the default, as configs/aida/tiny_cpu.yaml trains) a refresh of the
whole KB is kept in flight during the measured steps: the negative wait is measured while
the shards re-encode, and ``refreshing %`` reports the share of steps that overlapped one.
The two DeepSpeed modes alternate in ``--rounds`` rounds (A B A B); the per-round medians
are stored as min / median / max. Refuses to record above load average 1.5 unless --force.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


import torch  # noqa: E402

from benchmarks.common import add_hygiene_args, load_guard, machine_info, print_table, save_results, spread  # noqa: E402

PARTS = ("wait", "mine_submit", "publish", "batch", "forward", "backward", "optimizer")


def sync_device() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def deepspeed_steps(worker, prefetcher, start: int, n: int, record: list | None = None,
                    publisher=None) -> list[dict]:
    """n timed steps of ``worker``'s engine with negatives from ``prefetcher``.

    ``publisher`` (refresh.mode=async): whenever no refresh is in flight at the start of a
    step, the step publishes the current entity-encoder weights (the trainer's Publisher,
    wait=False), so the shards re-encode during the measured steps; each step records
    whether a refresh was in flight (``refreshing``) and the version its negatives came from.
    """
    from dist_nce.train.batches import assemble_batch

    out = []
    for step in range(start, start + n):
        start_t, submit0 = time.perf_counter(), prefetcher.submit_s
        if publisher is not None and not publisher.pending():
            publisher.publish(step)
        refreshing = publisher is not None and publisher.pending()
        publish = time.perf_counter() - start_t
        req, mined, wait = prefetcher.get(step)  # with P = 0 this also encodes and submits
        t0 = time.perf_counter()
        batch = assemble_batch(worker.train.token_ids(req.mentions), worker.train_len[req.mentions], worker.store,
                               req.gold, mined.negatives).to(worker.device)
        t1 = time.perf_counter()
        scores = worker.engine(batch.mention_ids, batch.mention_mask, batch.cand_ids, batch.cand_mask).float()
        loss = worker.loss(scores, batch.log_q)
        sync_device()
        t2 = time.perf_counter()
        worker.engine.backward(loss)
        sync_device()
        t3 = time.perf_counter()
        worker.engine.step()
        sync_device()
        t4 = time.perf_counter()
        prefetcher.advance(step)
        t5 = time.perf_counter()
        submit = prefetcher.submit_s - submit0
        out.append({"wait": wait, "mine_submit": submit, "negatives": wait + submit, "publish": publish,
                    "batch": t1 - t0, "forward": t2 - t1, "backward": t3 - t2, "optimizer": t4 - t3,
                    "step": t5 - start_t, "refreshing": refreshing, "version": int(mined.version)})
        if record is not None:
            record.append(batch)
    return out


def plain_steps(cfg, batches: list, loss_fn) -> list[dict]:
    """The same batches through a plain PyTorch loop from the same initial weights."""
    from dist_nce.train.model import build_retriever
    from dist_nce.worker.engine import linear_warmup_decay

    model = build_retriever(cfg.model, cfg.optim.seed).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.optim.lr,
                            weight_decay=cfg.optim.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, linear_warmup_decay(len(batches), cfg.optim.warmup_proportion))
    out = []
    for batch in batches:
        t0 = time.perf_counter()
        loss = loss_fn(model(batch.mention_ids, batch.mention_mask, batch.cand_ids, batch.cand_mask).float(),
                       batch.log_q)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        out.append({"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2, "step": t3 - t0})
    return out


def summarize(name: str, steps: list[dict]) -> dict:
    row = {"mode": name, "steps": len(steps)}
    for key in (*PARTS, "negatives", "step"):
        values = [s[key] for s in steps if key in s]
        row[key] = statistics.median(values) if values else None
    mean_step = statistics.mean(s["step"] for s in steps)
    row["wait_pct"] = 100 * sum(s.get("wait", 0.0) for s in steps) / (mean_step * len(steps))
    row["negatives_pct"] = 100 * sum(s.get("negatives", 0.0) for s in steps) / (mean_step * len(steps))
    row["compute"] = sum(row[k] for k in ("forward", "backward", "optimizer"))
    if any("refreshing" in s for s in steps):
        row["refreshing_pct"] = 100 * sum(bool(s.get("refreshing")) for s in steps) / len(steps)
        row["versions"] = sorted({s["version"] for s in steps if "version" in s})
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/aida/tiny_cpu.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--rounds", type=int, default=2,
                    help="the two DeepSpeed modes alternate (A B A B ...) in this many rounds of --steps / rounds "
                         "steps each; per-round medians give the min/median/max spread")
    ap.add_argument("--refresh", choices=["async", "never"], default="async",
                    help="async: keep a refresh of the whole KB in flight during the measured steps (the trainer's "
                         "Publisher, refresh.mode=async); never: the index stays frozen")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/train_step.json)")
    add_hygiene_args(ap)
    args = ap.parse_args(argv)
    guard = load_guard(args.force)

    import ray

    from dist_nce.actors.service import NegativeService
    from dist_nce.cluster.runtime import configure_process, init_ray, single_process_dist_env
    from dist_nce.core.config import load_config
    from dist_nce.train.config import TrainJobConfig, with_absolute_paths
    from dist_nce.train.data import ensure_prepared
    from dist_nce.train.loop import Worker
    from dist_nce.train.model import build_retriever
    from dist_nce.train.pipeline import NegativePrefetcher, mention_encoder

    tmp = tempfile.mkdtemp(prefix="bench_train_step_")
    cfg = with_absolute_paths(load_config(TrainJobConfig, args.config, [
        *args.set, "run.num_workers=1", f"run.output_dir={tmp}", "run.progress=false",
        f"refresh.mode={args.refresh}", "refresh.every_steps=0", "refresh.at_epoch_start=false",
        f"optim.max_steps={3 * (args.steps + args.warmup) + 2 * args.rounds}"]))
    configure_process(threads=1)
    ensure_prepared(cfg.data, cfg.model.retriever.mention_model)
    init_ray(num_cpus=2)
    service = NegativeService.create(cfg.data.prepared_dir, cfg.model.retriever, cfg.service, tmp)
    service.ensure_encoded(ray.put(build_retriever(cfg.model, cfg.optim.seed).entity_encoder_state()))
    os.environ.update(single_process_dist_env())
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    worker = Worker(cfg, service, 0, 1, "cuda" if torch.cuda.is_available() else "cpu")
    worker.load_data()
    worker.build_model()
    worker.resume()
    encode = mention_encoder(worker.module, worker.train.token_ids, worker.train_len, worker.device)

    from dist_nce.train.refresh import Publisher

    publisher = None
    if args.refresh == "async":  # the trainer's own publisher: ray.put of the weights, shards re-encode
        publisher = Publisher(service, worker.module, worker.state.book, 0, getattr(worker, "zero3", False),
                              wait=False)
    batches, step = [], 0
    depth = max(cfg.negatives.prefetch, 1)
    modes = ((f"prefetch P={depth}", depth), ("sync P=0", 0))
    timed: dict[str, list[dict]] = {name: [] for name, _ in modes}
    per_round: dict[str, list[float]] = {name: [] for name, _ in modes}
    per_round_wait: dict[str, list[float]] = {name: [] for name, _ in modes}
    rounds = max(1, args.rounds)
    for r in range(rounds):  # A B A B ...: load that comes and goes falls on both modes
        for name, p in modes:
            pf = NegativePrefetcher(service, worker.sampling, encode, worker.request, worker.end, p)
            pf.start(step)
            deepspeed_steps(worker, pf, step, args.warmup if r == 0 else 1, publisher=publisher)
            step += args.warmup if r == 0 else 1
            n = max(1, args.steps // rounds)
            got = deepspeed_steps(worker, pf, step, n, record=batches if p else None, publisher=publisher)
            step += n
            timed[name] += got
            per_round[name].append(statistics.median(s["step"] for s in got))
            per_round_wait[name].append(100 * sum(s["wait"] for s in got) / sum(s["step"] for s in got))
            print(f"round {r + 1} {name}: {per_round[name][-1]:.3f} s/step, waiting {per_round_wait[name][-1]:.1f}%"
                  f", refreshing during {sum(bool(s['refreshing']) for s in got)}/{n} steps", flush=True)
    if publisher is not None:
        publisher.finish()
    rows = [summarize(name, timed[name]) for name, _ in modes]
    for row in rows:
        row["step_spread"] = spread(per_round[row["mode"]])
        row["wait_pct_spread"] = spread(per_round_wait[row["mode"]])
    plain_steps(cfg, batches[:args.warmup], worker.loss)
    rows.append(summarize("plain PyTorch", plain_steps(cfg, batches, worker.loss)))
    service.shutdown()

    ds, plain = rows[0], rows[-1]
    ratios = {"sync_over_prefetch_step": rows[1]["step"] / rows[0]["step"],
              "deepspeed_over_plain_compute": ds["compute"] / plain["compute"],
              "deepspeed_over_plain_optimizer": ds["optimizer"] / plain["optimizer"]}
    print_table(rows, [("mode", "mode", "<16s"), *[(k, f"{k} s", ">9.4f") for k in PARTS],
                       ("compute", "fwd+bwd+opt s", ">9.4f"), ("step", "step s", ">8.4f"),
                       ("wait_pct", "wait %", ">7.1f"), ("negatives_pct", "negatives %", ">7.1f"),
                       ("refreshing_pct", "refreshing %", ">7.1f")])
    print("  ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    b = batches[0]
    payload = {"config": args.config, "overrides": args.set, "model": cfg.model.retriever.mention_model or "MiniLM",
               "batch": {"mentions": int(b.candidates.shape[0]), "candidates": int(b.candidates.shape[1]),
                         "entity_tokens": int(b.cand_ids.shape[-1]), "mention_tokens": int(b.mention_ids.shape[-1])},
               "deepspeed": cfg.deepspeed.config, "shards": cfg.service.num_shards, "rows": rows, "ratios": ratios,
               "refresh": args.refresh, "refreshes_published": worker.state.book.version, "rounds": rounds,
               **guard, "machine": machine_info()}
    print(f"saved {save_results('train_step', payload, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
