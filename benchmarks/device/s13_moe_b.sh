#!/usr/bin/env bash
# Issue 35, second short call (budget 120 s), after s13_moe.sh (rlserve 0.80x vLLM offline on the
# 48-layer Qwen3-30B-A3B shape, H100, with a KV cache of 121,216 tokens against vLLM's 147,776):
#   a) rlserve alone, the same workload, gpu_memory_utilization 0.93 (about vLLM's KV tokens at
#      0.9): how much of the gap the smaller KV cache explains; and where the KV budget went
#      (throughput.py's memory_at_kv_sizing: in use / PyTorch allocated / reserved at sizing time).
#   b) with what is left: the GPU test the first call's timeout cut
#      (test_nccl_expert_sync_greedy_equals_trainer[gloo-cuda-fused]).
# DRY_RUN=1: the same steps on the CPU with a tiny MoE shape.
NAME=s13_moe_b BUDGET=${BUDGET:-120}; source "$(dirname "$0")/lib.sh"
if [ "$DRY_RUN" = 1 ]; then
  ARGS=(--shape small-qwen3-moe --device cpu --num-seqs 4 --min-len 8 --max-len 16 --max-num-seqs 4)
else
  ARGS=(--shape qwen3-30b-a3b --device cuda --gpu-memory-utilization 0.93)
fi
say "card: $CARD"
bounded 85 $PY benchmarks/throughput.py --engine rlserve --no-hf "${ARGS[@]}" \
  --json "$OUT_DIR/throughput_rlserve_093.json" > "$OUT_DIR/throughput_rlserve_093.log" 2>&1
say "a) rlserve rc=$?: $(grep -E '^  rlserve ' "$OUT_DIR/throughput_rlserve_093.log" | tr -s ' ')"
say "a) $(grep -E '^rlserve KV sizing' "$OUT_DIR/throughput_rlserve_093.log")"
t=$(( $(left) - 3 ))
if [ "$t" -gt 15 ]; then
  timeout -k 3 "$t" $PY -m pytest -v -p no:cacheprovider -rfEs \
    "tests/gpu/test_moe_gpu.py::test_nccl_expert_sync_greedy_equals_trainer" -k "gloo-cuda-fused" \
    > "$OUT_DIR/tests_nccl_fused.log" 2>&1
  say "b) test rc=$? ($t s limit): $(tail -1 "$OUT_DIR/tests_nccl_fused.log")"
fi
say "done"
exit 0
