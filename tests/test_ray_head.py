"""dist_nce.ray_head: the demo's head on a machine that has never run Ray.

HOME is a new empty directory and no token is in the environment, as on a fresh machine:
the head must come up with token authentication really on, refuse a job submitted without
the token (or with a wrong one) and run one submitted with it.
"""
from __future__ import annotations

import json
import stat
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from dist_nce.runtime import ensure_auth_token

REPO = Path(__file__).resolve().parents[1]


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
def test_demo_head_on_a_fresh_home_requires_the_token(tmp_path, monkeypatch):
    from dist_nce.ray_head import LocalHead

    home = tmp_path / "home"
    home.mkdir()
    for var in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE", "RAY_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(home))
    with LocalHead(num_cpus=1) as head:
        token = (home / ".ray" / "auth_token").read_text()
        assert head.env["RAY_AUTH_MODE"] == "token"
        # Refused without the token and with a wrong one, over HTTP and through the CLI.
        assert _submit(head.address, {}) in (401, 403)
        assert _submit(head.address, {"Authorization": "Bearer " + "0" * 64}) in (401, 403)
        cmd = [str(head.bin_dir / "ray"), "job", "submit", "--address", head.address, "--",
               "python", "-c", "print('hello')"]
        # Accepted with it: the client finds the token where the head made it (HOME/.ray).
        for _ in range(30):  # the job agent comes up a little after the dashboard
            ok = subprocess.run(cmd, env=head.env, capture_output=True, text=True, timeout=300, cwd=REPO)
            if "No available agent" not in ok.stdout + ok.stderr:
                break
            time.sleep(2)
        assert ok.returncode == 0 and "succeeded" in ok.stdout + ok.stderr, ok.stdout[-3000:] + ok.stderr[-3000:]
        wrong = subprocess.run(cmd, env={**head.env, "RAY_AUTH_TOKEN": "0" * 64}, capture_output=True, text=True,
                               timeout=120, cwd=REPO)
        said = (wrong.stdout + wrong.stderr).lower()
        assert wrong.returncode != 0 and "invalid authentication token" in said, said[-3000:]
        assert _submit(head.address, {"Authorization": f"Bearer {token}"}) == 200
