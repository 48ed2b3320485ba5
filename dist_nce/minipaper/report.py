"""The mini-paper's results: cells -> mini_paper.json -> Markdown tables and PNGs.

:func:`collect` turns finished cells into one JSON-able dict (rows per seed, groups over
seeds, verdicts against random, the bias ordering); :func:`tables` renders it as Markdown
(the tables of the generated page ``docs/mini_paper.md`` are rendered from the committed JSON by
the same function);
:func:`write_outputs` writes ``mini_paper.md`` and the PNGs.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from dist_nce.minipaper.results import ROWS, curves
from dist_nce.minipaper.stats import against, curve_band, group, spread, verdict

LABELS = ("architecture", "arm")
RESULT = "docs/mini_paper/mini_paper.json"  # the committed run docs/mini_paper.md shows
PAGE = "docs/mini_paper.md"  # its page, linked from the README; tables between <!-- minipaper --> markers
# Every generated block of the page -> the committed run it shows: "" is <!-- minipaper -->, a name N is
# <!-- minipaper N --> ... <!-- /minipaper N -->.
RESULTS = {"": RESULT, "minilm": "docs/mini_paper/minilm/mini_paper.json",
           "minilm_seeds789": "docs/mini_paper/minilm_seeds789/mini_paper.json",
           "minilm_table2": "docs/mini_paper/minilm_table2/mini_paper.json",
           "minilm_som": "docs/mini_paper/minilm_som/mini_paper.json",
           "minilm_som_seeds789": "docs/mini_paper/minilm_som_seeds789/mini_paper.json",
           "minilm_multi": "docs/mini_paper/minilm_multi/mini_paper.json"}
# Blocks that show only some parts of their run: the MiniLM Table 2 run reused the "minilm" block's
# retriever cells, whose Table 1 is on the page already.
BLOCK_PARTS = {"minilm_table2": ("reranker",)}


def _metric_names(rows: Sequence[Mapping[str, Any]], skip: Sequence[str] = ("/n", "bias/measurements")) -> list[str]:
    names: dict[str, None] = {}
    for r in rows:
        for k, v in r["metrics"].items():
            if isinstance(v, (int, float)) and not k.endswith(skip):
                names.setdefault(k)
    return list(names)


def collect(cfg, cells: Mapping[str, Any], done: Mapping[str, dict], failed: Mapping[str, str],
            seconds: Mapping[str, float], out: Path, root: Path) -> dict[str, Any]:
    """Everything the tables and plots need, from the cells' directories."""
    from dist_nce.core.config import to_dict
    from dist_nce.minipaper.cells import INPUTS

    rows = []
    for name, c in cells.items():
        d = c.dir(out, root)
        row = {"name": name, "part": c.part, **c.labels, "dir": str(d.relative_to(out)),
               "status": "done" if name in done else "failed" if name in failed else "pending"}
        if name in failed:
            row["why"] = failed[name]
        if name in seconds:
            row["seconds"] = round(seconds[name], 1)
        if name in done:
            s = done[name]
            row["metrics"] = ROWS[c.part](d, s)
            row["job_seconds"] = s.get("seconds")
            if INPUTS in s:  # what its run read (cells.cell_inputs); cells finished before it was kept have none
                row[INPUTS] = s[INPUTS]
            if c.part != "reranker":
                row["curves"] = {k: {str(step): v for step, v in cv.items()} for k, cv in curves(d, s).items()}
        rows.append(row)
    result: dict[str, Any] = {"config": to_dict(cfg), "cells": rows}
    for part in ("zeshel", "aida"):
        trained = [r for r in rows if r["part"] == part and r["status"] == "done" and r["arm"] != "start"]
        if not trained:
            continue
        metrics = _metric_names(trained)
        groups = group([{**r, **r["metrics"]} for r in trained], LABELS, metrics)
        result[part] = {"metrics": metrics, "groups": groups,
                        "versus_random": against(groups, [m for m in metrics if not m.startswith("bias/")]),
                        "bias_order": bias_order(groups)}
        starts = [r for r in rows if r["part"] == part and r["arm"] == "start" and r["status"] == "done"]
        if starts:
            result[part]["start"] = [{"architecture": r["architecture"], **r["metrics"]} for r in starts]
    reranked = [r for r in rows if r["part"] == "reranker" and r["status"] == "done"]
    if reranked:
        metrics = _metric_names(reranked)
        groups = group([{**r, **r["metrics"]} for r in reranked], LABELS, metrics)
        result["reranker"] = {"metrics": metrics, "groups": groups, "versus_random": against(groups, metrics)}
    return result


def bias_order(groups: Sequence[Mapping[str, Any]], metric: str = "bias/final") -> list[dict[str, Any]]:
    """Appendix C's ordering per architecture: the arms by mean bias on their trained models,
    largest first, with the verdict of each neighbour pair (ranges over seeds)."""
    out = []
    for arch in dict.fromkeys(g["architecture"] for g in groups):
        gs = [g for g in groups if g["architecture"] == arch and metric in g and g[metric]["n"]]
        gs.sort(key=lambda g: -g[metric]["mean"])
        if len(gs) < 2:
            continue
        pairs = [{"above": a["arm"], "below": b["arm"], "verdict": verdict(a[metric], b[metric])}
                 for a, b in zip(gs, gs[1:])]
        out.append({"architecture": arch, "order": [g["arm"] for g in gs], "pairs": pairs})
    return out


def best_retriever(result: Mapping[str, Any]) -> list[tuple[str, str]] | None:
    """[(architecture, best non-random arm), (architecture, "random")] by mean val R@k, or None."""
    z = result.get("zeshel")
    if not z:
        return None
    key = next((m for m in z["metrics"] if m.startswith("val/R@") and m != "val/R@1"), None)
    cands = [g for g in z["groups"] if g["arm"] != "random" and key and g[key]["n"]]
    if not cands:
        return None
    best = max(cands, key=lambda g: g[key]["mean"])
    if not any(g["architecture"] == best["architecture"] and g["arm"] == "random" for g in z["groups"]):
        return None
    return [(best["architecture"], best["arm"]), (best["architecture"], "random")]


# ---------------------------------------------------------------------------------------- Markdown

def _pct(s: Mapping[str, Any], bias: bool = False) -> str:
    if not s or not s.get("n"):
        return "-"
    if bias:
        return f"{s['mean']:.3f} [{s['min']:.3f}, {s['max']:.3f}]"
    if s["n"] == 1:
        return f"{100 * s['mean']:.1f}"
    return f"{100 * s['mean']:.1f} [{100 * s['min']:.1f}, {100 * s['max']:.1f}]"


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _verdict_marks(result_part: Mapping[str, Any], arch: str, arm: str) -> dict[str, str]:
    for v in result_part.get("versus_random", []):
        if v["architecture"] == arch and v["arm"] == arm:
            return {m: {"wins": " (+)", "loses": " (-)"}.get(x["verdict"], "") for m, x in v.items()
                    if isinstance(x, dict)}
    return {}


def part_table(result: Mapping[str, Any], part: str, columns: Sequence[tuple[str, str]]) -> str:
    """One row per (architecture, arm): mean [min, max] over seeds; (+)/(-) where every seed is
    above/below every seed of the random arm of the same architecture."""
    p = result.get(part)
    if not p:
        return "(no finished cells)"
    rows = []
    for s in p.get("start", []):
        rows.append([s["architecture"], "shared start", "1"] + [
            "-" if metric.startswith("bias/") or metric not in s else _pct({"mean": s[metric], "n": 1})
            for metric, _ in columns])
    for g in p["groups"]:
        marks = _verdict_marks(p, g["architecture"], g["arm"])
        rows.append([g["architecture"], g["arm"], str(len(g["seeds"]))] + [
            _pct(g.get(metric, {}), metric.startswith("bias/")) + marks.get(metric, "") for metric, _ in columns])
    return _table(["architecture", "negatives", "seeds", *(title for _, title in columns)], rows)


def zeshel_columns(result: Mapping[str, Any]) -> list[tuple[str, str]]:
    metrics = result.get("zeshel", {}).get("metrics", [])
    k = next((m.split("@")[1] for m in metrics if m.startswith("val/R@") and m != "val/R@1"), "64")
    held_r1 = [("heldout/R@1", "heldout R@1")] if "heldout/R@1" in metrics else []  # runs that recorded it
    return [(f"val/R@{k}", f"val R@{k}"), (f"test/R@{k}", f"test R@{k}"), ("val/R@1", "val R@1"),
            ("test/R@1", "test R@1"), (f"heldout/R@{k}", f"heldout R@{k}"), *held_r1,
            ("bias/final", "bias (trained)")]


def aida_columns(result: Mapping[str, Any]) -> list[tuple[str, str]]:
    metrics = result.get("aida", {}).get("metrics", [])
    cols = [("dev/accuracy", "dev accuracy")]  # = R@1
    ks = sorted(int(m.split("@")[1]) for m in metrics if m.startswith("dev/R@") and m != "dev/R@1")
    cols += [(f"dev/R@{k}", f"dev R@{k}") for k in ks]
    return cols + [("bias/final", "bias (trained)")]


RERANK_COLUMNS = [("val/U.Acc", "val U.Acc"), ("val/N.Acc", "val N.Acc"), ("test/U.Acc", "test U.Acc"),
                  ("test/N.Acc", "test N.Acc"), ("val/cand_R", "val cand. recall"), ("test/cand_R", "test cand. recall")]


def rerank_columns(result: Mapping[str, Any]) -> list[tuple[str, str]]:
    """RERANK_COLUMNS, with the retriever's own R@1 on the same mentions beside each U.Acc where the
    run recorded it (the reranker helps when its U.Acc beats that)."""
    metrics = set(result.get("reranker", {}).get("metrics", []))
    cols = []
    for metric, title in RERANK_COLUMNS:
        split = metric.split("/")[0]
        if metric.endswith("U.Acc") and f"{split}/retriever_R@1" in metrics:
            cols.append((f"{split}/retriever_R@1", f"{split} retriever R@1"))
        cols.append((metric, title))
    return cols


def rerank_gains(result: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per reranker group and split: U.Acc minus the retriever's R@1 on the same mentions, seed by
    seed (points), where the run recorded both: Table 2's question, whether reranking helps."""
    out = []
    for g in (result.get("reranker") or {}).get("groups", []):
        for split in ("val", "test"):
            u, r = g.get(f"{split}/U.Acc"), g.get(f"{split}/retriever_R@1")
            if not u or not r or not u["n"] or len(u["values"]) != len(r["values"]):
                continue
            gains = [100 * (a - b) for a, b in zip(u["values"], r["values"])]
            out.append({"architecture": g["architecture"], "arm": g["arm"], "split": split, "seeds": g["seeds"],
                        "gains": gains, "above": all(x > 0 for x in gains), "below": all(x < 0 for x in gains)})
    return out


def rerank_gain_text(result: Mapping[str, Any]) -> str:
    gains = rerank_gains(result)
    if not gains:
        return ""
    rows = [[g["architecture"], g["arm"], g["split"], ", ".join(f"{x:+.1f}" for x in g["gains"]),
             "above at every seed" if g["above"] else "below at every seed" if g["below"] else "mixed"]
            for g in gains]
    n = sum(len(g["gains"]) for g in gains)
    above = sum(x > 0 for g in gains for x in g["gains"])
    return ("Does reranking help? The reranker's U.Acc minus its own retriever's R@1 on the same mentions, "
            "seed by seed (each reranker seed reranks the retriever run of the same seed; points):\n\n"
            + _table(["architecture", "retriever negatives", "split", "U.Acc - retriever R@1", "verdict"], rows)
            + f"\n\nAbove at {above} of {n} (seed, split) pairs.")


def steps_apart(result: Mapping[str, Any], part: str, arch: str, above: str, below: str,
                metric: str = "bias/norm") -> tuple[int, int]:
    """(measurement steps at which every seed of ``above`` is above every seed of ``below``, steps
    both arms' seeds all have) on the ``metric`` curves of ``part``/``arch``."""
    from dist_nce.minipaper.stats import spread

    rows = [r for r in result["cells"] if r["part"] == part and r["architecture"] == arch and r["status"] == "done"]
    curves = {arm: _parse_curves([r for r in rows if r["arm"] == arm], metric) for arm in (above, below)}
    if not curves[above] or not curves[below]:
        return 0, 0
    steps = set.intersection(*(set(c) for arm in (above, below) for c in curves[arm]))
    apart = sum(verdict(spread(c[s] for c in curves[above]), spread(c[s] for c in curves[below])) == "wins"
                for s in steps)
    return apart, len(steps)


def bias_text(result: Mapping[str, Any]) -> str:
    lines = []
    for part in ("zeshel", "aida"):
        for b in result.get(part, {}).get("bias_order", []):
            steps = []
            for p in b["pairs"]:
                apart, total = steps_apart(result, part, b["architecture"], p["above"], p["below"])
                along = f" (apart at {apart} of {total} monitor steps)" if total else ""
                steps.append(f"{p['above']} {'>' if p['verdict'] == 'wins' else '~'} {p['below']}{along}")
            lines.append(f"- {part} {b['architecture']}: {', '.join(steps)}")
        if result.get(part, {}).get("bias_order"):
            lines.append(f"  ({part}: > : on the trained models every seed above every seed; ~ : ranges overlap)")
    costs: dict[str, list[float]] = {}
    for r in result["cells"]:
        if r.get("metrics", {}).get("bias/cost") is not None:
            costs.setdefault(f"{r['part']} {r['architecture']}", []).append(r["metrics"]["bias/cost"])
    if costs:  # per architecture: a SOM pass costs what a dual one does not
        each = "; ".join(f"{name} median {100 * sorted(c)[len(c) // 2]:.1f}% (max {100 * max(c):.1f}%, {len(c)} runs)"
                         for name, c in costs.items())
        lines.append(f"- monitor cost at the grid's cadence, as a share of training time: {each}")
    return "\n".join(lines) or "(no bias measurements)"


def _comparisons(result: Mapping[str, Any], parts: Sequence[str] = ("zeshel", "aida", "reranker")
                 ) -> list[tuple[str, int, int]]:
    """Every range comparison the tables of ``parts`` mark: (verdict, seeds of the arm, seeds of the other)."""
    out = []
    for part in parts:
        p = result.get(part) or {}
        groups = {(g["architecture"], g["arm"]): g for g in p.get("groups", [])}
        for v in p.get("versus_random", []):
            arm, base = groups[(v["architecture"], v["arm"])], groups[(v["architecture"], v["baseline"])]
            for metric, x in v.items():
                if isinstance(x, dict) and arm[metric]["n"] and base[metric]["n"]:
                    out.append((x["verdict"], arm[metric]["n"], base[metric]["n"]))
        for b in p.get("bias_order", []):
            for pair in b["pairs"]:
                above, below = groups[(b["architecture"], pair["above"])], groups[(b["architecture"], pair["below"])]
                out.append((pair["verdict"], above["bias/final"]["n"], below["bias/final"]["n"]))
    return out


def statistics_text(result: Mapping[str, Any], parts: Sequence[str] = ("zeshel", "aida", "reranker")) -> str:
    """How much a (+), (-) or > says: the chance of a full separation by seed alone, and how many
    comparisons the tables of ``parts`` make (so how many marks chance alone would leave)."""
    from dist_nce.minipaper.stats import separation_chance

    comps = _comparisons(result, parts)
    if not comps:
        return "(no comparisons)"
    sizes = sorted({(n, m) for _, n, m in comps})
    chances = "; ".join(f"{n} seeds against {m}: 1 in {round(1 / separation_chance(n, m))}" for n, m in sizes)
    expected = sum(separation_chance(n, m) for _, n, m in comps)
    wins = sum(v == "wins" for v, _, _ in comps)
    losses = sum(v == "loses" for v, _, _ in comps)
    return (f"A mark says every seed of one arm fell above (or below) every seed of the other. With no real "
            f"difference, that happens by seed alone with a chance of {chances}, each way. These tables make "
            f"{len(comps)} such comparisons (every marked column against random, every neighbour pair of the bias "
            f"order), so chance alone would leave about {expected:.1f} marks each way; they show {wins} above and "
            f"{losses} below. Read a single mark as a lead, and a mark that held on other seeds (the replication) "
            "as a result.")


def tables(result: Mapping[str, Any], level: int = 2, parts: Sequence[str] | None = None) -> str:
    """Markdown: the three tables, the bias ordering and how to read the marks, headings at ``level``
    (``parts``: only those parts' tables, and the bias section only with zeshel or aida)."""
    h = "#" * level
    planned = {c["part"] for c in result["cells"]}  # a part the run's config left out gets no section
    show = set(parts) if parts is not None else {"zeshel", "aida", "reranker"}
    out = []
    if "zeshel" in show:
        out += [f"{h} Table 1 in miniature (Zeshel retrievers; recall in %, mean [min, max] over seeds)",
                part_table(result, "zeshel", zeshel_columns(result))]
    if "reranker" in planned and "reranker" in show:
        out += [f"{h} Table 2 in miniature (Zeshel joint reranker over each retriever's candidates; %)",
                part_table(result, "reranker", rerank_columns(result))]
        gain = rerank_gain_text(result)
        if gain:
            out.append(gain)
    if "aida" in planned and "aida" in show:
        out += [f"{h} AIDA (dual encoder; %)", part_table(result, "aida", aida_columns(result))]
    if show & {"zeshel", "aida"}:
        out += [f"{h} Gradient bias on the trained models (Appendix C), from the live monitor", bias_text(result)]
    out += [f"{h} How much a mark says", statistics_text(result, [p for p in ("zeshel", "aida", "reranker")
                                                                 if p in show])]
    return "\n\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------- the page

PAGE_LEVEL = 3  # the tables' headings on the page (under its "##" sections)


def _tag(name: str) -> str:
    return f"minipaper {name}" if name else "minipaper"


def _block_re(name: str) -> re.Pattern:
    tag = re.escape(_tag(name))
    return re.compile(rf"(<!-- {tag} -->\n)(?P<body>.*?)(<!-- /{tag} -->)", re.S)


def page_block(text: str, name: str = "") -> str | None:
    """A generated part of docs/mini_paper.md: between ``<!-- minipaper -->`` and ``<!-- /minipaper -->``
    (``name``: ``<!-- minipaper name -->`` and ``<!-- /minipaper name -->``)."""
    m = _block_re(name).search(text)
    return m.group("body") if m else None


def rewrite_page(text: str, result: Mapping[str, Any], name: str = "") -> str:
    """``text`` with its block ``name`` rendered from ``result`` (a mini_paper.json)."""
    if page_block(text, name) is None:
        raise ValueError(f"{PAGE} has no <!-- {_tag(name)} --> ... <!-- /{_tag(name)} --> block")
    return _block_re(name).sub(lambda m: m.group(1) + block_tables(result, name) + m.group(3), text)


def block_tables(result: Mapping[str, Any], name: str = "") -> str:
    """What the page's block ``name`` holds for ``result``: its tables at the page's heading level."""
    return tables(result, level=PAGE_LEVEL, parts=BLOCK_PARTS.get(name))


# ---------------------------------------------------------------------------------------- plots

def _parse_curves(rows: Sequence[Mapping[str, Any]], metric: str) -> list[dict[int, float]]:
    return [{int(k): v for k, v in r["curves"][metric].items()} for r in rows if metric in r.get("curves", {})]


def plot_curves(result: Mapping[str, Any], part: str, metric: str, path: Path, ylabel: str, scale: float = 100) -> bool:
    """Per architecture a panel: ``metric`` against optimizer steps, mean line and min-max band per arm."""
    rows = [r for r in result["cells"] if r["part"] == part and r["status"] == "done"]
    archs = list(dict.fromkeys(r["architecture"] for r in rows))
    if not archs:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(archs), figsize=(4.5 * len(archs), 3.6), squeeze=False)
    drew = False
    for ax, arch in zip(axes[0], archs):
        for arm in dict.fromkeys(r["arm"] for r in rows if r["architecture"] == arch):
            mine = [r for r in rows if r["architecture"] == arch and r["arm"] == arm]
            steps, mean, lo, hi = curve_band(_parse_curves(mine, metric))
            if not steps:
                continue
            drew = True
            if arm == "start":
                ax.plot(steps, [scale * v for v in mean], color="grey", linestyle=":", label="shared start")
                continue
            line, = ax.plot(steps, [scale * v for v in mean], marker=".", label=f"{arm} (n={len(mine)})")
            ax.fill_between(steps, [scale * v for v in lo], [scale * v for v in hi], alpha=0.2, color=line.get_color())
        ax.set_title(arch)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    if drew:
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return drew


def write_outputs(result: Mapping[str, Any], out: Path) -> list[Path]:
    """``mini_paper.md`` and the PNGs that have data; returns the paths written."""
    from dist_nce.core.artifacts import atomic_write_text

    atomic_write_text(out / "mini_paper.md", "# The paper in miniature\n\n" + tables(result))
    written = [out / "mini_paper.md"]
    z_metric = next((m for m in result.get("zeshel", {}).get("metrics", []) if m.startswith("heldout/R@")), None)
    plots = [("zeshel", f"dev/recall@{z_metric.split('@')[1]}" if z_metric else "", "zeshel_curves.png",
              "heldout R@k during training (%)"),
             ("aida", "dev/accuracy", "aida_curves.png", "dev accuracy during training (%)"),
             ("zeshel", "bias/norm", "zeshel_bias.png", "bias ||b|| (live monitor)"),
             ("aida", "bias/norm", "aida_bias.png", "bias ||b|| (live monitor)")]
    for part, metric, name, label in plots:
        if metric and plot_curves(result, part, metric, out / name, label, 1 if metric.startswith("bias") else 100):
            written.append(out / name)
    return written


def main(argv: list[str] | None = None) -> int:
    """``python -m dist_nce.minipaper.report [--check]``: docs/mini_paper.md's tables from the committed JSON."""
    import argparse
    import json

    repo = Path(__file__).resolve().parents[2]
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--block", default="", choices=sorted(RESULTS), help="the block --result renders ('': the "
                    "<!-- minipaper --> block)")
    ap.add_argument("--result", default=None, help=f"a mini_paper.json for --block (default: {RESULTS})")
    ap.add_argument("--check", action="store_true", help=f"exit 1 if {PAGE}'s tables differ from the JSON")
    args = ap.parse_args(argv)
    page = repo / PAGE
    text = new = page.read_text(encoding="utf-8")
    for name, committed in RESULTS.items():
        path = Path(args.result) if args.result and name == args.block else repo / committed
        new = rewrite_page(new, json.loads(path.read_text(encoding="utf-8")), name)
    if args.check:
        print(f"{PAGE}: the mini-paper tables match the JSON" if new == text else f"{PAGE}: the mini-paper tables are stale")
        return 0 if new == text else 1
    if new != text:
        page.write_text(new, encoding="utf-8")
    print(f"rendered the mini-paper tables of {PAGE} from {', '.join(RESULTS.values())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
