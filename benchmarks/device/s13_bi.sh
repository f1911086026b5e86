#!/usr/bin/env bash
# Issue 39 (batch-invariant mode), device window of session 13 (budget 240 s, no vLLM): the GPU bitwise
# tests, then the mode's cost, on vs off in the same run, offline workload with dummy bf16 weights.
#
#   OUT_DIR=/tmp/x bash benchmarks/device/s13_bi.sh
#   DRY_RUN=1 OUT_DIR=/tmp/x bash benchmarks/device/s13_bi.sh   # CPU: every step once, tiny shapes
#
# Steps (each under `timeout`, bounded by what is left of ~225 s; results written as they come):
#   1. tests/gpu/test_batch_invariant_gpu.py (GEMM rows M = 1 vs 2..2048 for cuBLASLt / cuBLAS without split-K
#      and Triton on Qwen3-0.6B/8B shapes; a request alone vs among 1..255 random neighbours, greedy and seeded,
#      with GEMM auto and triton; prefix hit; graphs vs eager; reference = server; the Qwen3-0.6B shape alone vs
#      among 15 / 127 neighbours) -> pytest.log, reports/*.json
#   2. cost, Qwen3-0.6B: 128 prompts x 256 in (+-50%) / 128 out, off and on, then a profiled pass of each
#      (torch profiler, top kernels) -> cost-0.6b.jsonl, profiles/
#   3. cost, Qwen3-8B: 64 prompts x 256 / 128, off and on -> cost-8b.jsonl
#   4. cost, Qwen3-0.6B, the mode's variants (GEMM triton, prefill attention per_query; baseline: step 2's off
#      run) -> cost-0.6b-variants.jsonl
#   5. the GEMM probe with vLLM's cuBLAS workspace variables (CUBLASLT_WORKSPACE_SIZE=1) -> probe-ws.log
# Every cost run reports whether its first prompt run alone gives bitwise its tokens/logprobs in the batch.
# PART=b: the second, short call (s13_bi_b.sh, budget 112 s): steps 1-3 only, with its own bounds.
NAME=${NAME:-s13_bi} BUDGET=${BUDGET:-${BI_BUDGET:-228}}; source "$(dirname "$0")/lib.sh"
mkdir -p "$OUT_DIR/reports" "$OUT_DIR/profiles"
PART=${PART:-a}
source benchmarks/device/bi_shapes.sh  # (lib.sh cd-ed to the repository root)
X=1  # part b's step bounds x X (a loaded 2-core CPU needs far longer than the GPU)
[ "$DRY_RUN" = 1 ] && [ "$PART" = b ] && X=10
say "device: $CARD; tree $(git log -1 --format='%h %cd' 2>/dev/null); torch $($PY -c 'import torch; print(torch.__version__, torch.version.cuda)' 2>&1)"
summ() { grep -h '^COST' "$1" | sed 's/^/    /'; }
# cost CAP RUN_TIMEOUT SHAPE "NARGS" KW OUT [ARGS...]: benchmarks/batch_invariant.py cost, off and on, -> OUT.jsonl/.log
cost() {
  local cap=$1 rt=$2 shape=$3 n=$4 kw=$5 out=$6; shift 6
  # shellcheck disable=SC2086  # $n: the workload's flags
  bounded "$cap" $PY benchmarks/batch_invariant.py cost --shape "$shape" --device $DEV --dtype $DT $n --reps 1 \
      --engine-kw "$kw" --run-timeout "$rt" --json "$OUT_DIR/$out.jsonl" "$@" > "$OUT_DIR/$out.log" 2>&1
}

# 1. bitwise tests (on CPU they skip: the dry run runs the interpreter's forms instead)
if [ "$DEV" = cuda ]; then
  RLSERVE_GPU_REPORT="$OUT_DIR/reports" bounded "$([ "$PART" = b ] && echo 40 || echo 80)" $PY -m pytest -q \
      -p no:cacheprovider -rA tests/gpu/test_batch_invariant_gpu.py > "$OUT_DIR/pytest.log" 2>&1
elif [ "$PART" = b ]; then
  bounded 300 $PY -m pytest -q -p no:cacheprovider tests/test_batch_invariant_triton.py -k sampling \
      > "$OUT_DIR/pytest.log" 2>&1
else
  bounded 200 $PY -m pytest -q -p no:cacheprovider tests/test_batch_invariant_triton.py > "$OUT_DIR/pytest.log" 2>&1
fi
say "tests rc=$?: $(tail -n 1 "$OUT_DIR/pytest.log")"
grep -E "^(PASSED|FAILED|ERROR)|^E  .*Error|GEMM .* rows differ" "$OUT_DIR/pytest.log" | sed 's/^/    /' | head -60
gpu_cleanup

if [ "$PART" = b ]; then
  # 2-3. cost, 0.6B then 8B, off and on (no profiles)
  cost $((38 * X)) $((30 * X)) $S06 "$N06" "$KW06" cost-0.6b --modes off,on
  say "cost $S06 rc=$?"; summ "$OUT_DIR/cost-0.6b.log"
  gpu_cleanup
  cost $((42 * X)) $((30 * X)) $S8 "$N8" "$KW8" cost-8b --modes off,on
  say "cost $S8 rc=$?"; summ "$OUT_DIR/cost-8b.log"; grep -h '^run ' "$OUT_DIR"/cost-*.log | head -4
  gpu_cleanup
  say "done"
  exit 0
fi

# 2. cost, 0.6B, off and on + a profiled pass of each
cost 80 55 $S06 "$N06" "$KW06" cost-0.6b --modes off,on --profile-dir "$OUT_DIR/profiles"
say "cost $S06 rc=$?"; summ "$OUT_DIR/cost-0.6b.log"
for m in off on; do
  f="$OUT_DIR/profiles/profile-$S06-$m.json"
  [ -f "$f" ] && $PY -c "
import json; d = json.load(open('$f')); t = d['kernels_total_us']
print('    profile $m: total %.1f ms;' % (t / 1e3), '; '.join('%s %.1f ms' % (r['name'][:48], r['self_us'] / 1e3) for r in d['top'][:6]))"
done
gpu_cleanup

# 3. cost, 8B, off and on
cost 80 45 $S8 "$N8" "$KW8" cost-8b --modes off,on
say "cost $S8 rc=$?"; summ "$OUT_DIR/cost-8b.log"
gpu_cleanup

# 4. the mode's variants on 0.6B (baseline: step 2's off run, same machine a minute earlier)
cost 70 35 $S06 "$N06" "$KW06" cost-0.6b-variants --modes on:gemm=triton,on:attn=per_query
say "variants rc=$?"; grep -h '^{' "$OUT_DIR/cost-0.6b-variants.log" | cut -c1-220 | sed 's/^/    /'
gpu_cleanup

# 5. GEMM probe with vLLM's workspace variables (a fresh process: cuBLAS reads them at its start)
if [ "$(left)" -gt 11 ]; then
  CUBLASLT_WORKSPACE_SIZE=1 CUBLAS_WORKSPACE_CONFIG=:16:8 bounded 30 $PY benchmarks/batch_invariant.py \
      probe --device $DEV > "$OUT_DIR/probe-ws.log" 2>&1
  say "probe (workspace 1 KiB) rc=$?"; grep -v "rows differ from M=1 at M in \[\]" "$OUT_DIR/probe-ws.log" | tail -n 20
fi
gpu_cleanup
say "done"
exit 0
