#!/usr/bin/env bash
# Issue 39, session 14 (budget 140 s, or 100 s: GEMM tests only; rlserve only): the batch-invariant mode with the Triton GEMM's tile
# chosen by M (rlserve/batch_invariant/gpu.py: TILES, tile(); session 13's fixed tile per (N, K) cost
# +26.4% on Qwen3-0.6B and +40.6% on Qwen3-8B, mostly decode GEMMs on 16-48 of 132 SMs).
#   1. tests/gpu/test_batch_invariant_gpu.py: every tile gives the same bits (7 shapes), rows at M = 1 equal
#      M = 2..2048, a request alone = among 1..255 neighbours, prefix hit, graphs = eager, reference = server,
#      the 0.6B shape alone = among 15 / 127 neighbours -> pytest.log, reports/
#   2. cost Qwen3-8B, 64 x 256 / 128, mode off and on (same run, + first prompt alone = in batch) -> cost-8b.*
#   3. cost Qwen3-0.6B, 128 x 256 / 128, off and on -> cost-0.6b.*
#   4. GEMM table (where the GEMM time goes): per layer and M = 1 / 64 / 256 / 2048, cuBLAS vs the mode's
#      old fixed tile vs the tile by M (+ every tile forced when >= 30 s are left) -> gemm.jsonl, gemm.log
#   OUT_DIR=/tmp/x bash benchmarks/device/s14_bi.sh ;  DRY_RUN=1 ... (CPU: tiny shapes, the interpreter's tests)
NAME=s14_bi BUDGET=${BUDGET:-140}
source "$(dirname "$0")/lib.sh"
mkdir -p "$OUT_DIR/reports"
source benchmarks/device/bi_shapes.sh  # DEV, DT, S06, S8, N06, N8, KW06, KW8 (lib.sh cd-ed to the repository root)
X=1  # step bounds x X (a loaded 2-core CPU needs far longer than the GPU)
[ "$DRY_RUN" = 1 ] && X=10 && BUDGET=1500
say "device: $CARD; main $(git rev-parse --short HEAD 2>/dev/null || echo '?')"

# under 130 s of budget: only the tile test (every tile of gpu.TILES gives the same bits on seven shapes); the cost
# runs below still check a prompt alone = in its batch of 64 / 128 on the real shapes
KSEL=""; TB=55; [ "$BUDGET" -lt 130 ] && KSEL="-k tile" && TB=20
if [ "$DEV" = cuda ]; then
  RLSERVE_GPU_REPORT="$OUT_DIR/reports" bounded $TB $PY -m pytest -q -p no:cacheprovider -rA $KSEL \
      tests/gpu/test_batch_invariant_gpu.py > "$OUT_DIR/pytest.log" 2>&1
else
  bounded 600 $PY -m pytest -q -p no:cacheprovider tests/test_batch_invariant_triton.py -k "tile or gemm" \
      > "$OUT_DIR/pytest.log" 2>&1
fi
say "tests rc=$?: $(tail -n 1 "$OUT_DIR/pytest.log")"
grep -E "^(FAILED|ERROR)|^E  .*Error|GEMM .* (rows|tiles)" "$OUT_DIR/pytest.log" | sed 's/^/    /' | head -24
gpu_cleanup

cost 8b $S8 "$N8" "$KW8" 44
cost 0.6b $S06 "$N06" "$KW06" 38

ALL=""; [ "$(left)" -ge 28 ] && ALL="--all-tiles"
if [ "$DEV" = cuda ]; then
  bounded 40 $PY benchmarks/batch_invariant.py gemm --device cuda --shapes qwen3-8b,qwen3-0.6b --ms 1,64,256,2048 \
      $ALL --json "$OUT_DIR/gemm.jsonl" > "$OUT_DIR/gemm.log" 2>&1
else
  TRITON_INTERPRET=1 bounded 300 $PY benchmarks/batch_invariant.py gemm --device cpu --shapes tiny-llama --ms 1,33 \
      --json "$OUT_DIR/gemm.jsonl" > "$OUT_DIR/gemm.log" 2>&1
fi
say "gemm table rc=$? ${ALL:-(no --all-tiles)}"; grep -h '^STEP' "$OUT_DIR/gemm.log" | sed 's/^/    /'
gpu_cleanup
say "done"
exit 0
