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

The key hashes settings, not what the paths in them hold: a finished cell's ``summary.json``
also records, as ``inputs``, the identity of what its run read (:func:`cell_inputs`: its
prepared stores, models and DeepSpeed JSON by content; its shared start or candidates by the
cell that made them). A rerun reuses it only while those are the same (:func:`reusable`); one
finished on other inputs stops the grid (:class:`StaleCell`) rather than sit in a table beside
cells of the new ones.
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

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


# ------------------------------------------------------------------------- what a finished cell read

INPUTS = "inputs"  # summary.json's field: {config field: identity} of what the cell's run read (cell_inputs)


class StaleCell(Exception):
    """A finished cell whose recorded inputs are not what it would read now (one line: the first such
    cell, the inputs that changed, what to do)."""


def job_config(c: Cell, out: Path, root: Path) -> Any:
    """The cell's job config as its job loads it: ``<out>`` filled in, its local paths absolute (the job
    runs in ``root``)."""
    from dist_nce.core.config import load_config

    sets = [s.replace(OUT, str(out)) for s in c.sets]
    if c.job == RERANKER_JOB:
        from dist_nce.rerank.config import RerankJobConfig, with_absolute_paths as rerank_absolute

        return rerank_absolute(load_config(RerankJobConfig, root / c.config, sets), str(root))
    if c.job == RETRIEVER_JOB:
        from dist_nce.zeshel.config import ZeshelRetrieverConfig, absolute

        return absolute(load_config(ZeshelRetrieverConfig, root / c.config, sets), str(root))
    from dist_nce.train.config import TrainJobConfig, with_absolute_paths

    return with_absolute_paths(load_config(TrainJobConfig, root / c.config, sets), str(root))


def _store_identity(path: str) -> str:
    from dist_nce.index.encode import store_fingerprint

    try:
        return store_fingerprint(path)
    except OSError:  # gone: whatever is prepared there next is another store
        return f"absent:{path}"


def cell_inputs(c: Cell, out: Path, root: Path, cells: Mapping[str, Cell] | None = None,
                cache: dict[tuple[str, str], str] | None = None) -> dict[str, str]:
    """What a cell's run reads, by config field: its prepared stores by
    :func:`~dist_nce.index.encode.store_fingerprint` (their manifests); its model directories,
    ``model.init_from``, ``model.blink_checkpoint``, Table 2's ``data.candidates_dir`` and the DeepSpeed
    JSON by content (:func:`kb.ingest.path_fingerprint`: names, sizes, sampled bytes), as the Zeshel grid
    keys its rows (:func:`dist_nce.zeshel.grid.input_fingerprints`).

    A path another cell of the grid writes (``cells``: the grid's cells by name; a branch's start, the
    retriever whose candidates Table 2 reranks) is that cell and what it reads, not its bytes: that cell's
    key is in this one's already, an export carries its creation time, and a start run again on the same
    inputs (a lease that did not carry its export: scripts/device_table2.py) is, as every resume here
    assumes, the same start. ``cache``: identities by path, for one pass over cells sharing a model."""
    from dist_nce.core.models import default_model_dir
    from kb.ingest import path_fingerprint

    cfg = job_config(c, out, root)
    cells = cells or {}
    cache = {} if cache is None else cache
    if c.job == RERANKER_JOB:
        stores = {"data.train_store": cfg.data.train_store, "data.eval_store": cfg.data.eval_store}
        paths = {"model.reranker.model": cfg.model.reranker.model or default_model_dir(),
                 "model.init_from": cfg.model.init_from, "data.candidates_dir": cfg.data.candidates_dir}
    else:
        r = cfg.model.retriever
        stores = {"data.prepared_dir": cfg.data.prepared_dir,
                  "zeshel.eval_store": cfg.zeshel.eval_store if c.job == RETRIEVER_JOB else None}
        mention = r.mention_model or default_model_dir()
        paths = {"model.retriever.mention_model": mention,
                 "model.retriever.entity_model": r.entity_model if r.entity_model not in (None, mention) else None,
                 "model.init_from": cfg.model.init_from, "model.blink_checkpoint": cfg.model.blink_checkpoint}
    paths["deepspeed.config"] = cfg.deepspeed.config
    ids: dict[str, str] = {}
    for kind, fields, identity in (("store", stores, _store_identity), ("path", paths, path_fingerprint)):
        for name, path in fields.items():
            if not path:
                continue
            made_by = next((cells[n] for n in c.after if n in cells
                            and Path(path).is_relative_to(cells[n].dir(out, root))), None)
            if made_by is not None:
                made = json.dumps(cell_inputs(made_by, out, root, cells, cache), sort_keys=True)
                ids[name] = f"cell {made_by.dir(out, root).name}: {hashlib.sha256(made.encode()).hexdigest()}"
                continue
            if (kind, path) not in cache:
                cache[kind, path] = identity(path)
            ids[name] = cache[kind, path]
    return ids


def changed_inputs(recorded: Mapping[str, str], current: Mapping[str, str]) -> list[str]:
    """The recorded inputs whose identity is not the current one (gone, or no longer read, included)."""
    return [name for name, identity in recorded.items() if current.get(name) != identity]


def reusable(cells: Mapping[str, Cell], out: Path, root: Path, known: Mapping[str, Cell] | None = None,
             inputs: Callable[[Cell, dict], dict[str, str]] | None = None
             ) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """(summaries of the finished cells a rerun may reuse, by name; the names of those among them that
    finished before cells recorded their inputs, reused unchecked). Raises :class:`StaleCell` if a finished
    cell recorded inputs that are not what it would read now (``inputs``: :func:`cell_inputs`, with
    ``known``, the grid's other cells, for the cells ``cells`` start from).

    Why stop rather than train it again: its key, and so its directory and Ray Train run, stay the same
    (committed results are looked up by them), so training it again means deleting a finished result
    in place, and every cell after it (branches of a shared start, Table 2 over a retriever's candidates)
    with it. The Zeshel grid never deletes a finished row either (other inputs are another key there,
    another directory): another ``--out`` is that here."""
    every = {**(known or {}), **cells}
    inputs = inputs or (lambda c, cache: cell_inputs(c, out, root, every, cache))
    cache: dict[tuple[str, str], str] = {}
    finished: dict[str, dict[str, Any]] = {}
    unchecked: list[str] = []
    stale: dict[str, list[str]] = {}
    for name, c in cells.items():
        s = read_summary(c.dir(out, root))
        if s is None:
            continue
        if INPUTS not in s:
            unchecked.append(name)
        elif changed := changed_inputs(s[INPUTS], inputs(c, cache)):
            stale[name] = changed
            continue
        finished[name] = s
    if stale:
        name, changed = next(iter(stale.items()))
        d = cells[name].dir(out, root)
        more = f" (and {len(stale) - 1} more cells: {', '.join(list(stale)[1:])})" if len(stale) > 1 else ""
        raise StaleCell(
            f"cell {name} finished on other inputs: {', '.join(changed)} changed (or went) since it ran{more}; "
            f"restore them, or run the grid into another --out (to train it here again, delete {d} and "
            f"{out / 'ray_results' / d.name}, and the cells that start from it)")
    return finished, unchecked


def record_inputs(d: Path, inputs: Mapping[str, str]) -> dict[str, Any]:
    """Write ``inputs`` into the finished cell's ``summary.json`` (field :data:`INPUTS`); returns the summary."""
    from dist_nce.core.artifacts import atomic_write_json

    s = json.loads((d / SUMMARY).read_text(encoding="utf-8"))
    s[INPUTS] = dict(inputs)
    atomic_write_json(d / SUMMARY, s)
    return s
