#!/usr/bin/env bash
# Issue 39, session 15 (budget 100 s, rlserve only): the batch-invariant GEMM's launch picked per layer shape and M
# from configurations checked bit for bit against the reference (rlserve/batch_invariant/gemm_table.py; window 1
# of this session: Qwen3-8B +29.0% with the tile by M, its GEMMs +25.7% at M = 1 .. +75.4% at M = 2048).
#   0. compile every candidate tile in 12 processes side by side (Triton's disk cache; the steps below reuse it)
#   1. sweep Qwen3-8B: per layer and M (64, 8192, 32, 1, 2048, 256, 128: the cost run's first) every candidate
#      timed and its bits compared with the reference's; the fastest equal one per (layer, M) -> sweep-8b.*,
#      tuned-8b.json (the table, rewritten after each row: a cut sweep leaves the rows it did)
#   2. cost Qwen3-8B, 64 x 256 / 128: mode off vs on with tuned-8b.json (same run; + first prompt alone = in
#      batch) -> cost-8b.*
#   3. with the time left: tests/gpu/test_batch_invariant_gpu.py -k "candidate or rows": every candidate's bits =
#      the reference's on 8 shapes (the sweep checked each one it timed on the 8B shapes already); rows at M = 1 =
#      at M = 2..2048 (the default launch) -> pytest.log, reports/
#   4. with the time left: the same sweep for Qwen3-0.6B -> sweep-0.6b.*, tuned-0.6b.json
#   OUT_DIR=/tmp/x bash benchmarks/device/s15_bi.sh ;  DRY_RUN=1 ... (CPU: tiny shapes, the interpreter)
NAME=s15_bi BUDGET=${BUDGET:-100}
source "$(dirname "$0")/lib.sh"
mkdir -p "$OUT_DIR/reports"
source benchmarks/device/bi_shapes.sh  # DEV, DT, S06, S8, N06, N8, KW06, KW8 (lib.sh cd-ed to the repository root)
X=1; MS=64,8192,32,1,2048,256,128; MAXC=0
if [ "$DRY_RUN" = 1 ]; then
  X=10; BUDGET=1500; MS=1,130; MAXC=5; export TRITON_INTERPRET=1
fi
say "device: $CARD; main $(git rev-parse --short HEAD 2>/dev/null || echo '?')"

WN=12; [ "$DRY_RUN" = 1 ] && WN=2
for i in $(seq 0 $(( WN - 1 ))); do
  [ "$DRY_RUN" = 1 ] && [ "$i" -gt 0 ] && break  # a loaded 2-core CPU: one warm process, 1/2 of the tiles
  bounded $(( 20 * X )) $PY benchmarks/bi_gemm_sweep.py --device $DEV --warm "$i/$WN" > "$OUT_DIR/warm-$i.log" 2>&1 &
done
wait
say "warm: $(cat "$OUT_DIR"/warm-*.log | grep -c '^warm ') of $WN processes done"; grep -h Error "$OUT_DIR"/warm-*.log | head -3

sweep() {  # sweep LABEL SHAPE SECONDS
  bounded "$(( $3 * X ))" $PY benchmarks/bi_gemm_sweep.py --device $DEV --shapes "$2" --ms $MS --max-candidates $MAXC \
      --json "$OUT_DIR/sweep-$1.jsonl" --table-out "$OUT_DIR/tuned-$1.json" > "$OUT_DIR/sweep-$1.log" 2>&1
  say "sweep $2 rc=$?"; grep -h '^STEP' "$OUT_DIR/sweep-$1.log" | sed 's/^/    /'
  grep -h '"differ": \[\[' "$OUT_DIR/sweep-$1.log" | head -3 | cut -c1-300 | sed 's/^/    DIFFER /'
  gpu_cleanup
}

sweep 8b $S8 28

MODES=off,on
[ -s "$OUT_DIR/tuned-8b.json" ] && MODES="off,on:table=$OUT_DIR/tuned-8b.json"
bounded "$(( 44 * X ))" $PY benchmarks/batch_invariant.py cost --shape $S8 --device $DEV --dtype $DT $N8 \
    --reps 1 --modes "$MODES" --engine-kw "$KW8" --run-timeout $(( 30 * X )) --json "$OUT_DIR/cost-8b.jsonl" \
    > "$OUT_DIR/cost-8b.log" 2>&1
say "cost $S8 ($MODES) rc=$?"; grep -h '^COST' "$OUT_DIR/cost-8b.log" | sed 's/^/    /'; grep -h '^run ' "$OUT_DIR/cost-8b.log" | head -2
gpu_cleanup

if [ "$DEV" = cuda ]; then
  RLSERVE_GPU_REPORT="$OUT_DIR/reports" bounded 25 $PY -m pytest -q -p no:cacheprovider -rA -k "candidate or rows" \
      tests/gpu/test_batch_invariant_gpu.py > "$OUT_DIR/pytest.log" 2>&1
else
  bounded 600 $PY -m pytest -q -p no:cacheprovider tests/test_batch_invariant_triton.py -k candidate \
      tests/test_batch_invariant_gemm_table.py > "$OUT_DIR/pytest.log" 2>&1
fi
say "tests rc=$?: $(tail -n 1 "$OUT_DIR/pytest.log")"
grep -E "^(FAILED|ERROR)|^E  .*Error|GEMM .* candidates" "$OUT_DIR/pytest.log" | sed 's/^/    /' | head -12
gpu_cleanup


[ "$(left)" -ge 12 ] && sweep 0.6b $S06 $(( $(left) - 4 ))
say "done"
exit 0
