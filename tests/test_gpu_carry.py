"""The GPU carry (scripts/gpu_carry.sh): the slimmed, stored wheel pip accepts, and the one install command
(scripts/gpu_install.sh) on a fake carry in a fresh virtual environment, offline."""
from __future__ import annotations

import base64
import hashlib
import json
import lzma
import os
import site
import subprocess
import sys
import zipfile
from pathlib import Path

from scripts.slim_wheel import slim_wheel

REPO = Path(__file__).resolve().parents[1]


def _wheel(directory: Path, name: str, files: dict[str, bytes]) -> Path:
    """A pure-Python wheel ``name``-1.0 holding ``files``, with METADATA, WHEEL and a valid RECORD."""
    info = f"{name}-1.0.dist-info"
    files = {**files, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},{len(d)}\n"
                     for n, d in files.items()) + f"{info}/RECORD,,\n"
    path = directory / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for n, d in files.items():
            z.writestr(n, d)
        z.writestr(f"{info}/RECORD", record)
    return path


def test_a_slim_wheel_keeps_what_is_asked_stored_and_pip_installs_it(tmp_path):
    vendored = "fakeray/thirdparty/dep-2.0.dist-info/RECORD"  # as Ray's wheel has: not the wheel's RECORD
    src = _wheel(tmp_path, "fakeray", {"fakeray/__init__.py": b"X = 1\n", "fakeray/jars/big.jar": b"j" * 1000,
                                       "fakeray/dash/app.js": b"js", "fakeray/dash/app.js.map": b"m" * 500,
                                       vendored: b"dep.py,,\n"})
    out, kept, total = slim_wheel(src, tmp_path / "slim", ("fakeray/jars/",), (".map",))
    with zipfile.ZipFile(out) as z:
        names = z.namelist()
        assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_STORED}
    assert "fakeray/jars/big.jar" not in names and "fakeray/dash/app.js.map" not in names
    assert {"fakeray/__init__.py", "fakeray/dash/app.js", vendored} <= set(names) and (kept, total) == (6, 8)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", str(target), str(out)], check=True)
    assert (target / "fakeray" / "dash" / "app.js").exists() and not (target / "fakeray" / "jars").exists()
    record = (target / "fakeray-1.0.dist-info" / "RECORD").read_text()
    assert "app.js.map" not in record and "fakeray/__init__.py,sha256=" in record and f"{vendored},sha256=" in record
    assert (target / vendored).read_text() == "dep.py,,\n"


def test_the_install_command_installs_a_carry_offline_into_a_fresh_environment(tmp_path):
    """bash <carry>/install.sh from the repository root: every wheel (one xz-compressed) with --no-deps, the
    checkout on the path, then the import check (Ray, Ray Train, DeepSpeed, the project: here from this
    test's own environment, which the fresh one sees through a .pth file)."""
    carry = tmp_path / "carry"
    (carry / "wheels").mkdir(parents=True)
    _wheel(carry / "wheels", "fake_plain", {"fake_plain.py": b"WHO = 'plain'\n"})
    slim, _, _ = slim_wheel(_wheel(tmp_path, "fake_xz", {"fake_xz/__init__.py": b"WHO = 'xz'\n"}), tmp_path / "s",
                            (), ())
    (carry / "wheels" / f"{slim.name}.xz").write_bytes(lzma.compress(slim.read_bytes()))
    (carry / "manifest.json").write_text(json.dumps({"kind": "dist_nce.gpu_carry"}))
    (carry / "install.sh").write_text((REPO / "scripts" / "gpu_install.sh").read_text())
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    fresh_site = Path(subprocess.run([str(py), "-c", "import site; print(site.getsitepackages()[0])"],
                                     capture_output=True, text=True, check=True).stdout.strip())
    (fresh_site / "parent_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    done = subprocess.run(["bash", str(carry / "install.sh")], cwd=REPO, env={**env, "PYTHON": str(py)},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "installed: ray" in done.stdout
    said = subprocess.run([str(py), "-c", "import fake_plain, fake_xz, dist_nce; print(fake_plain.WHO, fake_xz.WHO, "
                                          "dist_nce.__file__)"], capture_output=True, text=True, check=True,
                          cwd=tmp_path).stdout.split()
    assert said[:2] == ["plain", "xz"] and said[2].startswith(str(REPO))
    assert (fresh_site / "dist_nce_checkout.pth").read_text().strip() == str(REPO)


def test_the_e2e_script_refuses_a_call_its_timeouts_do_not_fit(tmp_path):
    """scripts/device_e2e.sh with KB_LENGTHS=1 adds the two kb benchmarks' timeouts to the job benchmark's:
    at their defaults (240 + 180 + 480 s) a 600 s device call would cut the last stage before it wrote
    anything, so the script stops first and names the call of its own to make; shorter timeouts that fit
    go on to the benchmarks (here a Python that fails at once)."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "E2E_SKIP_INSTALL": "1", "PYTHON": "false",
           "WORK": str(tmp_path / "work"), "KB_LENGTHS": "1", "LOAD_WAIT_SECONDS": "0"}
    script = [str(REPO / "scripts" / "device_e2e.sh")]
    refused = subprocess.run(["bash", *script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "plans 900 s" in refused.stderr and "KB_LENGTHS=only" in refused.stderr
    assert not (tmp_path / "out" / "gpu_train_kb.log").exists()  # nothing ran
    fits = {**env, "KB_TRAIN_SECONDS": "100", "KB_ENCODE_SECONDS": "100", "E2E_SECONDS": "300"}
    ran = subprocess.run(["bash", *script], cwd=tmp_path, env=fits, capture_output=True, text=True, timeout=60)
    assert "plans" not in ran.stderr and "gpu_train --lengths kb exit: 1" in ran.stdout
    assert (tmp_path / "out" / "gpu_train_kb.log").exists()
    only = {**env, "KB_LENGTHS": "only"}  # a call of its own: the kb benchmarks alone, whatever E2E_SECONDS
    alone = subprocess.run(["bash", *script], cwd=tmp_path, env=only, capture_output=True, text=True, timeout=60)
    assert alone.returncode == 0 and "plans" not in alone.stderr and "gpu_e2e exit" not in alone.stdout


FAKE_PYTHON = r'''#!/usr/bin/env bash
# stands in for the GPU machine's python3 in scripts/device_table1_both.sh: every step succeeds at once
# but the grid, which finishes one cell, then another 2 s later, then runs on until it is stopped
for arg in "$@"; do
  if [[ "$arg" == jobs/mini_paper.py ]]; then
    grid=${@: -1}
    mkdir -p "$grid/cells/a" "$grid/cells/b" "$grid/logs"
    echo '{"cell": "a"}' > "$grid/cells/a/summary.json"
    sleep 2
    echo '{"cell": "b"}' > "$grid/cells/b/summary.json"
    exec sleep 600
  fi
done
exit 0
'''


def test_the_grid_script_stops_within_the_call_and_returns_the_cells_it_finished(tmp_path):
    """scripts/device_table1_both.sh counts the grids' time from its own start against the device call's
    limit (CALL_LIMIT less 90 s for stopping and packing), cuts a grid that runs on, starts no grid past
    that, and packs the finished cells into $OUT/both.tgz, so a lease cut short keeps them."""
    import tarfile
    import time

    fake = tmp_path / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    grid = tmp_path / "grid"
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": str(fake), "GRID": str(grid),
           "CALL_LIMIT": "98", "GRID_SECONDS": "480", "MIN_GRID_SECONDS": "3"}  # 8 s for the grids, not 480
    t0 = time.monotonic()
    done = subprocess.run(["bash", str(REPO / "scripts" / "device_table1_both.sh")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - t0
    assert done.returncode == 0, done.stderr
    assert seconds < 8 + 30 + 20, seconds  # the deadline, the kill's grace, the packing
    said = (tmp_path / "out" / "grid.txt").read_text()
    assert "minilm_both_towers_gpu exit: 124" in said  # cut by its timeout
    assert "minilm_staleness_gpu not started" in said
    with tarfile.open(tmp_path / "out" / "both.tgz") as tar:
        names = tar.getnames()
    assert any(n.endswith("cells/a/summary.json") for n in names)
    assert any(n.endswith("cells/b/summary.json") for n in names)
    assert not list((tmp_path / "out").glob("*.part"))
