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
#      .devcarry is git-ignored: name it in the call's carry (it and .gpu_carry do not fit one call).
# The grids run until GRID_SECONDS, Table 1 first, then the ablation's own cells, and never past the call's
# CALL_LIMIT (600 s; give the device time left when less) less 90 s for stopping and packing, counted
# from the script's start. Every cell done comes back in $OUT/both.tgz with the logs, packed again each
# minute and after each grid, so a call cut short still returns the cells it finished. Here: tar xzf
# both.tgz, then pack again for the next lease, which runs only what is left (the cells are keyed by
# their settings: tests/minipaper/test_both_towers_configs.py).
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
timeout -k 10 "${SHARD_CHECK_SECONDS:-120}" "$PY" -m benchmarks.gpu --sections shard --force --out "$OUT" \
    > "$OUT/gpu_shard.log" 2>&1
echo "gpu shard check exit: $? after $(( $(date +%s) - T0 )) s" | tee -a "$OUT/grid.txt"
pack() {  # the cells done so far (their files are written atomically), swapped in whole; the minute's
  # packer and the loop's pack may overlap, so each writes a part of its own
  [[ -d "$GRID" ]] || return 0
  local part="$OUT/both.tgz.$BASHPID.part"
  tar czf "$part" $(ls "$GRID"/mini_paper.json 2>/dev/null) $(ls -d "$GRID"/logs 2>/dev/null) \
      $(ls -d "$GRID"/cells/*/{summary.json,metrics.jsonl} 2>/dev/null) 2>/dev/null && mv "$part" "$OUT/both.tgz"
  rm -f "$part"
}
# each minute; on TERM it takes its sleep with it (nothing left holding the call's output open)
(trap 'kill "$s" 2>/dev/null; exit 0' TERM; while :; do sleep 60 & s=$!; wait "$s"; pack; done) > /dev/null 2>&1 &
PACKER=$!
# the grids' deadline: GRID_SECONDS from now, and never later than the call's limit less 90 s from T0
# (a stopped grid's SIGTERM unwind is cut after 30 s, then the last pack)
DEADLINE=$(( $(date +%s) + GRID_SECONDS ))
(( DEADLINE > T0 + ${CALL_LIMIT:-600} - 90 )) && DEADLINE=$(( T0 + ${CALL_LIMIT:-600} - 90 ))
for config in ${CONFIGS:-minilm_both_towers_gpu minilm_staleness_gpu}; do
  LEFT=$(( DEADLINE - $(date +%s) ))
  (( LEFT > ${MIN_GRID_SECONDS:-30} )) || { echo "$config not started: ${LEFT} s left" | tee -a "$OUT/grid.txt"; break; }
  # shellcheck disable=SC2086
  timeout -k 30 "$LEFT" "$PY" jobs/mini_paper.py --config "configs/mini_paper/$config.yaml" --out "$GRID" \
      ${GRID_SETS:-} > "$OUT/$config.log" 2>&1
  echo "$config exit: $? after $(( $(date +%s) - T0 )) s" | tee -a "$OUT/grid.txt"
  pack
done
kill "$PACKER" 2>/dev/null
wait "$PACKER" 2>/dev/null
pack
ls -la "$OUT"
