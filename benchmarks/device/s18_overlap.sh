#!/usr/bin/env bash
# Session 18, issue 37 (overlap18): the overlapped loop launches the decode step after a prefill step before the
# prefill's tokens are read (rlserve/engine/core/overlap.py; RLSERVE_OVERLAP_AFTER_PREFILL, default off; 1: the new rule, 0: the
# session-17 rule, where that decode step waited for the read). Budget 120 s, most important first:
#   a) the offline Qwen3-0.6B workload (BENCHMARKS "Offline workload vs its own HBM floor": 256 sequences, prompts
#      and outputs 100..1024) with --floor --step-trace, old rule (RLSERVE_OVERLAP_AFTER_PREFILL=0) then new, each
#      its own process: tok/s, time / HBM floor, the launches before / after the read (overlap_counts)
#   b) the step traces' windows around prefill steps (benchmarks/device/prefill_gaps.py): prefill launch -> decode
#      launch, prefill + decode window, old vs new (the same batches under both rules: the window sums' difference is
#      the time saved)
#   c) tests/gpu/test_overlap_gpu.py (float32 greedy tokens: overlapped = plain loop with CUDA graphs; the decode step
#      after a prefill launched early, split and mixed steps: = the old rule = the plain loop)
#   d) with 50 s left (a warm Triton cache: ~21 s a run on an H100), a second pair, new then old (the order's
#      bias), and its windows
# DRY_RUN=1: the same on the CPU, tiny shape, overlap forced on (RLSERVE_ASYNC_SCHEDULING=1), c) the CPU tests.
NAME=${NAME:-s18_overlap} BUDGET=${BUDGET:-120}; source "$(dirname "$0")/lib.sh"
say "card: $CARD; git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
# AB_VAR / AB_TESTS: another 0/1 switch and its GPU tests through the same runs (session 20's s20_pgoffline.sh)
AB_VAR=${AB_VAR:-RLSERVE_OVERLAP_AFTER_PREFILL}
unset "$AB_VAR"
if [ "$DRY_RUN" = 1 ]; then
  export RLSERVE_ASYNC_SCHEDULING=1
  TP=(--shape tiny-llama --device cpu --num-seqs 12 --min-len 8 --max-len 24 --max-num-seqs 4)  # prompts wait: prefills while others decode
  TESTS=(tests/test_overlap_after_prefill.py -k "split")
  CAP=60; KEEP=20
else
  TP=(--shape qwen3-0.6b --device cuda)
  TESTS=(${AB_TESTS:-tests/gpu/test_overlap_gpu.py})
  CAP=50; KEEP=25  # a cold Triton cache makes the first start slow: the old rule runs first
fi
run_one() {  # TAG RULE(0/1): one throughput.py run, its summary line
  local tag=$1 rule=$2 t
  t=$(slot "$CAP" "$KEEP")
  env "$AB_VAR=$rule" timeout -k 5 "$t" $PY benchmarks/throughput.py --engine rlserve --no-hf \
    "${TP[@]}" --floor --step-trace "$OUT_DIR/steps_$tag.jsonl" --json "$OUT_DIR/throughput_$tag.json" \
    > "$OUT_DIR/throughput_$tag.log" 2>&1
  say "a) $tag ($AB_VAR=$rule) rc=$? ($t s limit)"
  $PY - "$OUT_DIR/throughput_$tag.json" "$tag" <<'PYEOF' 2>&1 | tee -a "$OUT_DIR/summary.txt"
import json, sys
try:
    r = json.load(open(sys.argv[1]))["results"][0]
except (OSError, ValueError, KeyError, IndexError) as e:
    sys.exit(f"a) {sys.argv[2]}: no result ({type(e).__name__})")
f = r.get("floor", {})
print(f"a) {sys.argv[2]}: {r['tokens_per_s']:.1f} tok/s ({r['seconds']:.3f} s, {r['output_tokens']} tokens), "
      f"startup {r.get('startup_s', 0):.1f} s; time / HBM floor {f.get('x_floor', 0):.3f}x "
      f"(floor {f.get('floor_s', 0):.3f} s), / serial floor {f.get('x_serial_floor', 0):.3f}x; "
      f"steps P {f.get('prefill_steps')} D {f.get('decode_steps')}; launches {r.get('overlap_counts')}")
PYEOF
  grep -E '^serial floor|^  steps ' "$OUT_DIR/throughput_$tag.log" | sed "s/^/a) $tag /" | tee -a "$OUT_DIR/summary.txt"
  gpu_cleanup
}
gaps() {  # LABEL=TRACE ...: b)'s lines
  $PY benchmarks/device/prefill_gaps.py "$@" 2>&1 | sed 's/^/b) /' | tee -a "$OUT_DIR/summary.txt"
}
run_one old 0
run_one new 1
gaps "old=$OUT_DIR/steps_old.jsonl" "new=$OUT_DIR/steps_new.jsonl"
t=45; [ "$DRY_RUN" = 1 ] && t=60
bounded "$t" $PY -m pytest -q -p no:cacheprovider "${TESTS[@]}" > "$OUT_DIR/pytest_overlap.log" 2>&1
say "c) tests rc=$? $(tail -1 "$OUT_DIR/pytest_overlap.log")"
grep -E "^(FAILED|ERROR)" "$OUT_DIR/pytest_overlap.log" | head -5 | while read -r l; do say "c) $l"; done
gpu_cleanup
if [ "$(left)" -ge 50 ]; then  # ~21 s a run on an H100 with a warm Triton cache (s15's window: the same workload)
  CAP=$(( $(left) / 2 )); KEEP=$(( $(left) / 2 ))
  run_one new2 1
  KEEP=3
  run_one old2 0
  gaps "old2=$OUT_DIR/steps_old2.jsonl" "new2=$OUT_DIR/steps_new2.jsonl"
else
  say "d) skipped: $(left) s left"
fi
say done
exit 0
