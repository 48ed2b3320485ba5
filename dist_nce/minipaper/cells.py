"""The mini-paper's cells: one run of an existing job each, keyed by what its result depends on.

A cell is ``python <job> --config <base> --set ...`` with the run placed in
``<out>/cells/<name>-<key>/``. The key hashes the job, the base config's text and the
overrides that change its result (not where its job stops or checkpoints: ``BOOKKEEPING``;
the grid directory written as ``<out>``, so a moved grid keeps its keys);
an override that points at another cell's directory (``model.init_from``,
``data.candidates_dir``) carries that cell's key, so a changed shared start re-keys every
branch. A cell whose ``summary.json`` says ``done`` is reused; an interrupted one resumes
(Ray Train continues the run of the same name); a cell whose settings changed gets a new
directory and never reuses a stale result.
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from dist_nce.minipaper.config import MiniPaperConfig

RETRIEVER_JOB = "jobs/zeshel_retriever.py"
RERANKER_JOB = "jobs/zeshel_reranker.py"
AIDA_JOB = "jobs/aida_finetune.py"
SUMMARY = "summary.json"
OUT = "<out>"


# Overrides that change where a cell's job stops or checkpoints and what it reports, not its result (resumes are
# exact): in the key, `run.stop_after_steps=N` made a time-boxed cell another cell at each N (trained from step 0),
# and at the same N the cell stopped at once, run after run.
BOOKKEEPING = ("run.stop_after_steps", "run.checkpoint_every_steps", "run.num_to_keep", "run.max_failures",
               "run.tracking")


def _bookkeeping(key: str) -> bool:
    return any(key == b or key.startswith(b + ".") for b in BOOKKEEPING)


@dataclass(frozen=True)
class Cell:
    part: str                      # zeshel | reranker | aida
    name: str                      # plain: zeshel-dual-hard-s0
    job: str                       # path relative to the project root
    config: str                    # base YAML
    sets: tuple[str, ...]          # overrides, "<out>" standing for the grid directory
    labels: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    after: tuple[str, ...] = ()    # cells that must be done first (by name)

    def key(self, root: Path) -> str:
        """10 hex digits of sha256 over the job, the base config's text and the overrides that change its
        result (not :data:`BOOKKEEPING`'s)."""
        sets = [s for s in self.sets if not _bookkeeping(s.split("=", 1)[0].strip())]
        blob = json.dumps([self.job, _config_text(root / self.config), sets], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:10]

    def dir(self, out: Path, root: Path) -> Path:
        return out / "cells" / f"{self.name}-{self.key(root)}"

    def argv(self, out: Path, root: Path) -> list[str]:
        """The job's command line (after the interpreter), the run placed in the cell's directory."""
        d = self.dir(out, root)
        sets = [s.replace(OUT, str(out)) for s in self.sets]
        sets += [f"run.output_dir={d}", f"run.name={d.name}", f"run.storage_path={out / 'ray_results'}"]
        return [str(root / self.job), "--config", str(root / self.config), *(a for s in sets for a in ("--set", s))]


@functools.lru_cache(maxsize=None)
def _config_text(path: Path) -> str:
    """A base config's text as first read by this process: editing the file while a grid runs
    must not move a running cell to another directory (its key would change under it)."""
    return path.read_text(encoding="utf-8") if path.exists() else str(path)


def cell_path(cells: dict[str, Cell], name: str, root: Path) -> str:
    """``<out>/cells/<name>-<key>``: another cell's directory, as an override value."""
    return f"{OUT}/cells/{name}-{cells[name].key(root)}"


def zeshel_cells(cfg: MiniPaperConfig, root: Path) -> dict[str, Cell]:
    """Per architecture: the shared start (if ``warmup``), then arms x seeds branching from it."""
    z = cfg.zeshel
    cells: dict[str, Cell] = {}
    for arch, arch_sets in z.architectures.items():
        start: tuple[str, ...] = ()
        after: tuple[str, ...] = ()
        if z.warmup is not None:
            w = Cell("zeshel", f"zeshel-{arch}-start", RETRIEVER_JOB, z.config,
                     (*z.set, *arch_sets, *z.warmup, f"optim.seed={z.warmup_seed}"),
                     {"architecture": arch, "arm": "start", "seed": z.warmup_seed})
            cells[w.name] = w
            start = (f"model.init_from={cell_path(cells, w.name, root)}/model",)
            after = (w.name,)
        for arm, arm_sets in z.arms.items():
            for seed in cfg.seeds_of("zeshel"):
                c = Cell("zeshel", f"zeshel-{arch}-{arm}-s{seed}", RETRIEVER_JOB, z.config,
                         (*z.set, *arch_sets, *z.branch, *arm_sets, *start, f"optim.seed={seed}"),
                         {"architecture": arch, "arm": arm, "seed": seed}, after)
                cells[c.name] = c
    return cells


def reranker_cells(cfg: MiniPaperConfig, zeshel: dict[str, Cell], retrievers: Sequence[tuple[str, str]],
                   root: Path) -> dict[str, Cell]:
    """Table 2: a reranker per (architecture, arm) in ``retrievers`` and seed, over the
    candidates of that retriever's run with the same seed."""
    r = cfg.reranker
    cells: dict[str, Cell] = {}
    for arch, arm in retrievers:
        for seed in cfg.seeds_of("reranker"):
            src = f"zeshel-{arch}-{arm}-s{seed}"
            c = Cell("reranker", f"rerank-{arch}-{arm}-s{seed}", RERANKER_JOB, r.config,
                     (*r.set, f"data.candidates_dir={cell_path(zeshel, src, root)}/candidates", f"optim.seed={seed}"),
                     {"architecture": arch, "arm": arm, "seed": seed}, (src,))
            cells[c.name] = c
    return cells


def aida_cells(cfg: MiniPaperConfig) -> dict[str, Cell]:
    a = cfg.aida
    cells: dict[str, Cell] = {}
    for arch, arch_sets in a.architectures.items():
        for arm, arm_sets in a.arms.items():
            for seed in cfg.seeds_of("aida"):
                c = Cell("aida", f"aida-{arch}-{arm}-s{seed}", AIDA_JOB, a.config,
                         (*a.set, *arch_sets, *arm_sets, f"optim.seed={seed}"),
                         {"architecture": arch, "arm": arm, "seed": seed})
                cells[c.name] = c
    return cells


def read_summary(d: Path) -> dict[str, Any] | None:
    """The cell's summary if its run finished, else None."""
    p = d / SUMMARY
    if not p.exists():
        return None
    s = json.loads(p.read_text(encoding="utf-8"))
    return s if s.get("done") else None
