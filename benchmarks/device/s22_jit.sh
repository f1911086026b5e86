#!/usr/bin/env bash
# Issue 37, session 22: Triton kernels compiled after the engine is ready (budget $BUDGET, default 300 s). Session 21's
# H100 window saw ~17 kernel variants compile at the first requests after ready and, in 3 of 4 c256 stream runs, one
# prefill-kernel compile in the middle of serving (a 675-891 ms step, every stream stalled: BENCHMARKS.md H25).
# Session 22 unspecialised the per-step pointers and integers of the serving kernels and made the warm-up launch
# every constexpr variant that follows the step (rlserve/engine/worker/jit_warmup.py); not yet run on a GPU.
# Steps, each while time is left:
#   1) "new": benchmarks/jit_misses.py on this tree (Qwen3-0.6B shape, dummy bf16, the engine's CUDA defaults; bursts
#      of 1..256 requests, prompts 1..4,096 tokens, one request a step, n > 1, logprobs, seeds, stop tokens,
#      prefix hits): every JIT miss after ready, with the step it stalled
#   2) "base": the same tool (half the requests) on main at 4494894 (session 22's start: base_4494894.patch, the
#      diff of rlserve/ to main at session 23's end, reversed; it also lacks session 22-23's other rlserve changes), same call: the before/after pair (the base run finds the new run's kernels in Triton's disk cache only where both
#      trees compile the same variant; a miss is counted whether it compiles or loads)
#   3) "mixed": step 1 with mixed_prefill_decode=true (a mixed step's decode rows are metadata views at offsets)
#   4) tests/gpu/test_jit_misses_gpu.py (zero misses after ready, default and mixed, smaller workload)
# DRY_RUN=1: tiny-llama on the CPU at scale 0.05 (nothing compiles there: it checks the steps) and the CPU key test
# (tests/test_jit_keys_triton.py, Triton's interpreter) instead of the GPU test.
#
#   OUT_DIR=/tmp/x bash benchmarks/device/s22_jit.sh
#   DRY_RUN=1 BUDGET=200 OUT_DIR=/tmp/x bash benchmarks/device/s22_jit.sh
# Results: $OUT_DIR/jit_{new,base,mixed}.{json,log} ([jit] lines: each miss as it happened; [stall]: each step that
# had one, its wall time), test_gpu.log; summary on stdout and summary.txt.
NAME=s22_jit BUDGET=${BUDGET:-300}; source "$(dirname "$0")/lib.sh"
say "card: $CARD (BUDGET $BUDGET s); git $(git rev-parse --short HEAD 2>/dev/null); host load $(cut -d' ' -f1-3 /proc/loadavg)"
NEW=$PWD
base_tree "$NEW/benchmarks/device/base_4494894.patch" /tmp/s22_jit_base
if [ "$DRY_RUN" = 1 ]; then
  J=(--shape tiny-llama --device cpu --dtype float32 --max-model-len 512 --max-num-seqs 16 --scale 0.05); HALF=0.03
else
  J=(--shape qwen3-0.6b --max-model-len 4160 --max-num-seqs 256); HALF=0.5
fi
# one tool run: NAME, time cap, seconds to keep for the steps after it, tree, extra tool flags
jit_run() {
  local n=$1 cap=$2 keep=$3 tree=$4
  shift 4
  [ "$DRY_RUN" != 1 ] && gpu_cleanup
  (cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH:-}" bounded "$(slot "$cap" "$keep")" \
     $PY benchmarks/jit_misses.py "${J[@]}" "$@" --json "$OUT_DIR/jit_$n.json") > "$OUT_DIR/jit_$n.log" 2>&1
  say "$n rc=$?: $(grep -E '^(ready in|compiles after ready)' "$OUT_DIR/jit_$n.log" | tr '\n' ' ' | cut -c1-700)"
  grep -E '^\[(jit|stall)\]' "$OUT_DIR/jit_$n.log" | cut -c1-300 | head -30 | while read -r l; do say "  $l"; done
}
jit_run new 110 150 "$NEW"
# (half the requests of step 1 in steps 2 and 3; the bursts keep their sizes)
if [ -n "$BASE" ] && [ "$(left)" -ge 60 ]; then jit_run base 80 80 "$BASE" --scale $HALF; else say "base skipped: $(left) s left"; fi
if [ "$(left)" -ge 50 ]; then jit_run mixed 70 40 "$NEW" --scale $HALF --engine-arg mixed_prefill_decode=true
else say "mixed skipped: $(left) s left"; fi
if [ "$(left)" -ge 25 ]; then
  if [ "$DRY_RUN" = 1 ]; then T=(tests/test_jit_keys_triton.py -k "decode or qkv"); else gpu_cleanup; T=(tests/gpu/test_jit_misses_gpu.py); fi
  bounded "$(( $(left) - 5 ))" $PY -m pytest -q -p no:cacheprovider -rs "${T[@]}" > "$OUT_DIR/test_gpu.log" 2>&1
  say "test rc=$?: $(tail -1 "$OUT_DIR/test_gpu.log")"
  grep -E '^(E |\[jit\])' "$OUT_DIR/test_gpu.log" | cut -c1-300 | head -20 | while read -r l; do say "  $l"; done
fi
[ "$DRY_RUN" != 1 ] && gpu_cleanup
say done
exit 0
