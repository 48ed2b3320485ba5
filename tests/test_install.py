"""The install path: FAISS from exactly one package, one install script for every caller.

faiss-cpu and faiss-gpu own the same faiss/* files, so an environment must get exactly one
of them. The dry-run tests ask pip's resolver (PyPI, full dependency set) what
scripts/install.sh would install on each path.
"""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "install.sh"
FAISS = {"cpu": "faiss-cpu", "gpu": "faiss-gpu"}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _setup_kwargs() -> dict:
    call = next(n for n in ast.walk(ast.parse((REPO / "setup.py").read_text())) if isinstance(n, ast.Call)
                and getattr(n.func, "id", "") == "setup")
    out = {}
    for k in call.keywords:
        try:
            out[k.arg] = ast.literal_eval(k.value)
        except ValueError:  # computed values (long_description, packages) are not needed here
            pass
    return out


def _requirement_names(reqs: list[str]) -> set[str]:
    return {_canonical(re.match(r"[A-Za-z0-9_.\-]+", r).group(0)) for r in reqs}


def test_setup_puts_faiss_only_in_the_cpu_and_gpu_extras():
    kwargs = _setup_kwargs()
    assert not {"faiss-cpu", "faiss-gpu"} & _requirement_names(kwargs["install_requires"])
    extras = kwargs["extras_require"]
    for mode, package in FAISS.items():
        assert _requirement_names(extras[mode]) & set(FAISS.values()) == {package}, mode
    for name, reqs in extras.items():
        if name not in FAISS:
            assert not set(FAISS.values()) & _requirement_names(reqs), f"extra {name} pulls in faiss"


@pytest.fixture(scope="module")
def dry_run_reports(tmp_path_factory):
    """pip's resolution report for each path (each is ~15-30 s of PyPI).

    Two at a time, never both GPU paths at once: pip unpacks the CUDA wheels it reads metadata
    from into /tmp (~1.1 GB per GPU resolution, seen), and the disk may be short."""
    out_dir = tmp_path_factory.mktemp("reports")
    started = time.monotonic()
    reports = {}

    def start(key, args):
        report = out_dir / f"{key}.json"
        return key, report, subprocess.Popen(
            ["bash", str(SCRIPT), "--python", sys.executable, "--dry-run", str(report), *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def finish(key, report, proc):
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"dry run ({key}) failed:\n{out}\n{err}"
        reports[key] = json.loads(report.read_text())

    # make venv's two paths (with dev), and the image's (gpu without dev)
    cpu, gpu = start("cpu", ["cpu"]), start("gpu", ["gpu"])
    finish(*gpu)
    prod = start("gpu-prod", ["--no-dev", "gpu"])
    finish(*cpu)
    finish(*prod)
    print(f"dry-run resolution of both paths: {time.monotonic() - started:.1f} s")
    return reports


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(FAISS))
def test_resolution_installs_exactly_one_faiss(dry_run_reports, mode):
    versions = {_canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in dry_run_reports[mode]["install"]}
    assert {name for name in versions if name.startswith("faiss")} == {FAISS[mode]}, sorted(versions)
    assert "dist-nce" in versions and versions["torch"].split("+")[0] == "2.13.0"
    assert "kubernetes-validate" in versions  # the dev extra rides along on both paths


@pytest.mark.slow
def test_production_resolution_has_no_dev_packages_and_follows_the_lock(dry_run_reports):
    versions = {_canonical(i["metadata"]["name"]): i["metadata"]["version"]
                for i in dry_run_reports["gpu-prod"]["install"]}
    dev = _requirement_names(_setup_kwargs()["extras_require"]["dev"])
    assert dev and not dev & set(versions), sorted(dev & set(versions))
    assert "pytest" not in versions and "faiss-gpu" in versions
    from packaging.markers import Marker

    pins = {}
    for line in (REPO / "requirements" / "gpu.txt").read_text().splitlines():
        req, _, marker = line.split("#")[0].strip().partition(" ; ")
        if req and (not marker or Marker(marker).evaluate()):
            name, version = req.split("==")
            pins[_canonical(name)] = version
    for name, version in versions.items():
        if name != "dist-nce":
            assert name in pins, f"{name} {version} resolved but not in requirements/gpu.txt"
            assert version.split("+")[0] == pins[name], (name, version, pins[name])


def test_install_script_refuses_an_environment_holding_the_other_faiss(tmp_path):
    """Uninstalling one faiss package deletes the other's files, so the script stops instead."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()

    def install(mode):
        return subprocess.run(["bash", str(SCRIPT), "--python", str(python), mode],
                              capture_output=True, text=True, timeout=120)

    # Control: without faiss-gpu the script goes on to pip, which this bare venv lacks.
    done = install("cpu")
    assert done.returncode != 0 and "No module named pip" in done.stderr, done.stderr

    dist_info = Path(purelib) / "faiss_gpu-1.15.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: faiss-gpu\nVersion: 1.15.1\n")
    done = install("cpu")
    assert done.returncode == 1
    assert "faiss-gpu is installed" in done.stderr and "make clean-venv venv" in done.stderr, done.stderr
    assert "No module named pip" not in done.stderr, "stopped before touching the environment"
    done = install("gpu")  # the matching path is not refused: it goes on to pip
    assert "faiss-gpu is installed" not in done.stderr and "No module named pip" in done.stderr, done.stderr


def test_install_script_rejects_unknown_arguments():
    done = subprocess.run(["bash", str(SCRIPT), "cuda"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and "unknown argument 'cuda'" in done.stderr


def test_every_install_path_runs_the_install_script():
    """make venv, the image and the launcher nodes install through scripts/install.sh only."""
    # The Makefile, as make reads it (dry run against a venv that does not exist).
    env = {k: v for k, v in os.environ.items() if k not in ("FAISS", "MAKEFLAGS", "MFLAGS")}
    plan = subprocess.run(["make", "-n", "venv", "VENV=/nonexistent/venv"], cwd=REPO, env=env,
                          capture_output=True, text=True, check=True, timeout=30).stdout
    assert "scripts/install.sh --python /nonexistent/venv/bin/python auto" in plan, plan
    assert "pip install" not in plan, plan

    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert re.search(r"^RUN .*scripts/install\.sh --no-dev gpu$", dockerfile, re.MULTILINE)
    assert "pip install" not in dockerfile

    for path in sorted((REPO / "configs" / "cluster").glob("*.yaml")):
        config = yaml.safe_load(path.read_text())
        assert config["setup_commands"] == ["/home/ray/dist-nce/scripts/install.sh --no-dev gpu"], path.name
        assert config["file_mounts"]["/home/ray/dist-nce"] == ".", f"{path.name}: the script comes with the checkout"
        commands = [c for key, value in config.items() if key.endswith("_commands") for c in value]
        assert not any("pip install" in c for c in commands), path.name
    assert os.access(SCRIPT, os.X_OK), "the configs run the script directly"


def test_the_installed_modules_have_their_bytecode():
    """scripts/install.sh installs with pip's --no-compile and compiles site-packages itself, on every
    core. The project's venv (``make venv``, which ``make test`` builds first on a fresh clone) is what
    it made: its modules, deep ones included, have current .pyc files. Without them every process
    the suite starts would compile what it imports (PYTHONDONTWRITEBYTECODE writes none)."""
    import importlib.machinery
    import importlib.util

    if Path(sys.prefix).resolve() != (REPO / ".venv").resolve():
        pytest.skip(f"not the project's venv ({sys.prefix}): scripts/install.sh did not make it")
    modules = ["torch", "torch.nn.modules.linear", "transformers", "transformers.models.bert.modeling_bert",
               "ray", "ray.train.v2.api.data_parallel_trainer", "deepspeed", "numpy", "pyarrow", "pip"]
    stale = []
    for name in modules:
        # pip through the path finder alone: setuptools' distutils hook (on sys.meta_path) answers a lookup of
        # "pip" by switching itself off for the rest of the process, and a later `import setuptools` in this
        # pytest worker (torch.compile's C++ build) then fails its own check on the stdlib's distutils.
        spec = importlib.machinery.PathFinder.find_spec(name) if name == "pip" else importlib.util.find_spec(name)
        source = spec.origin
        cached = Path(importlib.util.cache_from_source(source))
        if not cached.exists() or cached.stat().st_mtime < Path(source).stat().st_mtime:
            stale.append(f"{name}: {cached}")
    assert not stale, stale


def test_require_faiss_returns_the_library():
    from dist_nce.cluster.runtime import require_faiss

    assert hasattr(require_faiss(), "IndexFlatIP")


def test_without_faiss_the_torch_backend_runs_and_a_faiss_backend_gives_install_advice(monkeypatch):
    """Every job, trainer and shard calls configure_process. Without faiss (a GPU machine with torch
    only) it goes on, the exact torch backend searches, and building a faiss index fails with the advice."""
    import torch

    from dist_nce.cluster.runtime import configure_process, require_faiss
    from dist_nce.index.config import IndexConfig
    from dist_nce.index.search import ShardIndex
    from dist_nce.modeling.retriever import RetrieverConfig
    from dist_nce.modeling.scoring import Reps

    installed = require_faiss()  # imported once: importing it again would wrap its classes twice
    monkeypatch.setitem(sys.modules, "faiss", None)  # `import faiss` raises ImportError
    configure_process(threads=None)
    spec = RetrieverConfig(preset="dual").spec()
    ents = torch.randn(50, 8)
    q = torch.randn(3, 8)
    top = ShardIndex(spec, Reps(ents), 0, IndexConfig(backend="torch", device="cpu")).topk(q, 5, torch.full((3,), -1))
    assert torch.equal(torch.as_tensor(top.ids), (q @ ents.t()).topk(5).indices)
    advice = r"pip install -e '\.\[cpu\]' \(faiss-cpu\) or pip install -e '\.\[gpu\]'"
    with pytest.raises(ImportError, match=advice):
        ShardIndex(spec, Reps(ents), 0, IndexConfig(backend="flat", device="cpu"))
    # on a CUDA device the index first asks whether faiss sees the GPU: the same advice, not a bare ImportError
    # (faiss_gpu "on" takes that path here)
    with pytest.raises(ImportError, match=advice):
        ShardIndex(spec, Reps(ents), 0, IndexConfig(backend="flat", device="cpu", faiss_gpu="on"))
    # the in-process search of evaluation and linking (`auto`) takes the exact torch backend; with faiss, flat
    from dist_nce.retrieval import default_index_config

    assert default_index_config(types.SimpleNamespace(spec=spec)).backend == "torch"
    monkeypatch.setitem(sys.modules, "faiss", installed)
    assert default_index_config(types.SimpleNamespace(spec=spec)).backend == "flat"


def test_jobs_fail_clearly_on_a_faiss_left_behind_by_uninstalling_its_twin(monkeypatch):
    """What `pip uninstall faiss-cpu` leaves of faiss-gpu: a faiss/ folder that imports as an
    empty namespace package (seen here: only faiss/_gpu_build.py remained)."""
    from dist_nce.cluster.runtime import configure_process

    remnant = types.ModuleType("faiss")
    remnant.__path__ = ["/venv/site-packages/faiss"]
    monkeypatch.setitem(sys.modules, "faiss", remnant)
    with pytest.raises(ImportError, match="without the FAISS library"):
        configure_process(threads=None)
