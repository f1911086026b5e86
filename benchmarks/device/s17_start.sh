#!/usr/bin/env bash
# Session 17, issue 37 (start17; budget $BUDGET, 120 s by default): `rlserve serve` of the dummy Qwen3-8B shape
# (tiny tokenizer, --max-model-len 2056), process start -> ready (benchmarks/startup_stop.py --show-start-log
# --greedy-tokens 16: also the first request's seconds), with the start-up phase log ("start-up: ... took X s"
# lines of the API and engine-core processes, rlserve/startup_log.py). Target: <= 15 s (session 16: 19.94 s cold).
# In this order (the budget may be cut: each step takes what is left, the later ones are skipped):
#   C_new) cold Triton cache (a fresh TRITON_CACHE_DIR, RLSERVE_TRITON_PRECOMPILE=1), this tree
#   W) warm: C_new's cache (the kernels' sources are the same in both trees), interleaved in one startup_stop.py
#      call: this tree, baseline, this tree, baseline (as many as finish; 35 s kept for C_base at >= 100 s budget)
#   C_base) cold, the baseline (its own fresh cache), if 35 s are left
# The baseline is this tree with session 17's start-up patch taken out again (s17_start_base.patch, applied in
# reverse to a copy in /tmp; `git apply -R`, else `patch -R`); where that fails, this tree alone.
# Every run's log: $OUT_DIR/serve_{C_base,C_new,W}.log; summary.txt: ready, first request, the phase lines.
# DRY_RUN=1: the tests' tiny Llama on the CPU (every step once).
NAME=s17_start BUDGET=${BUDGET:-120}; source "$(dirname "$0")/lib.sh"
say "card: $CARD; git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
if [ "$DRY_RUN" = 1 ]; then
  SHAPE=tiny-llama; DEV=cpu; SRV=(-- --max-model-len 256 --max-num-seqs 8); NEED=(100)
else
  SHAPE=qwen3-8b; DEV=cuda; SRV=(-- --max-model-len 2056); NEED=(45)
fi
NEW=$PWD
export RLSERVE_GPU_START_OVERLAP=1  # this tree's GPU start-up overlap (default off until measured; the baseline lacks it)
base_tree "$NEW/benchmarks/device/s17_start_base.patch" /tmp/s17_start_base
TC=/tmp/s17_start_triton
rm -rf "$TC"; mkdir -p "$TC/new" "$TC/base"

serve() {  # LABEL TRITON_DIR LIMIT REPS TREE...
  local label=$1 tdir=$2 limit=$3 reps=$4 tree co=(); shift 4
  for tree in "$@"; do co+=(--checkout "$tree"); done
  if [ "$(left)" -lt 20 ]; then say "$label) skipped: $(left) s left"; return; fi
  TRITON_CACHE_DIR=$tdir RLSERVE_TRITON_PRECOMPILE=1 bounded "$limit" $PY "$NEW/benchmarks/startup_stop.py" \
    --reps "$reps" --device "$DEV" --shape "$SHAPE" --show-start-log --greedy-tokens 16 "${co[@]}" \
    --json "$OUT_DIR/serve_$label.json" "${SRV[@]}" > "$OUT_DIR/serve_$label.log" 2>&1
  say "$label) rc=$? ($limit s limit)"
  start_lines "$OUT_DIR/serve_$label.log" 200  # which tree, ready, first request; then that run's phase lines
  gpu_cleanup
}

serve C_new "$TC/new" "${NEED[0]}" 1 "$NEW"
keep=0; [ -n "$BASE" ] && [ "$BUDGET" -ge 100 ] && keep=35
if [ -n "$BASE" ]; then serve W "$TC/new" $(( $(left) - 5 - keep )) 2 "$NEW" "$BASE"
else serve W "$TC/new" $(( $(left) - 5 )) 2 "$NEW"; fi
if [ -n "$BASE" ] && [ "$(left)" -ge 35 ]; then serve C_base "$TC/base" $(( $(left) - 3 )) 1 "$BASE"
else say "C_base) skipped: $(left) s left"; fi
keep_logs
rm -rf "$TC" /tmp/s17_start_base
say done
exit 0
