"""docker/Dockerfile at lint level (no Docker engine here): parsed, not built."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"
IMAGE_PATH = "/home/ray/dist-nce"


def _instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, f"{path}: dangling line continuation"
    return out


def _ray_versions() -> set[str]:
    versions = set()
    for path in (REPO / "configs" / "cluster" / "kuberay").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            spec = (doc or {}).get("spec", {})
            spec = spec.get("rayClusterSpec", spec)
            if "rayVersion" in spec:
                versions.add(spec["rayVersion"])
    return versions


def _pinned_ray_version(image: str) -> str | None:
    """The Ray release of an exact rayproject/ray py311 GPU tag; None for anything floating."""
    m = re.fullmatch(r"rayproject/ray:(\d+\.\d+\.\d+)-py311-gpu", image)
    return m.group(1) if m else None


def test_base_image_is_a_pinned_ray_gpu_tag_matching_the_cluster_configs():
    froms = [args for word, args in _instructions() if word == "FROM"]
    assert len(froms) == 1, froms
    image = froms[0].split()[0]
    version = _pinned_ray_version(image)
    assert version, f"FROM {image}: want an exact Ray release, py311, gpu (never latest or a floating tag)"
    assert _ray_versions() == {version}, "the image's Ray must be the rayVersion the KubeRay manifests declare"


def test_installs_the_checkout_with_the_install_script_only():
    instructions = _instructions()
    workdirs = [a for w, a in instructions if w == "WORKDIR"]
    assert workdirs == [IMAGE_PATH]
    copies = [a.split() for w, a in instructions if w == "COPY"]
    assert copies and all(c[-2:] == [".", "."] for c in copies), copies  # the whole checkout, into WORKDIR
    runs = [a for w, a in instructions if w == "RUN"]
    assert any(re.search(r"(^|\s)scripts/install\.sh gpu$", r) for r in runs), runs
    assert not any("pip install" in r or "pip3 install" in r for r in runs), "installs go through scripts/install.sh"


def test_ray_processes_in_the_image_default_to_token_auth():
    envs = [a for w, a in _instructions() if w == "ENV"]
    assert "RAY_AUTH_MODE=token" in envs
    assert not any("RAY_AUTH_TOKEN" in e for e in envs), "no token baked into the image"


def test_build_context_leaves_out_venvs_data_and_runs():
    ignored = {line.strip() for line in (REPO / "docker" / "Dockerfile.dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "data", "runs"} <= ignored


def test_documented_build_tag_is_the_image_the_configs_run():
    version = re.search(r'version="([^"]+)"', (REPO / "setup.py").read_text()).group(1)
    tag = f"dist-nce:{version}"
    assert f"docker build -f docker/Dockerfile -t {tag} ." in DOCKERFILE.read_text()
    for path in (REPO / "configs" / "cluster").rglob("*.yaml"):
        images = re.findall(r"^\s*image: (\S+)", path.read_text(), re.MULTILINE)
        assert all(i == tag for i in images), f"{path.name}: {images}"


def test_parser_sees_a_floating_tag(tmp_path):
    """Guards the FROM test: a continuation-split, floating FROM is parsed as such."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("# c\nFROM \\\n  rayproject/ray:latest\nRUN pip install \\\n  x\n")
    assert _instructions(bad) == [("FROM", "rayproject/ray:latest"), ("RUN", "pip install x")]
    for floating in ("rayproject/ray:latest", "rayproject/ray:2.60.0-gpu", "rayproject/ray:2.60-py311-gpu",
                     "rayproject/ray"):
        assert _pinned_ray_version(floating) is None, floating
