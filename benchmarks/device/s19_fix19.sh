#!/usr/bin/env bash
# Session 19, fix19 item 9: what the piecewise prefill CUDA graphs (RLSERVE_PREFILL_CUDA_GRAPHS, off by default)
# hold on the device once captured, against the KV sizing's reservation for them
# (rlserve.engine.worker.prefill_graphs.reserve_bytes: an upper bound from the tensors, 494 MiB for Qwen3-0.6B bf16,
# buckets 256..8192). benchmarks/prefill_graph_memory.py, Qwen3-0.6B shape (random bf16 weights), buckets 1
# (256..8192) then 256,2048: reserve_mib vs the growth of memory_reserved / memory_allocated across the capture.
# Budget 60 s. DRY_RUN=1: the tiny shape on the CPU (emulated pieces: the estimate only).
NAME=s19_fix19 BUDGET=${BUDGET:-60}; source "$(dirname "$0")/lib.sh"
say "card: $CARD; git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
unset RLSERVE_PREFILL_CUDA_GRAPHS
if [ "$DRY_RUN" = 1 ]; then
  P=(--device cpu --shape tiny --max-num-batched-tokens 128)
  BUCKETS=(32,64,128 64)
else
  P=(--shape qwen3-0.6b)
  BUCKETS=(1 256,2048)
fi
for b in "${BUCKETS[@]}"; do
  bounded "$(slot 40 5)" $PY benchmarks/prefill_graph_memory.py "${P[@]}" --buckets "$b" \
    > "$OUT_DIR/memory_$b.log" 2>&1
  say "buckets $b: rc=$? $(grep -E '^\{"shape' "$OUT_DIR/memory_$b.log")"
  grep -E "Error|error" "$OUT_DIR/memory_$b.log" | grep -v USDT | tail -3 | while read -r l; do say "  $l"; done
  gpu_cleanup
done
say done
