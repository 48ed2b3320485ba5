#!/usr/bin/env bash
# Installs a GPU carry (scripts/gpu_carry.sh) without network into the environment of `python3`
# (or $PYTHON), from the repository root of a dist-nce checkout:
#
#   bash .gpu_carry/install.sh
#
# Every wheel goes in with --no-deps (the carry holds exactly what the machine lacks; pip would
# otherwise look for an index), Ray's from its xz-compressed stored wheel; then the checkout itself
# (editable, no dependencies: the jobs import it from here as they do in .venv), then one import of
# what the AIDA job needs: Ray's job server, Ray Train, DeepSpeed, the project.
set -euo pipefail
CARRY="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
[[ -f "$CARRY/manifest.json" ]] || { echo "$CARRY: no manifest.json; not a carry from scripts/gpu_carry.sh" >&2; exit 1; }
[[ -f setup.py && -d dist_nce ]] || { echo "gpu_install.sh: run it from the repository root (no setup.py here)" >&2; exit 1; }
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
for x in "$CARRY"/wheels/*.whl.xz; do
  xz -dc "$x" > "$TMP/$(basename "${x%.xz}")"
done
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
  "$CARRY"/wheels/*.whl "$TMP"/*.whl
# The checkout on the interpreter's path, as a .pth file (what an editable install amounts to: pip's
# editable install wants setuptools from an index for its build environment, and there is none).
"$PYTHON" -c 'import site, sys; open(site.getsitepackages()[0] + "/dist_nce_checkout.pth", "w").write(sys.argv[1] + "\n")' "$PWD"
"$PYTHON" - <<'EOF'
import importlib
for name in ("ray", "ray.dashboard.optional_deps", "ray.train.torch", "deepspeed", "dist_nce.train.driver"):
    importlib.import_module(name)
import deepspeed, ray, torch
print(f"installed: ray {ray.__version__}, deepspeed {deepspeed.__version__}, torch {torch.__version__} "
      f"(CUDA {torch.cuda.is_available()})")
EOF
