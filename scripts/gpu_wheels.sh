#!/usr/bin/env bash
# A wheelhouse that installs DeepSpeed on a GPU machine without network access (the issue-23 device
# runs: Python 3.12, torch + CUDA preinstalled, no DeepSpeed, pydantic or hjson, no PyPI).
#
#   scripts/gpu_wheels.sh [--python PY] [--out DIR]
#
#   --python PY  the interpreter that builds DeepSpeed's wheel and whose DeepSpeed version is
#                pinned (default: .venv/bin/python of this checkout)
#   --out DIR    the wheelhouse (default: .gpu_wheels/ in this checkout; git-ignored; emptied first)
#
# What it holds:
#   * deepspeed-<the version PY has>-py3-none-any.whl, built here from PyPI's sdist with
#     DS_BUILD_OPS=0 (pure Python: every op is JIT-built on first use, and the project's engine
#     needs none: it hands DeepSpeed a torch optimizer);
#   * DeepSpeed's requirements except torch and numpy (the device has them), as binary wheels for
#     CPython 3.12 on manylinux x86_64, at the versions PY has: pydantic, pydantic-core,
#     annotated-types, typing-inspection, typing-extensions, hjson, einops, msgpack, ninja,
#     packaging, psutil, py-cpuinfo, tqdm. pip leaves any of them the device already has.
#
# On the device, from the repository root:
#   python -m pip install --no-index --find-links .gpu_wheels deepspeed
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$REPO/.venv/bin/python"
OUT="$REPO/.gpu_wheels"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python) PY="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    *) echo "scripts/gpu_wheels.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ -x "$PY" ]] || { echo "scripts/gpu_wheels.sh: $PY is not an interpreter (make venv first)" >&2; exit 1; }

version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
DS_VERSION="$(version deepspeed)"
DEPS=(pydantic pydantic-core annotated-types typing-inspection typing-extensions hjson einops msgpack ninja
      packaging psutil py-cpuinfo tqdm)

rm -rf "$OUT"
mkdir -p "$OUT"
BUILD="$(mktemp -d)"
trap 'rm -rf "$BUILD"' EXIT

echo "== deepspeed $DS_VERSION: wheel from the sdist (DS_BUILD_OPS=0)"
# --no-build-isolation: DeepSpeed's setup.py imports torch (PY's) to decide what to build; with
# DS_BUILD_OPS=0 it builds nothing and records its ops as JIT-only.
DS_BUILD_OPS=0 "$PY" -m pip wheel --no-deps --no-build-isolation --no-binary deepspeed \
  --wheel-dir "$BUILD" "deepspeed==$DS_VERSION"
cp "$BUILD"/deepspeed-"$DS_VERSION"-py3-none-any.whl "$OUT"/

echo "== DeepSpeed's requirements for CPython 3.12, manylinux x86_64"
SPECS=()
for dep in "${DEPS[@]}"; do SPECS+=("$dep==$(version "$dep")"); done
"$PY" -m pip download --no-deps --only-binary=:all: --dest "$OUT" \
  --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --platform any "${SPECS[@]}"

echo "== $OUT"
ls -l "$OUT"
du -sh "$OUT"
