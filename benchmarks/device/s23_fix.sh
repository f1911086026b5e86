#!/usr/bin/env bash
# Session 23, FIX23 item 1: the weight sync's copy + checksum Triton kernel (rlserve/transfer/multi_tensor_kernel.py)
# is compiled by the engine's start-up warm-up (jit_warmup.warm_weight_sync, recorded and compiled in parallel by
# the precompile) instead of at the receiver's connect; not yet run on a GPU (budget $BUDGET, default 180 s).
# Steps, each while time is left:
#   1) tests/gpu/test_jit_misses_gpu.py::test_weight_sync_kernel_needs_no_compile_after_ready (an LLM on the GPU,
#      then the four kernel variants over its parameters: no Triton JIT miss after ready; sums equal)
#   2) tests/gpu/test_transfer_gpu.py -k "ipc_sync_equal_checksums" (the real IPC sync through a served engine)
# DRY_RUN=1: the CPU checks instead (Triton's interpreter key test, the precompile test), run on the CPU.
#
#   OUT_DIR=/tmp/x bash benchmarks/device/s23_fix.sh
#   DRY_RUN=1 OUT_DIR=/tmp/x bash benchmarks/device/s23_fix.sh
# Results: $OUT_DIR/test_warm.log, test_ipc.log; summary on stdout and summary.txt.
NAME=s23_fix BUDGET=${BUDGET:-180}; source "$(dirname "$0")/lib.sh"
say "card: $CARD (BUDGET $BUDGET s); git $(git rev-parse --short HEAD 2>/dev/null); host load $(cut -d' ' -f1-3 /proc/loadavg)"
if [ "$DRY_RUN" = 1 ]; then
  T1=(tests/test_jit_keys_triton.py -k weight_update)
  T2=(tests/test_triton_precompile.py -k weight_sync)
else
  T1=(tests/gpu/test_jit_misses_gpu.py -k weight_sync_kernel)
  T2=(tests/gpu/test_transfer_gpu.py -k ipc_sync_equal_checksums)
fi
bounded "$(slot 70 40)" $PY -m pytest -q -p no:cacheprovider -rs "${T1[@]}" > "$OUT_DIR/test_warm.log" 2>&1
say "warm rc=$?: $(tail -1 "$OUT_DIR/test_warm.log")"
grep -E '^E ' "$OUT_DIR/test_warm.log" | cut -c1-300 | head -20 | while read -r l; do say "  $l"; done
if [ "$(left)" -ge 30 ]; then
  [ "$DRY_RUN" != 1 ] && gpu_cleanup
  bounded "$(( $(left) - 5 ))" $PY -m pytest -q -p no:cacheprovider -rs "${T2[@]}" > "$OUT_DIR/test_ipc.log" 2>&1
  say "ipc rc=$?: $(tail -1 "$OUT_DIR/test_ipc.log")"
  grep -E '^E ' "$OUT_DIR/test_ipc.log" | cut -c1-300 | head -20 | while read -r l; do say "  $l"; done
else
  say "ipc skipped: $(left) s left"
fi
[ "$DRY_RUN" != 1 ] && gpu_cleanup
say done
exit 0
