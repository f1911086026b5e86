#!/usr/bin/env bash
# Issue 39, session 13's second (short) device call, budget 120 s: after the first window's findings
# (cuBLASLt without split-K is not M-invariant on the H100; the fused sampler's logprob moved with the
# batch), the mode now runs the Triton GEMM and reads every logprob from log_softmax. Re-checks:
#   1. tests/gpu/test_batch_invariant_gpu.py (GEMM rows M = 1 vs 2..2048, cuBLAS / cuBLASLt reported;
#      alone vs 1..255 neighbours; prefix hit; graphs vs eager; reference = server; the Qwen3-0.6B shape
#      alone vs 15 / 127 neighbours, greedy / seeded / seeded top-p) -> pytest.log, reports/
#   2. cost Qwen3-0.6B, 128 x 256 / 128, off and on (+ first prompt alone = in batch) -> cost-0.6b.jsonl
#   3. cost Qwen3-8B, 64 x 256 / 128, off and on -> cost-8b.jsonl
#   OUT_DIR=/tmp/x bash benchmarks/device/s13_bi_b.sh ;  DRY_RUN=1 ... (CPU: tiny shapes, interpreter tests)
set -u
cd "$(dirname "$0")/../.."
: "${OUT_DIR:=/tmp/s13_bi_b}"
mkdir -p "$OUT_DIR/reports"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
T0=$(date +%s)
END=$(( T0 + ${BI_BUDGET:-112} ))
say() { echo "[s13_bi_b +$(( $(date +%s) - T0 ))s] $*"; }
left() { local l=$(( END - $(date +%s) )); [ "$l" -lt 1 ] && l=1; [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
gpu_clean() { for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do kill -9 "$p" 2>/dev/null; done; }
X=1  # step bounds x X (a loaded 2-core CPU needs far longer than the GPU)
if [ "${DRY_RUN:-0}" = 1 ]; then
  X=10; DEV=cpu; DT=float32; S06=tiny-llama; S8=tiny-llama
  N06="--num-prompts 6 --input-len 24 --output-len 4 --max-num-seqs 8"; N8=$N06; KW06='{}'; KW8='{}'
  echo "cpu (dry run)" > "$OUT_DIR/gpu.txt"
else
  DEV=cuda; DT=bfloat16; S06=qwen3-0.6b; S8=qwen3-8b
  N06="--num-prompts 128 --input-len 256 --output-len 128 --max-num-seqs 128"
  N8="--num-prompts 64 --input-len 256 --output-len 128 --max-num-seqs 64"
  KW06='{"extra": {"cuda_graph_sizes": [1, 32, 128]}}'; KW8='{"extra": {"cuda_graph_sizes": [1, 32, 64]}}'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT_DIR/gpu.txt" 2>&1
fi
say "device: $(head -1 "$OUT_DIR/gpu.txt")"
if [ "$DEV" = cuda ]; then
  RLSERVE_GPU_REPORT="$OUT_DIR/reports" timeout -k 5 "$(left 40)" $PY -m pytest -q -p no:cacheprovider -rA \
      tests/gpu/test_batch_invariant_gpu.py > "$OUT_DIR/pytest.log" 2>&1
else
  timeout -k 5 "$(left 300)" $PY -m pytest -q -p no:cacheprovider tests/test_batch_invariant_triton.py -k sampling \
      > "$OUT_DIR/pytest.log" 2>&1
fi
say "tests rc=$?: $(tail -n 1 "$OUT_DIR/pytest.log")"
grep -E "^(PASSED|FAILED|ERROR)|^E  .*Error|GEMM .* rows differ" "$OUT_DIR/pytest.log" | sed 's/^/    /' | head -30
gpu_clean
timeout -k 5 "$(left $((38 * X)))" $PY benchmarks/batch_invariant.py cost --shape $S06 --device $DEV --dtype $DT $N06 \
    --reps 1 --modes off,on --engine-kw "$KW06" --run-timeout $((30 * X)) --json "$OUT_DIR/cost-0.6b.jsonl" \
    > "$OUT_DIR/cost-0.6b.log" 2>&1
say "cost $S06 rc=$?"; grep -h '^COST' "$OUT_DIR/cost-0.6b.log" | sed 's/^/    /'
gpu_clean
timeout -k 5 "$(left $((42 * X)))" $PY benchmarks/batch_invariant.py cost --shape $S8 --device $DEV --dtype $DT $N8 \
    --reps 1 --modes off,on --engine-kw "$KW8" --run-timeout $((30 * X)) --json "$OUT_DIR/cost-8b.jsonl" \
    > "$OUT_DIR/cost-8b.log" 2>&1
say "cost $S8 rc=$?"; grep -h '^COST' "$OUT_DIR/cost-8b.log" | sed 's/^/    /'; grep -h '^run ' "$OUT_DIR"/cost-*.log | head -4
gpu_clean
say "done"
exit 0
