#!/usr/bin/env bash
# Issue 37, fp8 KV cache (--kv-cache-dtype fp8), on one GPU inside a 200 s budget, most important first:
#   a) benchmarks/decode_step.py, Qwen3-0.6B shape (dummy bf16), one batch-256 decode step at a long
#      context (4096 tokens on a card of >= 100 GiB, else 2048): bf16 KV vs fp8 KV, each its own
#      process; graph-replayed forward time and the HBM floor (weights + K/V bytes at each dtype).
#   b) benchmarks/throughput.py --shape qwen3-0.6b, long prompts (768..1280 tokens, outputs the
#      same), --kv-cache-dtype fp8 for rlserve then vLLM 0.24.0 (/tmp/vsite), each its own process,
#      each engine's default gpu_memory_utilization (0.9); the KV tokens each got.
#   (vLLM 0.24's start-up for this shape took 68 s in the 2026-12-06 window, its run 13 s)
#   c) tests/gpu/test_gpu_kv_fp8.py (writer bytes = torch's on the hardware conversion, fused
#      write, decode/prefill on fp8 vs the float64 reference, engine graphs = eager, fp8 vs fp32),
#      with what is left (vLLM's start-up, ~85 s for this shape, takes most of the budget).
#   d) only when >= 30 s are left: benchmarks/kv_fp8_error.py, logprobs of the same tokens, fp8
#      cache vs bf16 cache (random HF-style weights, Qwen3-0.6B shape); the real-model error is
#      measured on the CPU (SmolLM2-135M-Instruct, BENCHMARKS.md).
# DRY_RUN=1: every Python step once on the CPU with tiny shapes (vLLM only when VLLM_PYTHONPATH is
# set: a CPU vLLM's site dir).
NAME=s13_fp8kv BUDGET=${BUDGET:-200}; source "$(dirname "$0")/lib.sh"
say "card: $CARD; git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"

# ---- a) batch-256 long-context decode step, bf16 vs fp8 KV
if [ "$DRY_RUN" = 1 ]; then
  DS_ARGS=(--device cpu --shape tiny-llama --batch 4 --context 64 --iters 2)
elif [ "$MEM_MIB" -ge 102400 ]; then
  DS_ARGS=(--shape qwen3-0.6b --batch 256 --context 4096 --iters 10)
else
  DS_ARGS=(--shape qwen3-0.6b --batch 256 --context 2048 --iters 10)
fi
# one process per KV dtype: an engine's 60 GB bf16 cache is not handed back within the process
# (the 2026-12-06 window's fp8 run in the same process ran out of memory on an H100)
for kv in auto fp8; do
  t=$(slot 25 150)
  timeout -k 5 "$t" $PY benchmarks/decode_step.py "${DS_ARGS[@]}" --kv-cache-dtype "$kv" \
    --json "$OUT_DIR/decode_step_$kv.json" > "$OUT_DIR/decode_step_$kv.log" 2>&1
  say "a) decode_step kv=$kv rc=$? ($t s limit)"
  grep -E '^\{"shape"' "$OUT_DIR/decode_step_$kv.log" | tee -a "$OUT_DIR/summary.txt"
done
$PY benchmarks/device/decode_step_summary.py "$OUT_DIR" "a)" auto fp8 2>&1 | tee -a "$OUT_DIR/summary.txt"

# ---- b) offline workload, long prompts, --kv-cache-dtype fp8: rlserve, then vLLM
k2_args
# rlserve: the 2026-12-06 window gave it 28 s, not enough for a cold start (Triton compiles the fp8 kernel
# variants, the graph ladder is captured) plus the run
throughput_pair b 45 110 100 15 --shape "$SHAPE" "${TP_ARGS[@]}" --kv-cache-dtype fp8 --vllm "${VLLM_ARGS[@]}"

# ---- c) GPU tests (skip on CPU: the dry run checks they collect and skip)
t=$(slot 45 0)
RLSERVE_GPU_REPORT="$OUT_DIR/gpu_report" timeout -k 5 "$t" $PY -m pytest -v -p no:cacheprovider -rfEs \
  tests/gpu/test_gpu_kv_fp8.py > "$OUT_DIR/tests_kv_fp8_gpu.log" 2>&1
say "c) tests rc=$? ($t s limit): $(tail -1 "$OUT_DIR/tests_kv_fp8_gpu.log")"

# ---- d) error against the bf16 cache: logprobs of the same tokens
if [ "$(left)" -ge 30 ] || [ "$DRY_RUN" = 1 ]; then
  kv_fp8_error d 60
else
  say "d) error skipped: $(left) s left"
fi
say "done"
exit 0
