#!/usr/bin/env bash
# Issue 36 on a lent GPU machine: Table 1 in miniature with both towers trained, and the staleness
# ablation, through Ray, the shard actor on the GPU and the DeepSpeed worker (jobs/mini_paper.py), from
# the repository root. Two calls on one warm machine, as the 64 MiB carry limit needs:
#   1. carry .gpu_carry (scripts/gpu_carry.sh):  STAGE=install bash scripts/device_table1_both.sh
#      (Ray, Ray Train and DeepSpeed into the machine's python3; they stay while the machine is warm)
#   2. carry .devcarry, made here by
#        .venv/bin/python scripts/device_table2.py pack .devcarry --grid runs/mini_paper_both \
#          --grid-config configs/mini_paper/minilm_both_towers_gpu.yaml \
#          --grid-config configs/mini_paper/minilm_staleness_gpu.yaml
#      (MiniLM, the prepared Zeshel stores, and the cells done in earlier leases):
#        bash scripts/device_table1_both.sh
# The grids run until GRID_SECONDS, Table 1 first, then the ablation's own cells; every cell done comes
# back in $OUT/both.tgz with the logs. Here: tar xzf both.tgz, then pack again for the next lease, which
# runs only what is left (the cells are keyed by their settings: tests/minipaper/test_both_towers_configs.py).
#   GRID_SETS: extra --set flags for jobs/mini_paper.py (the CPU rehearsal shrinks the runs with it);
#   CONFIGS: which of the two grids, in order (default: both);
#   HIDE_FAISS=1 (the CPU rehearsal): `import faiss` fails in every process of the run, as on the GPU
#   machine, which has none.
set -u
OUT=${OUT:-/tmp/both_out}
GRID=${GRID:-runs/mini_paper_both}
GRID_SECONDS=${GRID_SECONDS:-480}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"
if [[ "${STAGE:-run}" == "install" ]]; then
  bash .gpu_carry/install.sh > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
  tail -2 "$OUT/install.log"
  echo "install: $(( $(date +%s) - T0 )) s"
  exit 0
fi
"$PY" -c "import ray, deepspeed" 2>/dev/null || { echo "no Ray or DeepSpeed here: run STAGE=install first" >&2; exit 1; }
export PYTHONPATH="$PWD:/tmp/both_site${PYTHONPATH:+:$PYTHONPATH}"
"$PY" scripts/device_table2.py unpack .devcarry /tmp/both_site || exit 1
if [[ -n "${HIDE_FAISS:-}" ]]; then  # first on the path, for the job, the Ray head and every worker
  mkdir -p "$OUT/no_faiss/faiss"
  echo 'raise ImportError("faiss is hidden (HIDE_FAISS=1): the GPU machine has none")' > "$OUT/no_faiss/faiss/__init__.py"
  export PYTHONPATH="$OUT/no_faiss:$PYTHONPATH"
  "$PY" -c "import faiss" 2>/dev/null && { echo "HIDE_FAISS: faiss still imports" >&2; exit 1; }
fi
# A shard on this GPU against one on its CPU, for every call the service makes (benchmarks/gpu.py, section
# shard; seconds): a failure is in $OUT/gpu_shard.json before any cell meets it.
"$PY" -m benchmarks.gpu --sections shard --force --out "$OUT" > "$OUT/gpu_shard.log" 2>&1
echo "gpu shard check exit: $? after $(( $(date +%s) - T0 )) s" | tee -a "$OUT/grid.txt"
LEFT=$GRID_SECONDS
for config in ${CONFIGS:-minilm_both_towers_gpu minilm_staleness_gpu}; do
  START=$(date +%s)
  # shellcheck disable=SC2086
  timeout "$LEFT" "$PY" jobs/mini_paper.py --config "configs/mini_paper/$config.yaml" --out "$GRID" \
      ${GRID_SETS:-} > "$OUT/$config.log" 2>&1
  echo "$config exit: $? after $(( $(date +%s) - T0 )) s" | tee -a "$OUT/grid.txt"
  LEFT=$(( LEFT - ($(date +%s) - START) ))
  (( LEFT > 30 )) || break
done
tar czf "$OUT/both.tgz" $(ls "$GRID"/mini_paper.json 2>/dev/null) "$GRID"/logs \
    $(ls -d "$GRID"/cells/*/{summary.json,metrics.jsonl} 2>/dev/null)
ls -la "$OUT"
