"""Scores per second of each score preset against a block of entities, on CPU.

For every preset and dtype (fp32, bf16) it times, in the same run:

- ``fast``: ``scoring.score_all`` (one GEMM per chunk, masked reductions);
- ``loop``: the obvious reference, a Python loop over entities, each scored against
  all mentions with its real (unpadded) columns only;
- ``unfused``: the seed code's approach, one einsum that materialises the whole
  [B, n, N, n'] similarity tensor in fp32, then masks and reduces it.

and reports the speed-up of ``fast`` over each, plus the largest score difference
(a correctness check on the timed data). Prints a table; writes
benchmarks/results/scoring.json.

    .venv/bin/python -m benchmarks.scoring            # ~2-3 minutes, 1 thread
    .venv/bin/python -m benchmarks.scoring --quick    # seconds, smaller blocks
"""
from __future__ import annotations

import argparse
import os

import torch


from benchmarks.common import add_hygiene_args, load_guard, machine_info, median_time, save_results  # noqa: E402
from dist_nce.cluster.runtime import configure_threads  # noqa: E402
from dist_nce.modeling.scoring import Reps, ScoreSpec, entity_reps, mention_reps, score_all  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "scoring.json")


def _lengths_mask(n: int, t: int, lo: int, g: torch.Generator) -> torch.Tensor:
    lengths = torch.randint(lo, t + 1, (n,), generator=g)
    return torch.arange(t)[None, :] < lengths[:, None]


def _loop(spec: ScoreSpec, m: Reps, e: Reps) -> torch.Tensor:
    """One entity at a time: slice its real vectors, score all mentions against them."""
    mv = m.vecs if m.vecs.ndim == 3 else m.vecs[:, None]
    cols = []
    for j in range(e.vecs.shape[0]):
        f = e.vecs[j] if e.vecs.ndim == 3 else e.vecs[j][None]
        if e.mask is not None:
            f = f[e.mask[j]]
        out = []
        for i in range(mv.shape[0]):
            q = mv[i] if m.mask is None else mv[i][m.mask[i]]
            if spec.direction == "x->y":
                s = q @ f.T  # [queries, keys]
            else:
                s = f @ q.T
            s = s.float()
            if spec.attention == "hard":
                out.append(s.amax(1).sum())
            else:
                out.append((torch.softmax(s, 1) * s).sum())
        cols.append(torch.stack(out))
    return torch.stack(cols, 1)


def _unfused(spec: ScoreSpec, m: Reps, e: Reps) -> torch.Tensor:
    """Everything at once in fp32: sim [B, n, N, n'], mask, attend, sum."""
    mv = (m.vecs if m.vecs.ndim == 3 else m.vecs[:, None]).float()
    ev = (e.vecs if e.vecs.ndim == 3 else e.vecs[:, None]).float()
    mm = torch.ones(mv.shape[:2], dtype=torch.bool) if m.mask is None else m.mask
    em = torch.ones(ev.shape[:2], dtype=torch.bool) if e.mask is None else e.mask
    sim = torch.einsum("bid,njd->binj", mv, ev)
    if spec.direction == "x->y":
        keymask, querymask = em[None, None], mm[:, :, None]  # keys j, queries i
        s = sim.masked_fill(~keymask, float("-inf"))
        per = s.amax(-1) if spec.attention == "hard" else (torch.softmax(s, -1) * sim).sum(-1)
        return per.masked_fill(~querymask, 0).sum(1)
    keymask, querymask = mm[:, :, None, None], em[None]  # keys i, queries j
    s = sim.masked_fill(~keymask, float("-inf"))
    per = s.amax(1) if spec.attention == "hard" else (torch.softmax(s, 1) * sim).sum(1)
    return per.masked_fill(~querymask, 0).sum(-1)


def _workloads(quick: bool) -> list[dict]:
    scale = 8 if quick else 1
    return [
        dict(preset="dual", m=None, n=65536 // scale, n_loop=512),
        dict(preset="poly", m=16, n=16384 // scale, n_loop=256),
        dict(preset="multi", m=8, n=16384 // scale, n_loop=256),
        dict(preset="genpoly", m=8, n=8192 // scale, n_loop=256),
        dict(preset="som", m=None, n=512 // scale, n_loop=64),
    ]


def run(quick: bool, batch: int, dim: int, seq: int, repeats: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for w in _workloads(quick):
        spec = ScoreSpec.preset(w["preset"], m=w["m"])
        n = w["n"]
        E = torch.randn(batch, seq, dim, generator=g)
        F = torch.randn(n, seq, dim, generator=g)
        emask, fmask = _lengths_mask(batch, seq, 16, g), _lengths_mask(n, seq, 32, g)
        codes = torch.randn(w["m"] or 1, dim, generator=g) / dim**0.5
        for dtype in (torch.float32, torch.bfloat16):
            use_codes = spec.mention_side.reduction == "codes"
            m = mention_reps(spec, E.to(dtype), emask, codes.to(dtype) if use_codes else None)
            e = entity_reps(spec, F.to(dtype), fmask)
            n_loop = min(w["n_loop"], n)
            e_loop = Reps(e.vecs[:n_loop], None if e.mask is None else e.mask[:n_loop])
            t_fast, s_fast = median_time(lambda: score_all(spec, m, e), repeats)
            t_loop, s_loop = median_time(lambda: _loop(spec, m, e_loop), 1)
            t_unf, s_unf = median_time(lambda: _unfused(spec, m, e), 1)
            scale = s_unf.abs().max().item()
            row = dict(
                preset=w["preset"], m=w["m"], dtype=str(dtype).replace("torch.", ""), batch=batch, entities=n,
                vectors_per_entity=1 if e.vecs.ndim == 2 else e.vecs.shape[1], dim=dim,
                fast_scores_per_s=batch * n / t_fast,
                loop_scores_per_s=batch * n_loop / t_loop,
                unfused_scores_per_s=batch * n / t_unf,
                max_rel_diff_vs_unfused=((s_fast - s_unf).abs().max().item() / scale),
                max_rel_diff_vs_loop=((s_fast[:, :n_loop] - s_loop).abs().max().item() / scale),
            )
            row["speedup_vs_loop"] = row["fast_scores_per_s"] / row["loop_scores_per_s"]
            row["speedup_vs_unfused"] = row["fast_scores_per_s"] / row["unfused_scores_per_s"]
            rows.append(row)
            print(_fmt(row), flush=True)
    return rows


HEADER = (f"{'preset':<10}{'dtype':<10}{'N':>7}{'vec/ent':>8}{'fast/s':>12}{'loop/s':>11}"
          f"{'unfused/s':>12}{'x loop':>8}{'x unfused':>10}{'rel diff':>10}")


def _fmt(r: dict) -> str:
    name = r["preset"] if r["m"] is None else f"{r['preset']}-{r['m']}"
    return (f"{name:<10}{r['dtype']:<10}{r['entities']:>7}{r['vectors_per_entity']:>8}"
            f"{r['fast_scores_per_s']:>12.3g}{r['loop_scores_per_s']:>11.3g}{r['unfused_scores_per_s']:>12.3g}"
            f"{r['speedup_vs_loop']:>8.1f}{r['speedup_vs_unfused']:>10.2f}"
            f"{max(r['max_rel_diff_vs_unfused'], r['max_rel_diff_vs_loop']):>10.1e}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8x fewer entities (a smoke run)")
    ap.add_argument("--batch", type=int, default=16, help="mentions per call")
    ap.add_argument("--dim", type=int, default=384, help="hidden size (384 = MiniLM)")
    ap.add_argument("--seq", type=int, default=128, help="tokens per mention / entity (paper: 128)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats of the fast path (median)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads")
    ap.add_argument("--out", default=RESULTS, help="JSON output path")
    add_hygiene_args(ap)
    args = ap.parse_args(argv)
    configure_threads(args.threads)
    guard = load_guard(args.force)
    load_before = guard["load_average_before"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), B={args.batch}, d={args.dim}, "
          f"T={args.seq}, load average {load_before:.1f} on {os.cpu_count()} cores; "
          f"scores/s = mention-entity pairs per second")
    print(HEADER)
    rows = run(args.quick, args.batch, args.dim, args.seq, args.repeats)
    out = save_results("scoring", dict(
        **guard,
        benchmark="scoring", threads=torch.get_num_threads(), **machine_info(),
        load_average_after=os.getloadavg()[0],
        batch=args.batch, dim=args.dim, seq=args.seq, quick=args.quick, rows=rows,
    ), args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
