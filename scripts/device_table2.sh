#!/usr/bin/env bash
# The MiniLM Table 2 on the lent GPU machine (no Ray, DeepSpeed or network there), from the
# repository root, with .devcarry from `.venv/bin/python scripts/device_table2.py pack .devcarry`
# carried. Results come back in $OUT/table2.tgz (the grid's JSON, logs and the reranker cells'
# summaries), whatever finished before GRID_SECONDS.
#   TABLE2_SETS: extra --set flags for jobs/mini_paper.py (the tiny rehearsal on a CPU uses it).
set -u
OUT=${OUT:-/tmp/table2_out}
GRID_SECONDS=${GRID_SECONDS:-420}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:/tmp/table2_site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 scripts/device_table2.py unpack .devcarry /tmp/table2_site || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
# shellcheck disable=SC2086
timeout "$GRID_SECONDS" python3 jobs/mini_paper.py --config configs/mini_paper/minilm_table2_gpu.yaml \
    --out runs/mini_paper_minilm ${TABLE2_SETS:-} 2>&1 | tee "$OUT/grid.log"
echo "grid exit: ${PIPESTATUS[0]}" | tee -a "$OUT/grid.log"
tar czf "$OUT/table2.tgz" runs/mini_paper_minilm/mini_paper.json runs/mini_paper_minilm/logs \
    $(ls -d runs/mini_paper_minilm/cells/rerank-*/{summary.json,result.json,metrics.jsonl} 2>/dev/null)
ls -la "$OUT"
