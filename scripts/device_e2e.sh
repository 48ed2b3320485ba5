#!/usr/bin/env bash
# The AIDA job end to end on a lent GPU machine (no Ray, DeepSpeed or network there), from the
# repository root, with the carry from `scripts/gpu_carry.sh` (.gpu_carry/) beside the checkout:
# installs the carry (one command), then `python3 -m benchmarks.gpu_e2e`. Results come back in $OUT:
# gpu_e2e.json (written after every stage, so a run cut short keeps what it measured), the logs,
# and the Ray session's logs when something failed.
#   E2E_SECONDS: the benchmark's time limit (default 480); E2E_ARGS: more arguments for it
#   (the CPU rehearsal: E2E_SKIP_INSTALL=1 E2E_ARGS=--tiny scripts/device_e2e.sh).
# The whole benchmark at 1M entities takes about 10 minutes, past one call's 600 s. One lease (about 15
# minutes of device time, the machine's start-up included) holds it as two calls, back to back: the
# second within the 30 s the machine stays warm, which keeps $WORK and the install:
#   1. (carry .gpu_carry; ~500 s: install ~15, head ~10, the train job ~460 at the H200's last run)
#      E2E_SECONDS=540 E2E_ARGS="--stages train" bash scripts/device_e2e.sh
#   2. (~200-280 s; its limit is the device time `status` says is left, less 60)
#      E2E_SKIP_INSTALL=1 E2E_SECONDS=<left - 60> E2E_ARGS="--stages bare_engine,mining,kilt_eval" bash scripts/device_e2e.sh
# The train job goes first and alone: the rest needs its run, and it needs the most margin. A call waits
# up to LOAD_WAIT_SECONDS (45) for the load the previous one left to fall below gpu_e2e's limit.
# KB_LENGTHS=only makes a call of its own that measures the packed step and encode (see below), for another
# lease; KB_LENGTHS=1 adds them before the benchmark, which fits one call only with a short E2E_SECONDS
# (checked below).
# then, here: python -m benchmarks.gpu_e2e --assemble <dir> --partial <call 1 json> --partial <call 2 json>.
set -u
OUT=${OUT:-/tmp/e2e_out}
WORK=${WORK:-/tmp/gpu_e2e}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
T0=$(date +%s)
# A device call ends at CALL_LIMIT seconds (the lent machine's 600): a call whose timeouts add up past it
# (less a minute for the install and the copies back) would be cut before its last stage wrote anything.
if [[ -n "${KB_LENGTHS:-}" && "${KB_LENGTHS}" != "only" ]]; then
  PLANNED=$(( ${KB_TRAIN_SECONDS:-240} + ${KB_ENCODE_SECONDS:-180} + ${E2E_SECONDS:-480} ))
  if (( PLANNED > ${CALL_LIMIT:-600} - 60 )); then
    echo "device_e2e.sh: KB_LENGTHS=1 plans ${PLANNED} s (KB_TRAIN_SECONDS + KB_ENCODE_SECONDS + E2E_SECONDS)," \
      "past the call's ${CALL_LIMIT:-600} s less 60: run KB_LENGTHS=only as a call of its own" >&2
    exit 2
  fi
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"
if [[ -z "${E2E_SKIP_INSTALL:-}" ]]; then
  bash .gpu_carry/install.sh > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
  tail -2 "$OUT/install.log"
fi
echo "install: $(( $(date +%s) - T0 )) s"
# KB_LENGTHS=1: first issue 37's rows at the synthetic KILT KB's lengths, padded against packed (about 4
# minutes): the retriever step (benchmarks/gpu_train.py --lengths kb) and the refresh's encode, cold and
# warm (benchmarks/gpu_encode.py --lengths kb); KB_LENGTHS=only: those alone. KB_ARGS: more arguments for
# both (the CPU rehearsal: E2E_SKIP_INSTALL=1 KB_LENGTHS=only KB_ARGS="--quick --device cpu").
if [[ -n "${KB_LENGTHS:-}" ]]; then
  # shellcheck disable=SC2086
  timeout "${KB_TRAIN_SECONDS:-240}" "$PY" -m benchmarks.gpu_train --lengths kb --out "$OUT/gpu_train_kb.json" ${KB_ARGS:-} \
    > "$OUT/gpu_train_kb.log" 2>&1
  echo "gpu_train --lengths kb exit: $? after $(( $(date +%s) - T0 )) s"
  # shellcheck disable=SC2086
  timeout "${KB_ENCODE_SECONDS:-180}" "$PY" -m benchmarks.gpu_encode --lengths kb --out "$OUT/gpu_encode_kb.json" ${KB_ARGS:-} \
    > "$OUT/gpu_encode_kb.log" 2>&1
  echo "gpu_encode --lengths kb exit: $? after $(( $(date +%s) - T0 )) s"
  [[ "$KB_LENGTHS" == "only" ]] && exit 0
fi
# gpu_e2e refuses to record above a 1-minute load of max(1.5, 0.75 x the cores) (the previous call's
# processes may still weigh on it): wait for it to fall, a while (not for --tiny or --force, which record anyway)
LIMIT=$(awk -v n="$(nproc)" 'BEGIN {l = 0.75 * n; print (l > 1.5 ? l : 1.5)}')
if [[ " ${E2E_ARGS:-} " != *" --tiny "* && " ${E2E_ARGS:-} " != *" --force "* ]]; then
  for _ in $(seq $(( ${LOAD_WAIT_SECONDS:-45} / 5 ))); do
    awk -v l="$LIMIT" '{exit !($1 > l)}' /proc/loadavg || break
    sleep 5
  done
fi
echo "load before the benchmark: $(cut -d' ' -f1 /proc/loadavg) (limit ${LIMIT}) after $(( $(date +%s) - T0 )) s"
# shellcheck disable=SC2086
timeout "${E2E_SECONDS:-480}" "$PY" -m benchmarks.gpu_e2e --work "$WORK" --out "$OUT/gpu_e2e.json" --keep-ray-logs \
  $( [[ -d .gpu_carry/tokenizer ]] && echo --tokenizer .gpu_carry/tokenizer ) ${E2E_ARGS:-} > "$OUT/e2e.log" 2>&1
RC=$?
echo "gpu_e2e exit: $RC after $(( $(date +%s) - T0 )) s"
grep -v "gcs_client.cc" "$OUT/e2e.log" | tail -40
cp "$WORK/jobs.log" "$OUT/jobs.log" 2>/dev/null
cp "$WORK/run/metrics.jsonl" "$OUT/metrics.jsonl" 2>/dev/null
if [[ $RC -ne 0 ]]; then
  # the Ray session's logs (LocalHead keeps them: keep_logs), the workers' error streams first
  find /tmp/rh_*/ray/session_*/logs -type f -size -4M 2>/dev/null | tar czf "$OUT/ray_logs.tgz" -T - 2>/dev/null
  ls -la "$OUT/ray_logs.tgz" 2>/dev/null
  grep -v "gcs_client.cc" "$OUT/jobs.log" 2>/dev/null | grep -iE "error|Traceback|raise|exception" | tail -30
fi
exit $RC
