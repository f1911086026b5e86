#!/usr/bin/env bash
# Issue 37, fp8 KV cache (--kv-cache-dtype fp8) at its HBM floor and against vLLM 0.24.0's fp8 KV, on one GPU
# inside a 200 s budget (session 17), most important first:
#   a) benchmarks/kv_fp8_kernels.py: one Qwen3-0.6B attention layer, batch 256 at a long context (4096 tokens on
#      a card of >= 130 GiB, else 2048), CUDA-graph replays: the bf16 cache, then the fp8 cache under each way
#      the kernel turns a byte into a dot operand (FP8_OPERAND bf16 = the kernel of sessions 13-16, f16 = cast to
#      float16, asm = the new default: V converted by inline asm before shared memory) x tiles (kv_fp8_kernels.py's
#      --configs default, the default config first), against the K/V bytes' floor; then prefill of 8 x 1024-token
#      prompts per mode.
#      Then benchmarks/decode_step.py, the whole decode step (graph-replayed forward) at the same batch and
#      context with the fp8 cache (the default operands); its bf16-cache twin comes in d) (s13 / s14 measured it:
#      1.07-1.10x its floor), so that vLLM's ~105 s fit (s13: 68 s start-up + 13 s run + imports).
#   b) tests/gpu/test_gpu_kv_fp8.py but its engine test (float32 model: float32 queries keep the float32 dots,
#      nothing it runs changed; 15 s): writer bytes, every e4m3 byte through each operand path, decode /
#      prefill on fp8 vs the float64 reference under the f16 and asm modes.
#   c) benchmarks/throughput.py K2 (Qwen3-0.6B shape, 256 seqs, prompts and outputs 768..1280 tokens)
#      --kv-cache-dtype fp8: rlserve, then vLLM 0.24.0 (/tmp/vsite; its cold start took 68 s on 2026-12-06),
#      each its own process; the rest of the budget is vLLM's.
#   d) only with the time left, each in turn: decode_step with the bf16 cache, decode_step fp8 with
#      --fp8-operand bf16 (the old kernel, the whole step), benchmarks/kv_fp8_error.py (logprobs of the same
#      tokens, fp8 vs bf16 cache, K3 of BENCHMARKS.md).
# DRY_RUN=1: every Python step once on the CPU at tiny shapes (the kernels in Triton's interpreter; vLLM only
# when VLLM_PYTHONPATH names a CPU vLLM's site dir).
NAME=s17_fp8kv BUDGET=${BUDGET:-200}; source "$(dirname "$0")/lib.sh"
say "card: $CARD; git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"

# ---- a) kernels: bf16 cache vs fp8 operand modes x tiles, then the whole decode step per KV dtype
if [ "$DRY_RUN" = 1 ]; then
  KK_ARGS=(--device cpu --batch 3 --context 40 --configs bf16:16:4:0,asm:32:4:0,f16:32:4:1 --prefill-prompts 2
           --prefill-len 20 --iters 1)
  DS_ARGS=(--device cpu --shape tiny-llama --batch 4 --context 64 --iters 2)
  KK_ENV=(env TRITON_INTERPRET=1)
  KCAP=150 DCAP=90 ECAP=120  # the interpreter and a loaded CPU
else
  KCAP=28 DCAP=22 ECAP=40  # kv_fp8_kernels prints each row as it goes: a cut run keeps the first
  CTX=2048; [ "$MEM_MIB" -ge 133120 ] && CTX=4096
  KK_ARGS=(--batch 256 --context "$CTX" --iters 20)
  DS_ARGS=(--shape qwen3-0.6b --batch 256 --context "$CTX" --iters 10)
  KK_ENV=(env)
fi
t=$(slot "$KCAP" 164)
timeout -k 5 "$t" "${KK_ENV[@]}" $PY benchmarks/kv_fp8_kernels.py "${KK_ARGS[@]}" --json "$OUT_DIR/kv_fp8_kernels.json" \
  > "$OUT_DIR/kv_fp8_kernels.log" 2>&1
say "a) kv_fp8_kernels rc=$? ($t s limit)"
grep -E '^(decode|prefill) ' "$OUT_DIR/kv_fp8_kernels.log" | sed 's/^/a) /' | tee -a "$OUT_DIR/summary.txt"
decode_step() {  # TAG LABEL ARGS...: one decode_step.py process, its log decode_step_LABEL.log
  local tag=$1 label=$2 t; shift 2
  t=$(slot "$DCAP" "$KEEP")
  timeout -k 5 "$t" $PY benchmarks/decode_step.py "${DS_ARGS[@]}" "$@" \
    --json "$OUT_DIR/decode_step_$label.json" > "$OUT_DIR/decode_step_$label.log" 2>&1
  say "$tag) decode_step $label ($*) rc=$? ($t s limit)"
}
KEEP=150 decode_step a fp8 --kv-cache-dtype fp8
$PY benchmarks/device/decode_step_summary.py "$OUT_DIR" "a)" fp8 2>&1 | tee -a "$OUT_DIR/summary.txt"

# ---- b) GPU tests (skipped on CPU: the dry run checks they collect)
t=$(slot 25 135)
RLSERVE_GPU_REPORT="$OUT_DIR/gpu_report" timeout -k 5 "$t" $PY -m pytest -v -p no:cacheprovider -rfEs \
  tests/gpu/test_gpu_kv_fp8.py -k "not engine" > "$OUT_DIR/tests_kv_fp8_gpu.log" 2>&1
say "b) tests rc=$? ($t s limit): $(tail -1 "$OUT_DIR/tests_kv_fp8_gpu.log")"
grep -E '^(FAILED|ERROR)' "$OUT_DIR/tests_kv_fp8_gpu.log" | head -8 | sed 's/^/b) /' | tee -a "$OUT_DIR/summary.txt"

# ---- c) offline workload K2, --kv-cache-dtype fp8: rlserve, then vLLM
k2_args
throughput_pair c 35 108 130 0 --shape "$SHAPE" "${TP_ARGS[@]}" --kv-cache-dtype fp8 --vllm "${VLLM_ARGS[@]}"
gpu_cleanup

# ---- d) with what is left: the old kernel's whole step, then the error against the bf16 cache
for run in "auto --kv-cache-dtype auto" "fp8old --kv-cache-dtype fp8 --fp8-operand bf16"; do
  if [ "$(left)" -ge 18 ] || [ "$DRY_RUN" = 1 ]; then
    KEEP=0 decode_step d $run
  else
    say "d) decode_step ${run%% *} skipped: $(left) s left"
  fi
done
$PY benchmarks/device/decode_step_summary.py "$OUT_DIR" "d)" auto fp8 fp8old 2>&1 | tee -a "$OUT_DIR/summary.txt"
if [ "$(left)" -ge 20 ] || [ "$DRY_RUN" = 1 ]; then
  kv_fp8_error d "$ECAP"
else
  say "d) error skipped: $(left) s left"
fi
say "done"
exit 0
