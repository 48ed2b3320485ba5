"""A grid of Zeshel retriever runs (architectures x negatives), tabulated like the paper's Table 1.

Pure pieces used by ``jobs/zeshel_grid.py``: the rows file, each row's config, the
results table (Markdown), the hard/mixed-versus-random comparison and a bar chart.

A rows file (``configs/zeshel/table1_rows.yaml``, ``configs/zeshel/grid_tiny_rows.yaml``)::

    rows:
      - name: dual_hard
        set: [model.retriever.preset=dual, negatives.mode=hard, service.index.backend=flat]
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from dist_nce.core.config import ConfigError, load_config, load_yaml
from dist_nce.zeshel.config import ZeshelRetrieverConfig, absolute

EVAL_SPLITS = ("val", "test")


@dataclass(frozen=True)
class GridRow:
    name: str
    overrides: tuple[str, ...]
    source: str = ""  # the rows file it came from, for errors in its overrides


def load_rows(path: str | Path) -> list[GridRow]:
    """Rows of a rows file; a malformed entry is a ConfigError naming the file and the row."""
    data = load_yaml(path) or {}
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not rows:
        raise ConfigError(f"{path}: expected a top-level 'rows:' list")
    out: list[GridRow] = []
    for i, row in enumerate(rows):
        ok = isinstance(row, dict) and set(row) == {"name", "set"} and isinstance(row["name"], str) and \
            isinstance(row["set"], list) and all(isinstance(s, str) and "=" in s for s in row["set"])
        if not ok:
            raise ConfigError(f"{path}: rows[{i}]: expected {{name: str, set: [key=value, ...]}}, got {row!r}")
        if row["name"] in {r.name for r in out}:
            raise ConfigError(f"{path}: rows[{i}]: name {row['name']!r} used twice")
        out.append(GridRow(row["name"], tuple(row["set"]), str(path)))
    return out


def row_config(base: str | Path, row: GridRow, out_dir: str | Path, overrides: Sequence[str] = ()
               ) -> ZeshelRetrieverConfig:
    """The base config + the grid's overrides + the row's, run under ``<out_dir>/<row>`` (absolute paths).

    Every row shares the base's prepared stores (``data.prepared_dir``, ``zeshel.eval_store``). A config
    that only the row's overrides make wrong is a ConfigError naming the rows file and the row.
    """
    run_dir = Path(out_dir) / row.name
    where = [f"run.name=zeshel_grid_{row.name}", f"run.output_dir={run_dir}"]
    try:
        return absolute(load_config(ZeshelRetrieverConfig, base, [*overrides, *row.overrides, *where]))
    except ConfigError as e:
        try:  # without the row it loads: the row's overrides are what is wrong, so the message names the row
            load_config(ZeshelRetrieverConfig, base, list(overrides))
        except ConfigError:
            raise e from None  # the base file or the grid's --set, which load_config already names
        what = str(e).removeprefix(f"--set (over {os.fspath(base)}): ")
        raise ConfigError(f"{row.source or 'rows'}: row {row.name!r}: {what}") from None


# Where and how visibly a run happens, and its bookkeeping: not what it computes. A resumed run continues
# exactly (README), so where a job stops or checkpoints is not part of its result either: with
# run.stop_after_steps in the key, a time-boxed grid could never finish (the same N stopped every row at
# once; another N, or none, was another row, trained again from step 0).
_PLACEMENT = ("name", "output_dir", "storage_path", "progress", "max_failures", "stop_after_steps",
              "checkpoint_every_steps", "num_to_keep", "tracking")


def result_key(cfg: ZeshelRetrieverConfig, fingerprints: Sequence[str], sections: Sequence[str] = ()) -> str:
    """A short hash of everything a row's result depends on: its config (``sections`` of it,
    default all, minus where it runs and its paths) and ``fingerprints``, the identities of what
    those paths hold (the prepared stores', :func:`input_fingerprints`).

    Row directories and Ray Train run names carry it, so an earlier result is reused only
    for the same config over the same data: after a change of settings (synthetic data
    regenerated, another learning rate) the row runs again, in its own directory. Paths are
    not hashed: ``ray job submit --working-dir`` runs the grid from a new copy of the project
    after a cluster restart or any edit, so every absolute path moved and every row started over.
    """
    import hashlib
    import json

    from dist_nce.core.config import to_dict
    from dist_nce.train.config import PATH_FIELDS
    from dist_nce.zeshel.config import ZESHEL_PATH_FIELDS

    d = to_dict(cfg)
    d["run"] = {k: v for k, v in d["run"].items() if k not in _PLACEMENT}
    for dotted in (*PATH_FIELDS, *ZESHEL_PATH_FIELDS):
        *parents, name = dotted.split(".")
        section = d
        for part in parents:
            section = section.get(part) or {}
        section.pop(name, None)
    if sections:
        d = {k: d[k] for k in sections}
    blob = json.dumps([d, list(fingerprints)], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def input_fingerprints(cfg: ZeshelRetrieverConfig) -> list[str]:
    """Identities of what a row reads besides the prepared stores, by content (a model rebuilt in
    place is another model): the initial model directories, ``model.init_from`` and
    ``model.blink_checkpoint`` where set, and the DeepSpeed JSON (edited in place, another run)."""
    from dist_nce.core.models import default_model_dir
    from kb.ingest import path_fingerprint

    r, m = cfg.model.retriever, cfg.model
    mention = r.mention_model or default_model_dir()
    out = [path_fingerprint(d) for d in dict.fromkeys((mention, r.entity_model or mention))]
    out += [f"{key}:{path_fingerprint(path)}" for key, path in (("init_from", m.init_from),
                                                                 ("blink_checkpoint", m.blink_checkpoint)) if path]
    out.append(f"deepspeed:{path_fingerprint(cfg.deepspeed.config)}")
    return out


def keyed(cfg: ZeshelRetrieverConfig, row: str, out_dir: str | Path, key: str) -> ZeshelRetrieverConfig:
    """``cfg`` run as ``<row>-<key>``: in ``<out_dir>/<row>-<key>/``, Ray Train run
    ``zeshel_grid_<row>-<key>-<grid>``, where ``<grid>`` hashes ``out_dir``.

    Why the grid's hash: the checkpoints live in ``run.storage_path`` (shared by every grid, and the
    user's to choose: a cluster's shared disk), so a second grid (another ``--out``) of the same row
    found the first grid's finished checkpoints, "resumed" at its last step and trained nothing,
    leaving its own directory without the losses."""
    import dataclasses
    import hashlib

    grid = hashlib.sha256(str(Path(out_dir).resolve()).encode()).hexdigest()[:6]
    run = dataclasses.replace(cfg.run, name=f"zeshel_grid_{row}-{key}-{grid}",
                              output_dir=str(Path(out_dir) / f"{row}-{key}"))
    return dataclasses.replace(cfg, run=run)


def labels(cfg: ZeshelRetrieverConfig) -> tuple[str, str]:
    """(architecture, negatives) as the paper names them: ("multi-8", "mixed-50")."""
    r, n = cfg.model.retriever, cfg.negatives
    arch = f"{r.preset}-{r.m}" if r.m else r.preset
    neg = f"mixed-{n.p:g}" if n.mode == "mixed" else n.mode
    return arch, neg


def cell(name: str, cfg: ZeshelRetrieverConfig, summary: dict[str, Any], losses: Sequence[float] = (),
         negatives: str | None = None) -> dict[str, Any]:
    """One grid cell: labels, top-k recall (own world and split union; macro over worlds and micro),
    and the mean training loss over the first and the last tenth of the steps."""
    arch, neg = labels(cfg)
    neg = negatives or neg
    k = cfg.zeshel.k
    out: dict[str, Any] = {"name": name, "architecture": arch, "negatives": neg, "k": k,
                           "done": summary.get("done"), "seconds": summary.get("seconds")}
    for split in EVAL_SPLITS:
        rep = (summary.get("zeshel") or {}).get(split)
        sizes = [b - a for a, b in (rep or {}).get("worlds", {}).values()]
        # A random ranking's own-world recall@k, macro over worlds: the floor every bar is read against.
        out[f"{split}/chance"] = sum(min(1.0, k / n) for n in sizes) / len(sizes) if sizes else math.nan
        for setting in ("own_world", "split_union"):
            for how in ("macro", "micro"):
                value = rep[setting][f"recall@{k}"][how] if rep and setting in rep else math.nan
                out[f"{split}/{setting}/{how}"] = value
        out[f"{split}/n_mentions"] = rep["own_world"]["n_mentions"] if rep else 0
        # Top-1 accuracy (recall@1) within the own world, macro: where the ranking's head is.
        out[f"{split}/own_world/top1_macro"] = rep["own_world"]["accuracy"]["macro"] if rep else math.nan
    dev = summary.get("dev_after") or {}
    # In-domain reference: the trainer's own evaluation on heldout mentions of the TRAIN worlds,
    # ranked over the union of the train worlds' entities (the negatives' pool).
    out["heldout/recall"] = dev.get(f"recall@{k}", math.nan)
    out["heldout/split"] = summary.get("dev_split")
    if losses:
        tenth = max(1, len(losses) // 10)
        out["loss_first"] = sum(losses[:tenth]) / tenth
        out["loss_last"] = sum(losses[-tenth:]) / tenth
    return out


def _fmt(v: float) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.2f}"


def markdown_table(cells: Sequence[dict[str, Any]]) -> str:
    """Table 1's layout: one row per (architecture, negatives), top-k recall in percent,
    own-world macro over worlds first (the paper's number), then the split-union macro."""
    k = cells[0]["k"] if cells else 64
    head = (f"| architecture | negatives | val R@{k} (own world) | test R@{k} (own world) | "
            f"val R@{k} (split union) | test R@{k} (split union) | val R@1 (own world) | test R@1 (own world) | "
            f"heldout R@{k} (train worlds) |")
    lines = [head, "|" + "---|" * 9]
    if cells and not math.isnan(cells[0].get("val/chance", math.nan)):
        lines.append("| (random ranking) | - | " + " | ".join(_fmt(cells[0][f"{s}/chance"]) for s in EVAL_SPLITS)
                     + " | - | - | - | - | - |")
    for c in cells:
        lines.append(f"| {c['architecture']} | {c['negatives']} | " + " | ".join(
            [_fmt(c[f"{s}/{setting}/macro"]) for setting in ("own_world", "split_union") for s in EVAL_SPLITS]
            + [_fmt(c.get(f"{s}/own_world/top1_macro", math.nan)) for s in EVAL_SPLITS]
            + [_fmt(c.get("heldout/recall", math.nan))]) + " |")
    return "\n".join(lines)


def comparisons(cells: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each architecture with a random row: does each other negative type beat random?

    Compared on own-world macro recall@k, val and test separately; ``beats_random`` needs
    both. The top-1 (R@1) differences are reported beside it. A grid row is one seed, so each
    comparison also says whether a difference is ``within_noise``: under two binomial standard errors
    (at p = 50%, :func:`noise_note`) of its split on val or test, where a sign says little.
    """
    out = []
    by_arch: dict[str, dict[str, dict[str, Any]]] = {}
    for c in cells:
        by_arch.setdefault(c["architecture"], {})[c["negatives"]] = c
    for arch, negs in by_arch.items():
        base = negs.get("random")
        if base is None:
            continue
        for neg, c in negs.items():
            if neg in ("random", "untrained"):
                continue
            delta = {s: c[f"{s}/own_world/macro"] - base[f"{s}/own_world/macro"] for s in EVAL_SPLITS}
            top1 = {s: c.get(f"{s}/own_world/top1_macro", math.nan) - base.get(f"{s}/own_world/top1_macro", math.nan)
                    for s in EVAL_SPLITS}
            n = {s: min(c.get(f"{s}/n_mentions", 0), base.get(f"{s}/n_mentions", 0)) for s in EVAL_SPLITS}
            noise = [abs(delta[s]) < 2 * math.sqrt(0.25 / n[s]) for s in EVAL_SPLITS if n[s]]
            out.append({"architecture": arch, "negatives": neg, **{f"delta_{s}": d for s, d in delta.items()},
                        **{f"delta_top1_{s}": d for s, d in top1.items()},
                        "beats_random": all(d > 0 for d in delta.values()),
                        "within_noise": any(noise) if noise else None})
    return out


def noise_note(cells: Sequence[dict[str, Any]]) -> str:
    """How large a difference the evaluation sets can resolve: one mention, and the largest
    binomial standard error sqrt(p (1 - p) / n) of a recall over n mentions (p = 50%)."""
    parts = []
    for s in EVAL_SPLITS:
        n = max((c.get(f"{s}/n_mentions", 0) for c in cells), default=0)
        if n:
            parts.append(f"{s}: {n} mentions, one mention = {100 / n:.2f} points, standard error <= "
                         f"{100 * math.sqrt(0.25 / n):.1f} points")
    return "; ".join(parts)


def comparison_text(rows: Sequence[dict[str, Any]]) -> str:
    return "\n".join(
        f"- {r['architecture']}: {r['negatives']} vs random: val {100 * r['delta_val']:+.2f}, test "
        f"{100 * r['delta_test']:+.2f} points -> {'beats' if r['beats_random'] else 'does not beat'} random "
        f"at R@k (R@1: val {100 * r.get('delta_top1_val', math.nan):+.2f}, test "
        f"{100 * r.get('delta_top1_test', math.nan):+.2f})"
        + ("; within the noise (under 2 standard errors on val or test, one seed)" if r.get("within_noise") else "")
        for r in rows)


def plot(cells: Sequence[dict[str, Any]], path: str | Path, title: str) -> None:
    """Grouped bars: own-world macro recall@k per architecture, one bar per negative type, val and test panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    archs = list(dict.fromkeys(c["architecture"] for c in cells))
    negs = list(dict.fromkeys(c["negatives"] for c in cells))
    k = cells[0]["k"]
    fig, axes = plt.subplots(1, len(EVAL_SPLITS), figsize=(5 * len(EVAL_SPLITS), 4), sharey=True)
    width = 0.8 / len(negs)
    for ax, split in zip(axes, EVAL_SPLITS):
        for j, neg in enumerate(negs):
            xs, ys = [], []
            for i, arch in enumerate(archs):
                c = next((c for c in cells if c["architecture"] == arch and c["negatives"] == neg), None)
                if c is not None and not math.isnan(c[f"{split}/own_world/macro"]):
                    xs.append(i + (j - (len(negs) - 1) / 2) * width)
                    ys.append(100 * c[f"{split}/own_world/macro"])
            bars = ax.bar(xs, ys, width, label=neg)
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
        chance = [c[f"{split}/chance"] for c in cells if not math.isnan(c.get(f"{split}/chance", math.nan))]
        if chance:
            ax.axhline(100 * chance[0], color="grey", linestyle="--", linewidth=1, label="random ranking")
        ax.set_xticks(range(len(archs)), archs)
        ax.set_title(f"{split} worlds")
        ax.set_ylabel(f"top-{k} recall, own world, macro (%)")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(title="negatives")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
