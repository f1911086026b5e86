#!/usr/bin/env bash
# Issue 39, session 15, third window (budget 90 s, rlserve only): the batch-invariant mode's cost with the GEMM table
# committed from window 2's sweep (rlserve/batch_invariant/gemm_tuned.py; no table= override: what a user gets).
#   1. cost Qwen3-8B, 64 x 256 / 128: mode off vs on (same run; + first prompt alone = in batch) -> cost-8b.*
#   2. cost Qwen3-0.6B, 128 x 256 / 128: off vs on -> cost-0.6b.*
#   3. with the time left: tests/gpu/test_batch_invariant_gpu.py -k "candidate or rows or alone or int32" -> pytest.log, reports/
#   OUT_DIR=/tmp/x bash benchmarks/device/s15_bi_b.sh ;  DRY_RUN=1 ... (CPU: tiny shapes)
NAME=s15_bi_b BUDGET=${BUDGET:-90}
source "$(dirname "$0")/lib.sh"
mkdir -p "$OUT_DIR/reports"
source benchmarks/device/bi_shapes.sh  # DEV, DT, S06, S8, N06, N8, KW06, KW8 (lib.sh cd-ed to the repository root)
X=1
[ "$DRY_RUN" = 1 ] && X=10 && BUDGET=900
say "device: $CARD; main $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
$PY -c "from rlserve.batch_invariant.gemm_tuned import TUNED; print('committed GEMM tables:', {k: len(v) for k, v in TUNED.items()})" \
    2>&1 | tee -a "$OUT_DIR/summary.txt"

cost 8b $S8 "$N8" "$KW8" 44
cost 0.6b $S06 "$N06" "$KW06" 38

if [ "$DEV" = cuda ]; then
  RLSERVE_GPU_REPORT="$OUT_DIR/reports" bounded 30 $PY -m pytest -q -p no:cacheprovider -rA \
      -k "candidate or rows or alone or int32" tests/gpu/test_batch_invariant_gpu.py > "$OUT_DIR/pytest.log" 2>&1
  say "tests rc=$?: $(tail -n 1 "$OUT_DIR/pytest.log")"
  grep -E "^(FAILED|ERROR)|^E  .*Error|GEMM .* (candidates|rows)" "$OUT_DIR/pytest.log" | sed 's/^/    /' | head -16
  gpu_cleanup
fi
say "done"
exit 0
