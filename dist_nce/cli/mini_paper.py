"""The paper's Tables 1 and 2 in miniature, over several seeds, with the live bias monitor: one resumable job.

Every cell is a run of an existing job (jobs/zeshel_retriever.py, jobs/zeshel_reranker.py,
jobs/aida_finetune.py) with ``--set`` overrides, started as its own process against ONE
local Ray head that this job starts (loopback, token auth), ``parallel`` cells at a time.
Per Zeshel architecture, a shared start (random negatives) is trained once; every negative
arm x seed branches from its exported model and trains the same steps. Table 2 reranks the
candidates of the best non-random retriever (mean val R@k) and of the random-negative one
of the same architecture, seed by seed. AIDA compares the arms with the pretrained MiniLM.

A finished cell is reused (its directory is keyed by its settings) while the stores and
models it read are the ones there now: one finished on a store or model rebuilt since stops
the grid with an error naming it. An interrupted cell resumes; rerunning the command continues
the grid. After each cell, ``<out>/mini_paper.json`` is rewritten; at the end also
``mini_paper.md`` and the PNGs (dev curves per arm, bias).

    .venv/bin/python jobs/mini_paper.py --config configs/mini_paper/tiny_cpu.yaml --out runs/mini_paper
    .venv/bin/python jobs/mini_paper.py --config configs/mini_paper/tiny_cpu.yaml --out runs/mini_paper \\
        --set 'seeds=[7, 8, 9]'          # the same grid on seeds the project did not use
    .venv/bin/python jobs/mini_paper.py ... --only zeshel,aida   # parts (reranker needs zeshel)
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Callable

from dist_nce.cli.common import CHECKOUT as ROOT, error, hold
from dist_nce.core.config import ConfigError, load_config
from dist_nce.core.flags import FlagParser, existing, names
from dist_nce.core.run_lock import LOCK_FILE
from dist_nce.minipaper.config import MiniPaperConfig

if TYPE_CHECKING:
    from dist_nce.minipaper.cells import Cell

PARTS = ("zeshel", "reranker", "aida")
Running = tuple[subprocess.Popen, float, IO[str]]  # a cell's process, its start time, its log file


def main(argv: list[str] | None = None) -> int:
    ap = FlagParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, type=existing("file", "config file"), help="configs/mini_paper/*.yaml")
    ap.add_argument("--out", required=True, help="grid directory (cells/, logs/, mini_paper.json, PNGs)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    ap.add_argument("--only", type=names(PARTS), default=",".join(PARTS), help=f"comma-separated parts of {PARTS}")
    ap.add_argument("--dry-run", action="store_true", help="check the config and every cell's, list the cells, exit")
    ap.add_help_config(MiniPaperConfig)
    args = ap.parse_args(argv)
    parts = args.only
    try:
        cfg = load_config(MiniPaperConfig, args.config, args.set)
        if "reranker" in parts and "zeshel" not in parts:
            raise ConfigError(f"--only: {','.join(parts)}: the reranker part reranks the zeshel part's candidates; "
                              "add zeshel")
        if not cfg.reranker.enabled and "reranker" in parts:
            parts.remove("reranker")
        cells = planned_cells(cfg, parts)
        cpus = head_cpus(cfg, parts, check_cells(cells))
    except ConfigError as e:
        return error(e)
    out = Path(args.out).resolve()
    if args.dry_run:
        for c in cells.values():
            print(f"{c.name}: {c.job} --config {c.config} " + " ".join(f"--set {s}" for s in c.sets))
        failed = dry_run_jobs(cells, out)
        if failed:
            return 2
        from dist_nce.minipaper.cells import StaleCell, reusable
        try:  # a rerun would stop at a cell finished on other stores or models
            reusable(cells, out, ROOT)
        except StaleCell as e:
            return error(e)
        extra = " (+ the reranker cells once the retrievers are done)" if "reranker" in parts else ""
        print(f"{args.config}: config and inputs OK: {len(cells)} cells{extra} (dry run: nothing run)")
        return 0
    # one live grid per --out (a second one stops here, status 2); each cell's job takes its own run
    held = hold([(out, LOCK_FILE, f"grid directory {out}")], "use another --out")
    if isinstance(held, int):
        return held
    with held:
        return run_grid(cfg, parts, cells, out, args.config, cpus)


def planned_cells(cfg: MiniPaperConfig, parts: list[str]) -> dict:
    from dist_nce.minipaper.cells import aida_cells, zeshel_cells

    lists = [list(zeshel_cells(cfg, ROOT).values()) if "zeshel" in parts else [],
             list(aida_cells(cfg).values()) if "aida" in parts else []]
    # Interleaved, so that a long part does not run alone at the end (a cell waits only for its needs).
    return {c.name: c for pair in itertools.zip_longest(*lists) for c in pair if c is not None}


def check_cells(cells: dict) -> dict:
    """Every cell's base config with its overrides loads (paths made by other cells aside); returns
    each cell's loaded config by name."""
    from dist_nce.minipaper.cells import AIDA_JOB, RETRIEVER_JOB
    from dist_nce.train.config import TrainJobConfig
    from dist_nce.zeshel.config import ZeshelRetrieverConfig

    kinds = {RETRIEVER_JOB: ZeshelRetrieverConfig, AIDA_JOB: TrainJobConfig}
    loaded = {}
    for c in cells.values():
        sets = [s for s in c.sets if not s.startswith("model.init_from=")]  # made by the shared start
        try:
            loaded[c.name] = load_config(kinds[c.job], ROOT / c.config, sets)
        except ConfigError as e:
            raise ConfigError(f"cell {c.name}: {e}") from None
    return loaded


def head_cpus(cfg: MiniPaperConfig, parts: list[str], runs: dict) -> int:
    """Logical CPUs of the grid's Ray head: ``parallel`` times the most any cell asks Ray for (its
    shards and its training workers live for its whole run), and at least two a cell. A head sized
    below that starts the next cells' shards and leaves their workers waiting for CPUs that only a
    finished cell frees (``runs``: :func:`check_cells`' configs; Table 2's rerankers from their config)."""
    import math

    from dist_nce.cluster.fit import Request, service_request, workers_request
    from dist_nce.rerank.config import RerankJobConfig

    def cpus(*requests: Request) -> float:
        return sum(r.count * r.each.get("CPU", 0.0) for r in requests)

    need = [2.0] + [cpus(service_request(r.service), workers_request(r.run, True)) for r in runs.values()]
    if "reranker" in parts:
        rerank = load_config(RerankJobConfig, ROOT / cfg.reranker.config, cfg.reranker.set)
        if rerank.run.backend != "local":
            need.append(cpus(workers_request(rerank.run, True)))
    return math.ceil(cfg.parallel * max(need) - 1e-9)


def dry_run_jobs(cells: dict, out: Path) -> list[str]:
    """The first cell of each part through its job's own ``--dry-run`` (inputs, tiny model);
    a cell that starts from another cell's output is checked without that override."""
    failed = []
    first: dict[str, object] = {}
    for c in cells.values():
        first.setdefault(c.part, c)
    for c in first.values():
        c = dataclasses.replace(c, sets=tuple(s for s in c.sets if not s.startswith("model.init_from=")))
        argv = c.argv(out, ROOT)
        r = subprocess.run([sys.executable, *argv, "--dry-run"], cwd=ROOT, capture_output=True, text=True)
        if r.returncode != 0:
            failed.append(c.name)
            print(f"error: cell {c.name}: {c.job} --dry-run failed:\n{r.stderr[-2000:]}", file=sys.stderr)
    return failed


class Runner:
    """Cells as job processes against one Ray head, ``parallel`` at a time, in dependency order."""

    def __init__(self, out: Path, env: dict[str, str], parallel: int, log: Callable[[str], None]):
        self.out, self.env, self.parallel, self.log = out, env, parallel, log
        self.done: dict[str, dict] = {}   # name -> summary
        self.failed: dict[str, str] = {}  # name -> why
        self.seconds: dict[str, float] = {}
        self.cells: dict[str, Cell] = {}  # every cell planned so far: what a cell starts from is one of them
        self.told_unchecked = False

    def reusable(self, cells: dict[str, Cell]) -> dict[str, dict]:
        """The cells finished by an earlier run of the grid on the inputs they would read now (summaries by
        name); raises StaleCell for one finished on other inputs. Cells finished before cells recorded
        their inputs are reused unchecked, said once."""
        from dist_nce.minipaper.cells import INPUTS, reusable

        self.cells.update(cells)
        finished, unchecked = reusable(cells, self.out, ROOT, self.cells)
        if unchecked and not self.told_unchecked:
            self.told_unchecked = True
            self.log(f"[mini-paper] {len(unchecked)} finished cells ({unchecked[0]}, ...) have no record of the stores "
                     f"and models they read ('{INPUTS}' in summary.json: written before the grid kept one): reused "
                     "unchecked")
        return finished

    def run(self, cells: dict[str, Cell], gates: dict[str, tuple[str, ...]], on_done: Callable[[str], object],
            reused: dict[str, dict] | None = None) -> None:
        """``reused``: :meth:`reusable` of ``cells``, if taken already."""
        self.cells.update(cells)
        pending = dict(cells)
        for name, s in (self.reusable(cells) if reused is None else reused).items():
            self.done[name] = s
            del pending[name]
            self.log(f"[mini-paper] {name}: finished earlier, reused")
            on_done(name)
        running: dict[str, Running] = {}
        try:
            self._loop(cells, gates, on_done, pending, running)
        finally:  # stopped (Ctrl-C, SIGTERM): the cells' processes go too; their runs resume next time
            for proc, _, logf in running.values():
                if proc.poll() is None:
                    proc.terminate()
                    try:
                        proc.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                logf.close()

    def _loop(self, cells: dict[str, Cell], gates: dict[str, tuple[str, ...]], on_done: Callable[[str], object],
              pending: dict[str, Cell], running: dict[str, Running]) -> None:
        while pending or running:
            for name, c in list(pending.items()):
                needs = (*c.after, *gates.get(name, ()))
                if any(n in self.failed for n in needs):
                    self.failed[name] = f"needs {[n for n in needs if n in self.failed]}, which failed"
                    del pending[name]
                elif len(running) < self.parallel and all(n in self.done for n in needs):
                    running[name] = self.start(c)
                    del pending[name]
            time.sleep(1)
            for name, (proc, t0, logf) in list(running.items()):
                if proc.poll() is None:
                    continue
                logf.close()
                del running[name]
                self.finish(cells[name], proc.returncode, time.perf_counter() - t0)
                if name in self.done:
                    on_done(name)
            if not running and pending and not any(
                    all(n in self.done for n in (*c.after, *gates.get(k, ()))) for k, c in pending.items()):
                for name in pending:  # nothing can start and nothing runs: a dependency never finished
                    self.failed[name] = "a cell it needs did not finish"
                pending.clear()

    def start(self, c: Cell) -> Running:
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        logf = open(self.out / "logs" / f"{c.name}.log", "a")
        argv = [sys.executable, *c.argv(self.out, ROOT)]
        logf.write(f"$ {' '.join(argv)}\n")
        logf.flush()
        self.log(f"[mini-paper] {c.name}: started ({len(self.done)} cells done)")
        proc = subprocess.Popen(argv, cwd=ROOT, env=self.env, stdout=logf, stderr=subprocess.STDOUT)
        return proc, time.perf_counter(), logf

    def finish(self, c: Cell, code: int, seconds: float) -> None:
        from dist_nce.minipaper.cells import cell_inputs, read_summary, record_inputs

        self.seconds[c.name] = seconds
        d = c.dir(self.out, ROOT)
        summary = read_summary(d) if code == 0 else None
        if summary is not None:  # with what it read, for the reruns that would reuse it
            self.done[c.name] = record_inputs(d, cell_inputs(c, self.out, ROOT, self.cells))
            self.log(f"[mini-paper] {c.name}: done in {seconds:.0f} s")
            return
        tail = (self.out / "logs" / f"{c.name}.log").read_text(errors="replace").splitlines()[-15:]
        self.failed[c.name] = f"exit {code}" if code else "no finished summary (run again to continue)"
        self.log(f"[mini-paper] {c.name}: FAILED ({self.failed[c.name]}); log {self.out / 'logs' / (c.name + '.log')}"
                 + "".join(f"\n    {line}" for line in tail))


def gates_for(cells: dict) -> dict[str, tuple[str, ...]]:
    """The first cell of each part runs alone: it generates and prepares the part's data."""
    first: dict[str, str] = {}
    for name, c in cells.items():
        first.setdefault(c.part, name)
    return {name: (first[c.part],) for name, c in cells.items() if name != first[c.part]}


def needs_ray(cfg: MiniPaperConfig, parts: list[str], cells: dict, out: Path) -> bool:
    """Whether some cell left to run needs the Ray head: any unfinished retriever or AIDA cell,
    or Table 2 unless its reranker config trains locally (``run.backend: local``)."""
    from dist_nce.minipaper.cells import read_summary
    from dist_nce.rerank.config import RerankJobConfig

    if any(read_summary(c.dir(out, ROOT)) is None for c in cells.values()):
        return True
    if "reranker" not in parts:
        return False
    return load_config(RerankJobConfig, ROOT / cfg.reranker.config, cfg.reranker.set).run.backend != "local"


def run_grid(cfg: MiniPaperConfig, parts: list[str], cells: dict, out: Path, config_path: str,
             cpus: int) -> int:
    from dist_nce.cluster.head import LocalHead
    from dist_nce.cluster.runtime import ray_env
    from dist_nce.core.artifacts import atomic_write_json, write_manifest
    from dist_nce.minipaper.cells import StaleCell, reranker_cells
    from dist_nce.minipaper.report import best_retriever, collect, write_outputs

    log = lambda s: print(s, flush=True)  # noqa: E731
    runner = Runner(out, {}, cfg.parallel, log)
    try:  # before anything starts: a cell finished on other stores or models than the grid has now
        reused = runner.reusable(cells)
    except StaleCell as e:
        return error(e)
    out.mkdir(parents=True, exist_ok=True)
    write_manifest(out, "mini_paper", 1, config=str(Path(config_path).resolve()), parts=parts)
    start = time.perf_counter()
    all_cells = dict(cells)
    stale: StaleCell | None = None

    def snapshot(_name=None) -> dict:
        result = collect(cfg, all_cells, runner.done, runner.failed, runner.seconds, out, ROOT)
        result["seconds"] = round(time.perf_counter() - start, 1)
        atomic_write_json(out / "mini_paper.json", result)
        return result

    # SIGTERM (ray job stop, kill) unwinds like Ctrl-C: the cells stop and the Ray head with them.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # Room for `parallel` cells at once (head_cpus). No head when every cell left to run trains in its
    # own process (local reranker cells on a machine without Ray: what the GPU machine that ran the
    # MiniLM Table 2 is).
    ray_needed = needs_ray(cfg, parts, cells, out)
    if ray_needed:
        log(f"[mini-paper] Ray head with {cpus} logical CPUs: {cfg.parallel} cells at once")
    with (LocalHead(num_cpus=cpus) if ray_needed else contextlib.nullcontext()) as head:
        runner.env = {**ray_env(), **head.env, "RAY_ADDRESS": head.gcs_address} if head else ray_env()
        if not ray_needed:
            log("[mini-paper] no Ray head: every cell left to run is a local (run.backend=local) reranker cell")
        runner.run(cells, gates_for(cells), snapshot, reused)
        if "reranker" in parts:
            zeshel = {k: c for k, c in cells.items() if c.part == "zeshel"}
            chosen = best_retriever(collect(cfg, all_cells, runner.done, runner.failed, runner.seconds, out, ROOT))
            if chosen is None:
                log("[mini-paper] reranker: no finished retriever arm to rerank; skipped")
            else:
                rr = reranker_cells(cfg, zeshel, chosen, ROOT)
                all_cells.update(rr)
                log(f"[mini-paper] Table 2 over the candidates of {chosen} (best non-random by mean val R@k, "
                    "and the random arm of its architecture)")
                try:
                    runner.run(rr, gates_for(rr), snapshot)
                except StaleCell as e:  # a reranker finished on other stores, models or candidates
                    stale = e
        if head and runner.failed:  # a cell that could not reach the head is diagnosed from the head's side
            head.keep_logs = True
            log(f"[mini-paper] {len(runner.failed)} cells failed; the Ray head's logs are kept in {head.temp_dir}")
    result = snapshot()
    write_outputs(result, out)
    log(f"[mini-paper] {len(runner.done)} cells done, {len(runner.failed)} failed in "
        f"{time.perf_counter() - start:.0f} s; wrote {out / 'mini_paper.json'}, mini_paper.md, PNGs")
    for name, why in runner.failed.items():
        log(f"  failed: {name}: {why}")
    if stale is not None:  # the other tables are done and written; Table 2 waits for the user's choice
        return error(stale)
    return 1 if runner.failed else 0


if __name__ == "__main__":
    sys.exit(main())
