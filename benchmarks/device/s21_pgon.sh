#!/usr/bin/env bash
# Session 21, PGON21 (issue 37): the piecewise prefill CUDA graphs on by default (RLSERVE_PREFILL_CUDA_GRAPHS
# unset = auto) checked on a GPU against what the default must survive. Budget 90 s by default; in this order
# (each step takes what is left, the later ones are skipped):
#   a) tests/gpu/test_prefill_graphs_gpu.py: session 20's float32 greedy = eager = HF cases, plus the default's:
#      captured at the warm-up and = HF; sleep levels 1 / 2 + wake on the real VMM arenas keep the same graphs,
#      which then serve an in-place weight load (greedy = HF of the new checkpoint); off with LoRA (reason
#      logged, nothing reserved); an fp8 KV cache off by default, forced (=1) = the eager fp8 engine (also with
#      --calculate-kv-scales). The capture's log lines ("reserved +X MiB ... against the KV sizing's Y") go to
#      the summary.
#   b) tests/gpu/test_sleep_gpu.py (Qwen3-1.7B shape, bf16, default flags: the prefill graphs now on):
#      memory released / re-acquired, greedy after wake, level-2 trainer sync (RLSERVE_GPU_REPORT: sleep.json)
#   c) with >= 40 s left: benchmarks/prefill_graph_memory.py, Qwen3-0.6B shape, default buckets: measured
#      reserved / allocated growth of the capture against the KV sizing's reservation
# DRY_RUN=1: the CPU's emulated tests (tests/test_prefill_graphs_default.py), the GPU files collected (skipped),
# the memory script on the tiny shape.
NAME=s21_pgon BUDGET=${BUDGET:-90}; source "$(dirname "$0")/lib.sh"
say "card: $CARD; git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
unset RLSERVE_PREFILL_CUDA_GRAPHS  # the default under test
export RLSERVE_GPU_REPORT=$OUT_DIR
PT=($PY -m pytest -q -rA -p no:cacheprovider)
if [ "$DRY_RUN" = 1 ]; then
  bounded "$(slot 100 20)" "${PT[@]}" tests/test_prefill_graphs_default.py > "$OUT_DIR/cpu_tests.log" 2>&1
  say "cpu tests rc=$? $(tail -n 1 "$OUT_DIR/cpu_tests.log")"
fi
bounded "$(slot 45 45)" "${PT[@]}" tests/gpu/test_prefill_graphs_gpu.py > "$OUT_DIR/prefill_graphs_gpu.log" 2>&1
say "a) prefill graph GPU tests rc=$? $(tail -n 1 "$OUT_DIR/prefill_graphs_gpu.log")"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|prefill piecewise CUDA graphs" "$OUT_DIR/prefill_graphs_gpu.log" \
  | sed -E 's/^.*(prefill piecewise CUDA graphs)/  \1/' | cut -c1-300 | sort | uniq -c | while read -r l; do say "a) $l"; done
gpu_cleanup
bounded "$(slot 60 0)" "${PT[@]}" -s tests/gpu/test_sleep_gpu.py > "$OUT_DIR/sleep_gpu.log" 2>&1
say "b) sleep GPU tests rc=$? $(tail -n 1 "$OUT_DIR/sleep_gpu.log")"
grep -E "^(PASSED|FAILED|ERROR)|prefill piecewise CUDA graphs|Error" "$OUT_DIR/sleep_gpu.log" | cut -c1-300 | sort \
  | uniq -c | while read -r l; do say "b) $l"; done
[ -f "$OUT_DIR/sleep.json" ] && say "b) sleep.json: $(tr -d '\n ' < "$OUT_DIR/sleep.json" | cut -c1-600)"
gpu_cleanup
if [ "$(left)" -ge 40 ]; then
  if [ "$DRY_RUN" = 1 ]; then P=(--device cpu --shape tiny --max-num-batched-tokens 128 --buckets auto)
  else P=(--shape qwen3-0.6b --buckets auto); fi
  bounded "$(slot 40 0)" $PY benchmarks/prefill_graph_memory.py "${P[@]}" > "$OUT_DIR/memory.log" 2>&1
  say "c) memory rc=$? $(grep -E '^\{"shape' "$OUT_DIR/memory.log")"
else
  say "c) memory skipped: $(left) s left"
fi
say done
