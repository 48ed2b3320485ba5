"""docker/Dockerfile at lint level (no Docker engine here): parsed, not built."""
from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
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
    """The Ray release of an exact rayproject/ray py311 GPU tag (with or without its digest);
    None for anything floating."""
    m = re.fullmatch(r"rayproject/ray:(\d+\.\d+\.\d+)-py311-gpu(?:@sha256:[0-9a-f]{64})?", image)
    return m.group(1) if m else None


def _base_image(path: Path = DOCKERFILE) -> str:
    """The FROM image, with a global ARG's default substituted."""
    instructions = _instructions(path)
    froms = [args for word, args in instructions if word == "FROM"]
    assert len(froms) == 1, froms
    image = froms[0].split()[0]
    m = re.fullmatch(r"\$\{?(\w+)\}?", image)
    if m:
        args = dict(a.split("=", 1) for w, a in instructions[:instructions.index(("FROM", froms[0]))]
                    if w == "ARG" and "=" in a)
        image = args[m.group(1)]
    return image


def test_base_image_is_a_pinned_ray_gpu_tag_matching_the_cluster_configs():
    image = _base_image()
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
    # the production image: the gpu extra and the locks, no dev extra (pytest, kubernetes-validate)
    assert any(re.search(r"(^|\s)scripts/install\.sh --no-dev gpu$", r) for r in runs), runs
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
        # the launcher templates take the pushed name from DIST_NCE_IMAGE (tests/configs/test_launchers.py)
        assert all(i in (tag, "${DIST_NCE_IMAGE}") for i in images), f"{path.name}: {images}"


def _guard(image: str, allow: str = "0") -> subprocess.CompletedProcess:
    """The Dockerfile's digest guard (its first RUN) as the build would run it."""
    run = next(a for w, a in _instructions() if w == "RUN" and "ALLOW_UNPINNED_BASE" in a)
    return subprocess.run(["sh", "-c", run], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "RAY_IMAGE": image, "ALLOW_UNPINNED_BASE": allow})


def test_build_stops_on_a_base_image_without_digest_unless_allowed():
    instructions = _instructions()
    words = [w for w, _ in instructions]
    guard_at = next(i for i, (w, a) in enumerate(instructions) if w == "RUN" and "ALLOW_UNPINNED_BASE" in a)
    assert words.index("FROM") < guard_at < words.index("COPY"), "the guard runs before anything is installed"
    assert ("ARG", "RAY_IMAGE") in instructions[words.index("FROM"):guard_at], "RAY_IMAGE re-declared in the stage"
    digest = "sha256:" + "0" * 64
    done = _guard("rayproject/ray:2.60.0-py311-gpu")
    assert done.returncode == 1 and "scripts/pin_base_image.sh" in done.stderr, done
    assert _guard(f"rayproject/ray:2.60.0-py311-gpu@{digest}").returncode == 0
    assert _guard("rayproject/ray:2.60.0-py311-gpu", allow="1").returncode == 0


def test_pin_script_writes_the_registry_digest_into_the_dockerfile(tmp_path):
    """scripts/pin_base_image.sh against a stand-in `docker` that answers like buildx imagetools."""
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    (checkout / "docker").mkdir()
    shutil.copy(REPO / "scripts" / "pin_base_image.sh", checkout / "scripts")
    shutil.copy(DOCKERFILE, checkout / "docker" / "Dockerfile")
    digest = "sha256:" + "ab" * 32
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    docker = bin_dir / "docker"
    docker.write_text(f'#!/bin/sh\necho "$*" > {tmp_path}/docker.args\necho {digest}\n')
    docker.chmod(docker.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    tag = _base_image().split("@")[0]

    done = subprocess.run(["bash", str(checkout / "scripts" / "pin_base_image.sh")], env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "docker.args").read_text().split()[:4] == ["buildx", "imagetools", "inspect", tag]
    pinned = _base_image(checkout / "docker" / "Dockerfile")
    assert pinned == f"{tag}@{digest}" and _pinned_ray_version(pinned), pinned
    # Run again (a later re-pin): the tag is kept, the digest replaced, never doubled.
    docker.write_text(f'#!/bin/sh\necho sha256:{"cd" * 32}\n')
    subprocess.run(["bash", str(checkout / "scripts" / "pin_base_image.sh")], env=env, check=True,
                   capture_output=True, timeout=30)
    assert _base_image(checkout / "docker" / "Dockerfile") == f"{tag}@sha256:{'cd' * 32}"
    # A registry answer that is not a digest changes nothing.
    docker.write_text("#!/bin/sh\necho 'error: not found'\n")
    before = (checkout / "docker" / "Dockerfile").read_text()
    done = subprocess.run(["bash", str(checkout / "scripts" / "pin_base_image.sh")], env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and "unexpected digest" in done.stderr
    assert (checkout / "docker" / "Dockerfile").read_text() == before


def test_parser_sees_a_floating_tag(tmp_path):
    """Guards the FROM test: a continuation-split, floating FROM is parsed as such."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("# c\nFROM \\\n  rayproject/ray:latest\nRUN pip install \\\n  x\n")
    assert _instructions(bad) == [("FROM", "rayproject/ray:latest"), ("RUN", "pip install x")]
    for floating in ("rayproject/ray:latest", "rayproject/ray:2.60.0-gpu", "rayproject/ray:2.60-py311-gpu",
                     "rayproject/ray", "rayproject/ray:2.60.0-py311-gpu@sha256:abc"):
        assert _pinned_ray_version(floating) is None, floating
    arg = tmp_path / "Dockerfile.arg"
    arg.write_text("ARG RAY_IMAGE=rayproject/ray:latest\nFROM ${RAY_IMAGE}\nARG RAY_IMAGE\n")
    assert _base_image(arg) == "rayproject/ray:latest"
