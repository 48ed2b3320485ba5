"""dist_nce.cluster.head: the demo's head on a machine that has never run Ray.

HOME is a new empty directory and no token is in the environment, as on a fresh machine:
the head must come up with token authentication really on, refuse a job submitted without
the token (or with a wrong one) and run one submitted with it.
"""
from __future__ import annotations

import json
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from dist_nce.cluster.runtime import ensure_auth_token

REPO = Path(__file__).resolve().parents[2]


def test_ensure_auth_token_creates_a_private_token_once(tmp_path):
    env = {"HOME": str(tmp_path)}
    where = ensure_auth_token(env)
    path = tmp_path / ".ray" / "auth_token"
    assert where == str(path) and len(path.read_text()) == 64
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    token = path.read_text()
    assert ensure_auth_token(env) == str(path) and path.read_text() == token  # kept, not replaced
    # RAY_AUTH_TOKEN_PATH is where Ray looks first after RAY_AUTH_TOKEN
    other = tmp_path / "elsewhere" / "tok"
    assert ensure_auth_token({"HOME": str(tmp_path), "RAY_AUTH_TOKEN_PATH": str(other)}) == str(other)
    assert other.read_text() != token
    assert ensure_auth_token({"RAY_AUTH_TOKEN": "abc", "HOME": str(tmp_path / "none")}) == "RAY_AUTH_TOKEN"
    assert not (tmp_path / "none").exists()


def test_concurrent_first_runs_end_with_one_token(tmp_path):
    """Processes creating the token at once all return the token that is on disk at the end
    (create-if-absent), so no cluster is left holding a token that was replaced."""
    script = ("import sys; from pathlib import Path; from dist_nce.cluster.runtime import ensure_auth_token; "
              "print(Path(ensure_auth_token({'HOME': sys.argv[1]})).read_text())")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              cwd=REPO) for _ in range(6)]
    seen = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert seen == {(tmp_path / ".ray" / "auth_token").read_text()}
    assert [f.name for f in (tmp_path / ".ray").iterdir()] == ["auth_token"]  # no temporary file left


def _submit(address: str, headers: dict[str, str]) -> int:
    body = json.dumps({"entrypoint": "python -c \"print('hello from the job')\""}).encode()
    req = urllib.request.Request(f"{address}/api/jobs/", data=body, method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.slow
@pytest.mark.ray
def test_demo_head_on_a_fresh_home_requires_the_token(ray_head):
    """The session's head (tests/conftest.py) was started as the demo starts it, with an empty
    HOME: the token was made there, private; a job is refused without it or with another one,
    and runs with it (the whole AIDA pipeline runs through this head in tests/jobs too)."""
    home, address, env = ray_head["home"], ray_head["address"], ray_head["env"]
    token_file = home / ".ray" / "auth_token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and env["RAY_AUTH_MODE"] == "token"
    assert "RAY_AUTH_TOKEN" not in env and "RAY_AUTH_TOKEN_PATH" not in env
    # Refused without the token and with a wrong one, over HTTP and through the CLI.
    assert _submit(address, {}) in (401, 403)
    assert _submit(address, {"Authorization": "Bearer " + "0" * 64}) in (401, 403)
    # the job asks an actor of the head's node which cluster its processes are told they are in
    # (RAY_ADDRESS: Ray's state API, used by Ray Train's placement-group cleaner, reads it first)
    ask = ("import os, ray; ray.init(); print('node address:', ray.get(ray.remote(num_cpus=0)("
           "lambda: os.environ.get('RAY_ADDRESS')).remote()))")
    cmd = [str(ray_head["bin_dir"] / "ray"), "job", "submit", "--address", address, "--", "python", "-c", ask]
    # Accepted with it: the client finds the token where the head made it (HOME/.ray).
    for _ in range(30):  # the job agent comes up a little after the dashboard
        ok = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
        if "No available agent" not in ok.stdout + ok.stderr:
            break
        time.sleep(2)
    assert ok.returncode == 0 and "succeeded" in ok.stdout + ok.stderr, ok.stdout[-3000:] + ok.stderr[-3000:]
    assert f"node address: {ray_head['gcs_address']}" in ok.stdout, ok.stdout[-3000:]
    wrong = subprocess.run(cmd, env={**env, "RAY_AUTH_TOKEN": "0" * 64}, capture_output=True, text=True,
                           timeout=120, cwd=REPO)
    said = (wrong.stdout + wrong.stderr).lower()
    assert wrong.returncode != 0 and "invalid authentication token" in said, said[-3000:]
    assert _submit(address, {"Authorization": f"Bearer {token_file.read_text()}"}) == 200


FAKE_RAY_START = r"""
import http.server, pathlib, sys, threading, time
count = pathlib.Path(sys.argv[1])
attempt = int(count.read_text()) + 1 if count.exists() else 1
count.write_text(str(attempt))
port = int(sys.argv[sys.argv.index("--dashboard-port") + 1])
server = http.server.HTTPServer(("127.0.0.1", port), http.server.SimpleHTTPRequestHandler)
threading.Thread(target=server.serve_forever, daemon=True).start()  # the dashboard answers at once
print("Local node IP: 127.0.0.1", flush=True)
if attempt <= int(sys.argv[2]):  # the raylet aborted: ray start fails after its dashboard came up
    time.sleep(2)
    print("Exception: The current node timed out during startup.", flush=True)
    sys.exit(1)
print("Ray runtime started.", flush=True)
time.sleep(600)
"""


def _fake_head(tmp_path, monkeypatch, failures):
    from dist_nce.cluster import head as head_mod

    script = tmp_path / "fake_ray_start.py"
    script.write_text(FAKE_RAY_START)
    count = tmp_path / "attempts"
    real = head_mod.LocalHead.command
    monkeypatch.setattr(head_mod.LocalHead, "command",
                        lambda self: [sys.executable, str(script), str(count), str(failures), *real(self)[4:]])
    return head_mod.LocalHead(env={"HOME": str(tmp_path)}, temp_dir=str(tmp_path / "t"), timeout_s=60), count


def test_a_head_whose_node_fails_after_its_dashboard_answered_is_started_again(tmp_path, monkeypatch):
    """The failure of a loaded machine (module docstring of dist_nce.cluster.head): the dashboard answers,
    then `ray start` exits. That start is not taken for a head; the next one, on new ports, is."""
    (tmp_path / "t").mkdir()
    head, count = _fake_head(tmp_path, monkeypatch, failures=1)
    first_ports = dict(head.ports)
    try:
        head.start()
        assert count.read_text() == "2" and head.proc.poll() is None
        assert "Ray runtime started." in head.log_path.read_text()
        assert [p.name for p in head.failed_logs] == ["ray_start.attempt1.log"]
        assert "timed out during startup" in head.failed_logs[0].read_text()
        assert head.ports != first_ports and len(set(head.ports.values())) == len(head.ports)
    finally:
        head.stop()
    assert head.proc is None


def test_a_head_that_never_comes_up_is_an_error_that_keeps_its_logs(tmp_path, monkeypatch):
    from dist_nce.cluster import head as head_mod

    (tmp_path / "t").mkdir()
    head, count = _fake_head(tmp_path, monkeypatch, failures=head_mod.START_ATTEMPTS)
    with pytest.raises(RuntimeError, match=rf"did not come up in {head_mod.START_ATTEMPTS} attempts") as e:
        head.start()
    assert count.read_text() == str(head_mod.START_ATTEMPTS) and head.proc is None
    assert "timed out during startup" in str(e.value) and head.log_path.exists()
    assert all(p.exists() for p in head.failed_logs) and len(head.failed_logs) == head_mod.START_ATTEMPTS - 1


def test_a_stopped_head_does_not_drain_for_30_s_unless_asked(tmp_path, monkeypatch):
    """`ray start --block` drains its node on SIGTERM (Ray's default 30 s, for Serve traffic during a
    pod upgrade); a LocalHead ends when its work is done: 0 unless the caller or the user set it. The
    session head of tests/conftest.py took 32 s to stop after the AIDA job without this."""
    from dist_nce.cluster import head as head_mod

    monkeypatch.delenv(head_mod.DRAIN_VAR, raising=False)

    def start_env(**env: str) -> dict:  # never started: its temp dir under tmp_path, not an rh_* left in /tmp
        return head_mod.LocalHead(env={"HOME": str(tmp_path), **env}, temp_dir=str(tmp_path / "t"))._start_env

    assert start_env()[head_mod.DRAIN_VAR] == "0"
    assert start_env(**{head_mod.DRAIN_VAR: "12"})[head_mod.DRAIN_VAR] == "12"
    monkeypatch.setenv(head_mod.DRAIN_VAR, "7")
    assert start_env()[head_mod.DRAIN_VAR] == "7"


def test_a_local_head_starts_no_preemption_watcher_unless_asked(tmp_path, monkeypatch):
    """Ray Train's PreemptionWatcher watches for cloud preemptions, which a node on this machine never has,
    and printed an error line at every run's start (the demo's): off on a LocalHead, a user's value wins."""
    from dist_nce.cluster import head as head_mod

    var = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
    monkeypatch.delenv(var, raising=False)

    def start_env() -> dict:
        return head_mod.LocalHead(env={"HOME": str(tmp_path)}, temp_dir=str(tmp_path / "t"))._start_env

    assert start_env()[var] == "0"
    monkeypatch.setenv(var, "1")
    assert start_env()[var] == "1"
