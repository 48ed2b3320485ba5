"""Scratch entries of killed processes are removed by the next one made, and nothing else is."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dist_nce.core.scratch import host_tag, remove_orphans, scratch_dir, scratch_file_path

PREFIX = "dist_nce_testscratch_"


def dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def make_dir(root: Path, name: str) -> Path:
    (root / name).mkdir()
    (root / name / "part.bin").write_bytes(b"x" * 1000)
    (root / name / "sub").mkdir()
    (root / name / "sub" / "more.bin").write_bytes(b"y")
    return root / name


def test_only_this_users_entries_of_dead_processes_on_this_machine_are_removed(tmp_path):
    host, dead, me = host_tag(), dead_pid(), os.getpid()
    orphan_dir = make_dir(tmp_path, f"{PREFIX}{host}_{dead}_abc")
    orphan_file = tmp_path / f"{PREFIX}{host}_{dead}_0123"
    orphan_file.write_text("store")
    live = make_dir(tmp_path, f"{PREFIX}{host}_{me}_abc")
    other_host = make_dir(tmp_path, f"{PREFIX}{'0' * 8 if host != '0' * 8 else '1' * 8}_{dead}_abc")
    other_prefix = make_dir(tmp_path, f"dist_nce_other_{host}_{dead}_abc")
    no_pid = make_dir(tmp_path, f"{PREFIX}5s7xjvnp")  # the names made before this module
    target = make_dir(tmp_path, "kept_target")
    link = tmp_path / f"{PREFIX}{host}_{dead}_link"
    link.symlink_to(target, target_is_directory=True)

    removed = remove_orphans(PREFIX, tmp_path)

    assert sorted(removed) == sorted([orphan_dir, orphan_file])
    assert not orphan_dir.exists() and not orphan_file.exists()
    for kept in (live, other_host, other_prefix, no_pid, target / "part.bin", target / "sub" / "more.bin"):
        assert kept.exists(), kept
    assert link.is_symlink()
    assert remove_orphans(PREFIX, tmp_path) == []  # nothing more to do


def test_scratch_dir_is_private_named_by_process_removed_on_exit_and_reaps_first(tmp_path):
    orphan = make_dir(tmp_path, f"{PREFIX}{host_tag()}_{dead_pid()}_zz")
    with scratch_dir(PREFIX, tmp_path) as d:
        path = Path(d)
        assert path.parent == tmp_path and path.is_dir()
        assert path.name.startswith(f"{PREFIX}{host_tag()}_{os.getpid()}_")
        assert path.stat().st_mode & 0o777 == 0o700
        assert not orphan.exists()  # removed before the new one was made
        (path / "checkpoint.bin").write_bytes(b"z")
        assert remove_orphans(PREFIX, tmp_path) == []  # a live process's directory is never removed
        assert path.exists()
    assert not path.exists()


def test_scratch_file_path_names_a_new_file_and_reaps_first(tmp_path):
    orphan = tmp_path / f"{PREFIX}{host_tag()}_{dead_pid()}_store"
    orphan.write_text("old")
    a, b = scratch_file_path(PREFIX, tmp_path), scratch_file_path(PREFIX, tmp_path)
    assert a != b and not os.path.exists(a)
    assert Path(a).name.startswith(f"{PREFIX}{host_tag()}_{os.getpid()}_")
    assert not orphan.exists()


def test_a_missing_temp_directory_is_not_an_error(tmp_path):
    assert remove_orphans(PREFIX, tmp_path / "absent") == []


def test_another_process_id_namespace_has_another_tag(monkeypatch, tmp_path):
    """A container with this machine's hostname but its own process ids (a /tmp shared with the host)
    names its entries differently, so neither side removes the other's live entries as orphans."""
    here = host_tag()
    theirs = make_dir(tmp_path, f"{PREFIX}{here}_{dead_pid()}_a")
    monkeypatch.setattr(os, "readlink", lambda path: "pid:[4026532999]" if path == "/proc/self/ns/pid" else path)
    assert host_tag() != here
    assert remove_orphans(PREFIX, tmp_path) == [] and theirs.exists()
