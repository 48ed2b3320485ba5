"""How the jobs take their run (dist_nce.cli.common.hold_run / hold, over dist_nce.core.run_lock): which
directories, what a refusal and a filesystem without locks print, and that the Zeshel retriever job stops
before its data when its run is in use (the AIDA job: tests/jobs/test_aida_finetune.py; the reranker:
tests/rerank/test_rerank_data.py; the grids: tests/zeshel/test_zeshel_grid.py, tests/cli/test_mini_paper_ray.py)."""
from __future__ import annotations

import errno
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from dist_nce.cli.common import hold, hold_run
from dist_nce.core.run_lock import LOCK_FILE, acquire

REPO = Path(__file__).resolve().parents[2]


def run(tmp_path: Path, **fields) -> SimpleNamespace:
    return SimpleNamespace(**{"output_dir": str(tmp_path / "out"), "storage_path": str(tmp_path / "ray"),
                              "name": "r", **fields})


def test_the_run_directory_and_ray_trains_run_are_held_until_the_stack_closes(tmp_path, capsys):
    with hold_run(run(tmp_path)):
        assert (tmp_path / "out" / LOCK_FILE).is_file() and (tmp_path / "ray" / ".r.lock").is_file()
        assert not (tmp_path / "ray" / "r").exists()  # beside Ray Train's run directory, not in it
        assert hold_run(run(tmp_path, output_dir=str(tmp_path / "other"))) == 2  # one name, one storage
        assert capsys.readouterr().err.startswith(f"error: Ray Train run {tmp_path / 'ray' / 'r'} is in use by "
                                                  f"another job (pid {os.getpid()} on host ")
        with acquire(tmp_path / "other"):  # the refusal released what it had taken
            pass
    with hold_run(run(tmp_path)):  # released with the stack
        pass


@pytest.mark.parametrize("fields", [{"storage_path": "s3://bucket/ray"}, {"backend": "local"}])
def test_no_storage_lock_where_ray_train_keeps_no_local_run(tmp_path, fields, monkeypatch):
    """A remote storage cannot be flocked (nor made a local directory "s3:/..."); the reranker's local
    backend writes no Ray Train run."""
    monkeypatch.chdir(tmp_path)
    with hold_run(run(tmp_path, **fields)):
        assert sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(tmp_path / "out") == [LOCK_FILE]


def test_a_filesystem_without_locks_warns_and_runs_unguarded(tmp_path, capsys, monkeypatch):
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    held = hold([(tmp_path, LOCK_FILE, f"run directory {tmp_path}")], "use another run.name")
    assert held != 2
    held.close()
    assert capsys.readouterr().err == (f"warning: {tmp_path / LOCK_FILE}: the filesystem keeps no locks (No locks "
                                       f"available): nothing stops a second job on run directory {tmp_path} "
                                       "meanwhile\n")


def test_a_directory_that_cannot_be_made_is_named(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert hold([(tmp_path / "file" / "run", LOCK_FILE, "run directory X")], "use another run.name") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: run directory X: cannot take its lock: [Errno 20] Not a directory: "
                          f"'{tmp_path / 'file' / 'run'}'"), err


def test_the_zeshel_retriever_job_stops_before_its_data_when_its_run_is_in_use(tmp_path, tiny_model_dir, capsys):
    from dist_nce.cli.zeshel_retriever import main

    out = tmp_path / "out"
    sets = [f"model.retriever.mention_model={tiny_model_dir}", f"data.prepared_dir={tmp_path / 'train'}",
            f"zeshel.eval_store={tmp_path / 'eval'}", f"zeshel.synthetic_dir={tmp_path / 'src'}",
            f"run.output_dir={out}", f"run.storage_path={tmp_path / 'ray'}"]
    argv = ["--config", str(REPO / "configs" / "zeshel" / "test_tiny.yaml"), *[w for s in sets for w in ("--set", s)]]
    capsys.readouterr()
    with acquire(out):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: run directory {out} is in use by another job (pid {os.getpid()} "), err
        assert err.count("\n") == 1 and not (tmp_path / "src").exists() and not (tmp_path / "train").exists()
        assert main([*argv, "--dry-run"]) == 0  # a config checked while its run trains
