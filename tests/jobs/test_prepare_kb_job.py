"""jobs/prepare_kb.py run as a user runs it: a subprocess of the project's Python.

Covers the printed summary, the clean ``file:line: reason`` failure (exit 2, no
traceback), resumption after the job is killed (SIGKILL) midway, and that killing the
main process alone leaves none of its pool workers behind.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from kb.chunk_worker import TEST_DELAY_ENV
from kb.prepare import PrepareConfig, prepare
from kb.store import read_arrow

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "jobs" / "prepare_kb.py"
WORDS = "river north castle album band film league station county party war song".split()


def write_inputs(root: Path, n: int, bad_line: int | None = None) -> tuple[Path, Path]:
    rng = random.Random(11)
    lines = []
    for i in range(n):
        title = f"{rng.choice(WORDS).title()} {i}"
        body = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60)))
        lines.append(json.dumps({"_id": str(i), "wikipedia_id": str(500 + i), "wikipedia_title": title,
                                 "text": [title + "\n", body + "\n"], "anchors": [], "categories": "",
                                 "history": {}}))
    if bad_line:
        lines[bad_line - 1] = lines[bad_line - 1].replace('"wikipedia_title"', '"title"')
    (root / "ks.json").write_text("\n".join(lines) + "\n")
    aida = root / "aida"
    aida.mkdir(exist_ok=True)
    mentions = [json.dumps({"id": f"m{i}", "input": f"at [START_ENT] thing {i} [END_ENT] today",
                            "output": [{"answer": f"T{i}", "provenance": [{"wikipedia_id": str(500 + 3 * i)}]}]})
                for i in range(10)]
    (aida / "aidayago2-train-kilt.jsonl").write_text("\n".join(mentions) + "\n")
    return root / "ks.json", aida


def job(args: list[str], env: dict | None = None, **kw) -> subprocess.Popen | subprocess.CompletedProcess:
    cmd = [sys.executable, str(JOB), *args]
    full_env = {**os.environ, **(env or {})}
    if kw.pop("background", False):
        return subprocess.Popen(cmd, env=full_env, cwd=REPO, start_new_session=True, **kw)
    return subprocess.run(cmd, env=full_env, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_job_prints_summary(tmp_path, minilm_dir):
    ks, aida = write_inputs(tmp_path, 40)
    r = job(["--kilt-ks", str(ks), "--aida-dir", str(aida), "--model-dir", minilm_dir, "--out", str(tmp_path / "o"),
             "--no-progress"])
    assert r.returncode == 0, r.stderr
    assert "entities: 40 in 1 part(s)" in r.stdout and "mentions train: 10; gold by id 10" in r.stdout
    assert json.loads((tmp_path / "o" / "manifest.json").read_text())["kind"] == "prepared_kb"


def test_job_bad_record_is_a_clean_error(tmp_path, minilm_dir):
    ks, _ = write_inputs(tmp_path, 40, bad_line=33)
    r = job(["--kilt-ks", str(ks), "--model-dir", minilm_dir, "--out", str(tmp_path / "o"), "--chunk-size", "1K",
             "--no-progress"])
    assert r.returncode == 2
    assert f"{ks}:33: missing field 'wikipedia_title'" in r.stderr
    assert "Traceback" not in r.stderr and "--on-bad-record skip" in r.stderr


def test_job_empty_source_is_a_clean_error(tmp_path, tiny_model_dir):
    (tmp_path / "ks.json").write_text("")
    r = job(["--kilt-ks", str(tmp_path / "ks.json"), "--model-dir", tiny_model_dir, "--out", str(tmp_path / "o"),
             "--no-progress"])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"error: {(tmp_path / 'ks.json').resolve()}: no entities" in r.stderr and "--allow-empty" in r.stderr
    r = job(["--kilt-ks", str(tmp_path / "ks.json"), "--model-dir", tiny_model_dir, "--out", str(tmp_path / "o"),
             "--no-progress", "--allow-empty"])
    assert r.returncode == 0, r.stderr
    assert "entities: 0" in r.stdout and "WARNING:" in r.stdout


def _markers(work: Path) -> dict[str, str]:
    out = {}
    for p in work.glob("*.json"):
        try:
            out[p.stem] = json.loads(p.read_text())["run"]
        except ValueError:  # being written right now (atomic rename makes this rare)
            pass
    return out


def test_killed_job_resumes_without_redoing_chunks(tmp_path, minilm_dir):
    ks, aida = write_inputs(tmp_path, 240)
    out = tmp_path / "o"
    args = ["--kilt-ks", str(ks), "--aida-dir", str(aida), "--model-dir", minilm_dir, "--out", str(out),
            "--chunk-size", "3K", "--rows-per-part", "50", "--no-progress"]
    log = open(tmp_path / "first.log", "w")
    proc = job(args, env={TEST_DELAY_ENV: "0.4"}, background=True, stdout=log, stderr=log)
    try:
        deadline = time.time() + 120
        while len(_markers(out / "chunks")) < 3:
            assert proc.poll() is None, (tmp_path / "first.log").read_text()
            assert time.time() < deadline, "no chunk finished in time"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
    before = _markers(out / "chunks")
    assert not (out / "manifest.json").exists()

    r = job(args)
    assert r.returncode == 0, r.stderr
    m = json.loads((out / "manifest.json").read_text())
    total = m["ingest"]["chunks"]
    assert 3 <= len(before) < total
    assert f"resuming: {len(before)} of {total} chunks already done" in r.stderr
    runs = m["ingest"]["chunk_runs"]
    assert {t: runs[t] for t in before} == before  # completed chunks were not redone
    assert m["ingest"]["reused_chunks"] == len(before)
    assert all(runs[t] == m["ingest"]["run"] for t in runs if t not in before)

    _assert_same_as_uninterrupted(tmp_path, out, ks, aida, minilm_dir, m)


def _assert_same_as_uninterrupted(tmp_path: Path, out: Path, ks: Path, aida: Path, minilm_dir: str, m: dict) -> None:
    ref = tmp_path / "ref"
    prepare(PrepareConfig(out=str(ref), kilt_ks=str(ks), aida_dir=str(aida), model_dir=minilm_dir,
                          rows_per_part=50, progress=False), log=lambda s: None)
    mref = json.loads((ref / "manifest.json").read_text())
    assert m["entities"]["parts"] == mref["entities"]["parts"]
    for name in m["entities"]["parts"] + ["source_index.arrow"]:
        assert read_arrow(out / "entities" / name).equals(read_arrow(ref / "entities" / name)), name
    assert read_arrow(out / "mentions/train/mentions.arrow").equals(read_arrow(ref / "mentions/train/mentions.arrow"))
    for key in ("entities", "mentions", "skipped", "tokenizer"):
        assert m[key] == mref[key]


def _group_members(pgid: int) -> dict[int, str]:
    """Live (non-zombie) processes of process group ``pgid``: pid -> state, from /proc."""
    members = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:  # exited while we looked
            continue
        # Fields after the parenthesised command: state ppid pgrp ...
        state, _ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            members[int(d.name)] = state
    return members


def test_killing_the_main_process_leaves_no_worker_and_the_rerun_resumes(tmp_path, minilm_dir):
    ks, aida = write_inputs(tmp_path, 400)
    out = tmp_path / "o"
    args = ["--kilt-ks", str(ks), "--aida-dir", str(aida), "--model-dir", minilm_dir, "--out", str(out),
            "--chunk-size", "3K", "--rows-per-part", "50", "--workers", "2", "--no-progress"]
    log = open(tmp_path / "first.log", "w")
    # Own session: the job and every process it starts share a process group to scan.
    proc = job(args, env={TEST_DELAY_ENV: "0.5"}, background=True, stdout=log, stderr=log)
    try:
        deadline = time.time() + 180
        while not _markers(out / "chunks"):
            assert proc.poll() is None, (tmp_path / "first.log").read_text()
            assert time.time() < deadline, "no chunk finished in time"
            time.sleep(0.05)
        workers = {p for p in _group_members(proc.pid) if p != proc.pid}
        # The fault must really happen: the parent dies while its workers have chunks to do.
        assert len(workers) >= 2, workers
        os.kill(proc.pid, signal.SIGKILL)  # the main process only, as `kill -9 <pid>` does
        assert proc.wait(timeout=10) == -signal.SIGKILL
        killed_at = time.time()
        while _group_members(proc.pid) and time.time() < killed_at + 10:
            time.sleep(0.1)
        survivors = _group_members(proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _group_members(proc.pid):  # leave nothing behind even when the test fails
            os.kill(pid, signal.SIGKILL)
        log.close()
    assert not survivors, f"workers alive 10 s after their parent was killed: {survivors}"
    done_before = _markers(out / "chunks")
    assert not (out / "manifest.json").exists()

    r = job(args)
    assert r.returncode == 0, r.stderr
    m = json.loads((out / "manifest.json").read_text())
    assert 1 <= len(done_before) < m["ingest"]["chunks"]
    assert f"resuming: {len(done_before)} of {m['ingest']['chunks']} chunks already done" in r.stderr
    assert m["ingest"]["reused_chunks"] == len(done_before)
    _assert_same_as_uninterrupted(tmp_path, out, ks, aida, minilm_dir, m)
