#!/usr/bin/env bash
# The GPU carry: one folder (at most 60 MiB) that installs, without network, everything the AIDA job
# needs on a GPU machine that has Python 3.12, torch with CUDA, transformers and pyarrow but no Ray,
# DeepSpeed or PyPI (the lent H200 machines: docs/gpu.md, "On a GPU").
#
#   scripts/gpu_carry.sh [--python PY] [--out DIR]
#
#   --python PY  the interpreter that builds DeepSpeed's wheel and whose Ray and DeepSpeed versions
#                are pinned (default: .venv/bin/python of this checkout)
#   --out DIR    the carry (default: .gpu_carry/ in this checkout; git-ignored; emptied first)
#
# What it holds:
#   * wheels/ray-<v>-cp312-*.whl.xz: Ray's wheel without its Java jars (ray/jars), RLlib, ray/llm and the
#     dashboard's source maps (*.map), none of which a Python job, Ray Train or the job server loads;
#     stored uncompressed in the zip and then xz-compressed (79 MB wheel -> about 30 MB);
#   * wheels/deepspeed-<v>-py3-none-any.whl, built here from PyPI's sdist with DS_BUILD_OPS=0 (pure
#     Python: the project's engine hands DeepSpeed a torch optimizer and needs no op);
#   * wheels/*.whl: what ray[default,train] and DeepSpeed need for CPython 3.12 on manylinux x86_64
#     and the machine lacks (DEVICE_HAS below: its image's packages, docs/gpu.md). The job server
#     (dashboard) starts only when all of ray/dashboard/optional_deps.py imports: opencensus,
#     opentelemetry, aiohttp_cors, pydantic, ...;
#   * tokenizer/: the MiniLM (uncased BERT) tokenizer files, for benchmarks/gpu_e2e.py's random
#     BERT-base towers (no weights travel: the machine builds them, seed 0);
#   * install.sh: the one command, run there from the repository root:
#         bash .gpu_carry/install.sh
#     (pip install --no-index --no-deps of every wheel into the running python3's environment, the
#     project itself editable, then an import check of Ray's job server, Ray Train and DeepSpeed);
#   * manifest.json: every file with its size and sha256, and the versions.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$REPO/.venv/bin/python"
OUT="$REPO/.gpu_carry"
LIMIT_MIB=60
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python) PY="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    *) echo "scripts/gpu_carry.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ -x "$PY" ]] || { echo "scripts/gpu_carry.sh: $PY is not an interpreter (make venv first)" >&2; exit 1; }

version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
RAY_VERSION="$(version ray)"
DS_VERSION="$(version deepspeed)"
# The GPU image's own packages (docs/gpu.md): their wheels stay behind. Names as pip normalises them.
DEVICE_HAS=(aiohappyeyeballs aiohttp aiosignal attrs certifi charset-normalizer click filelock frozenlist fsspec
            grpcio idna msgpack multidict numpy packaging pandas prometheus-client propcache protobuf psutil
            pyarrow python-dateutil pyyaml requests six typing-extensions urllib3 wrapt yarl tqdm einops ninja
            py-cpuinfo tzdata torch transformers)
# Not imported by a job, Ray Train or the job server: py-spy (the dashboard's stack sampler, 3 MB).
LEAVE_OUT=(py-spy)

rm -rf "$OUT"
mkdir -p "$OUT/wheels" "$OUT/tokenizer"
BUILD="$(mktemp -d)"
trap 'rm -rf "$BUILD"' EXIT
PLATFORM=(--python-version 3.12 --implementation cp --abi cp312 --platform manylinux2014_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any)

echo "== ray[default,train]==$RAY_VERSION and DeepSpeed's requirements for CPython 3.12, manylinux x86_64"
DS_REQS=(pydantic hjson einops msgpack ninja packaging psutil py-cpuinfo tqdm)
"$PY" -m pip download -q --only-binary=:all: --dest "$BUILD/dl" "${PLATFORM[@]}" \
  "ray[default,train]==$RAY_VERSION" "${DS_REQS[@]}"

echo "== deepspeed $DS_VERSION: wheel from the sdist (DS_BUILD_OPS=0)"
# --no-build-isolation: DeepSpeed's setup.py imports torch (PY's) to decide what to build; with
# DS_BUILD_OPS=0 it builds nothing and records its ops as JIT-only.
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation --no-binary deepspeed \
  --wheel-dir "$BUILD/ds" "deepspeed==$DS_VERSION"
cp "$BUILD"/ds/deepspeed-"$DS_VERSION"-py3-none-any.whl "$OUT/wheels/"

echo "== the wheels the machine lacks"
"$PY" - "$BUILD/dl" "$OUT/wheels" "${DEVICE_HAS[*]}" "${LEAVE_OUT[*]}" <<'EOF'
import re, shutil, sys
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
skip = {re.sub(r"[-_.]+", "-", n).lower() for n in (sys.argv[3] + " " + sys.argv[4]).split()}
for whl in sorted(src.glob("*.whl")):
    name = re.sub(r"[-_.]+", "-", whl.name.split("-")[0]).lower()
    if name != "ray" and name not in skip:
        shutil.copy(whl, dst / whl.name)
EOF

echo "== ray $RAY_VERSION without ray/jars, ray/rllib, ray/llm and *.map, as a stored wheel, xz-compressed"
RAY_WHL="$(ls "$BUILD"/dl/ray-"$RAY_VERSION"-*.whl)"
"$PY" "$REPO/scripts/slim_wheel.py" "$RAY_WHL" "$BUILD/ray_slim" \
  --drop ray/jars/ --drop ray/rllib/ --drop ray/llm/ --drop-suffix .map
xz -T0 -6 -c "$BUILD"/ray_slim/*.whl > "$OUT/wheels/$(basename "$RAY_WHL").xz"

echo "== the MiniLM tokenizer (uncased BERT vocabulary)"
"$PY" - "$OUT/tokenizer" <<'EOF'
import shutil, sys
from pathlib import Path
from dist_nce.core.models import TOKENIZER_FILES, default_model_dir
for name in TOKENIZER_FILES:
    if (Path(default_model_dir()) / name).exists():
        shutil.copy(Path(default_model_dir()) / name, Path(sys.argv[1]) / name)
EOF

cp "$REPO/scripts/gpu_install.sh" "$OUT/install.sh"
"$PY" - "$OUT" "$RAY_VERSION" "$DS_VERSION" "$LIMIT_MIB" <<'EOF'
import sys
from pathlib import Path
from dist_nce.core.artifacts import atomic_write_json, file_sha256
out, ray_v, ds_v, limit = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
files = {str(p.relative_to(out)): {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
         for p in sorted(out.rglob("*")) if p.is_file()}
total = sum(f["bytes"] for f in files.values())
manifest = {"kind": "dist_nce.gpu_carry", "ray": ray_v, "deepspeed": ds_v, "python": "cp312 manylinux x86_64",
            "bytes": total, "files": files, "install": "bash <carry>/install.sh  (from the repository root)"}
atomic_write_json(out / "manifest.json", manifest)
print(f"{len(files)} files, {total / 2**20:.1f} MiB")
if total > limit * 2**20:
    sys.exit(f"scripts/gpu_carry.sh: the carry is {total / 2**20:.1f} MiB, over its {limit} MiB")
EOF
ls -l "$OUT/wheels"
du -sh "$OUT"
