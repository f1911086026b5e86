#!/usr/bin/env bash
# Session 21, adv21 (adversarial pass), budget $BUDGET (60 s): the piecewise prefill CUDA graphs
# (RLSERVE_PREFILL_CUDA_GRAPHS; on by default on CUDA since session 21) captured on the GPU, across what can invalidate what they bake
# in: a weight update between two chunks of a prompt, an abort mid-chunk, sleep level 1 and level 2 (CUDA
# virtual memory) + wake + reload, then a prefix hit; every answer = HF float32 greedy of the weights loaded
# then and = the eager-prefill engine through the same schedule (tests/gpu/test_prefill_graphs_gpu.py::
# test_prefill_graphs_follow_updates_aborts_and_sleep; the CPU emulation of it passes). Then, with what is
# left, the file's other tests (whole prompts, chunks, mixed steps: they passed in session 21's first window).
# Before those (>= 15 s left): benchmarks/prompt_logprobs_memory.py: the peak memory and time of one step's prompt-logprob
# scoring, 8192 bf16 rows of Qwen3's 151,936-token vocabulary, in 256 MiB blocks (session 21) vs all rows at once.
# DRY_RUN=1: the CPU test (emulated pieces) instead, and the scoring at 512 x 32000 float32 on the CPU.
NAME=s21_adv21 BUDGET=${BUDGET:-60}; source "$(dirname "$0")/lib.sh"
say "card: $CARD; git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
unset RLSERVE_PREFILL_CUDA_GRAPHS
if [ "$DRY_RUN" = 1 ]; then
  T=(tests/test_prefill_graphs.py::test_updates_aborts_and_sleep)
else
  gpu_cleanup
  T=(tests/gpu/test_prefill_graphs_gpu.py::test_prefill_graphs_follow_updates_aborts_and_sleep)
fi
bounded "$(slot 50 5)" $PY -m pytest -q -x -p no:cacheprovider -rs "${T[@]}" > "$OUT_DIR/test_combo.log" 2>&1
say "combo rc=$?: $(tail -1 "$OUT_DIR/test_combo.log")"
grep -E "^E |Error" "$OUT_DIR/test_combo.log" | head -12 | while read -r l; do say "  $l"; done
if [ "$(left)" -ge 15 ]; then
  if [ "$DRY_RUN" = 1 ]; then M=(--device cpu --rows 512 --vocab 32000 --dtype float32); else M=(--rows 8192); fi
  bounded "$(slot 25 3)" $PY benchmarks/prompt_logprobs_memory.py "${M[@]}" > "$OUT_DIR/plp_memory.log" 2>&1
  say "prompt-logprob scoring rc=$?: $(grep -E '^\{' "$OUT_DIR/plp_memory.log" | tr '\n' ' ')"
fi
if [ "$DRY_RUN" != 1 ] && [ "$(left)" -ge 25 ]; then
  gpu_cleanup
  bounded "$(( $(left) - 5 ))" $PY -m pytest -q -p no:cacheprovider -rs tests/gpu/test_prefill_graphs_gpu.py \
    --deselect tests/gpu/test_prefill_graphs_gpu.py::test_prefill_graphs_follow_updates_aborts_and_sleep \
    > "$OUT_DIR/test_rest.log" 2>&1
  say "rest rc=$?: $(tail -1 "$OUT_DIR/test_rest.log")"
fi
gpu_cleanup
say done
