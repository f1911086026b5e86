#!/usr/bin/env bash
# Issue 37, fp8 KV cache (--kv-cache-dtype fp8) at its HBM floor and against vLLM 0.24.0's fp8 KV (session 17), one
# GPU, $BUDGET seconds (200 asked; the steps adapt to less), most important first:
#   a) benchmarks/kv_fp8_kernels.py: one Qwen3-0.6B attention layer, batch 256 at a long context (4096 tokens on a
#      card of >= 130 GiB, else 2048), CUDA-graph replays: the bf16 cache, then the fp8 cache as the kernel before
#      session 17 reads it (FP8_OPERAND bf16, still the default) and as the new path (asm: float16 operands, V
#      converted by inline asm before shared memory, 128-token tiles), then other modes / tiles, against the K/V
#      bytes' floor; each row printed as it comes (a cut run keeps the first rows); with >= 120 s also prefill.
#   b) tests/gpu/test_gpu_kv_fp8.py but its engine test (float32 model: float32 queries keep the float32 dots,
#      nothing it runs changed): writer bytes, every fp8 byte through each operand path, decode / prefill on fp8
#      vs the float64 reference under the f16 and asm modes.
#   c) benchmarks/decode_step.py, the whole batch-256 decode step (graph-replayed forward) on the fp8 cache with
#      --fp8-operand asm:128, against its floor; with a budget under 180 s (K2 with vLLM out of reach) then the
#      same with the default operands (the old kernel), else that one comes in e).
#   d) with >= 135 s left: benchmarks/throughput.py K2 (Qwen3-0.6B shape, 256 seqs, prompts and outputs 768..1280
#      tokens) --kv-cache-dtype fp8: rlserve (asm:128), then vLLM 0.24.0 (/tmp/vsite; its cold start took 68 s on
#      2026-12-06), each its own process; with 40..135 s left rlserve alone.
#   e) with the time left, each in turn: decode_step fp8 with the default operands (the old kernel), decode_step
#      with the bf16 cache (s13 / s14: 1.07-1.10x its floor).
# DRY_RUN=1: every Python step once on the CPU at tiny shapes (the kernels in Triton's interpreter; vLLM only
# when VLLM_PYTHONPATH names a CPU vLLM's site dir).
NAME=s17_fp8kv BUDGET=${BUDGET:-200}; source "$(dirname "$0")/lib.sh"
say "card: $CARD; git $(git rev-parse --short HEAD 2>/dev/null || echo '?'); budget $BUDGET s"
NEW=asm:128
if [ "$DRY_RUN" = 1 ]; then
  KK_ARGS=(--device cpu --batch 3 --context 40 --configs bf16:16:4:0,asm:32:4:0 --prefill-prompts 1
           --prefill-len 16 --iters 1)
  DS_ARGS=(--device cpu --shape tiny-llama --batch 4 --context 64 --iters 2)
  KK_ENV=(env TRITON_INTERPRET=1)
  KCAP=150 DCAP=90 TCAP=60  # the interpreter and a loaded CPU
else
  CTX=2048; [ "$MEM_MIB" -ge 133120 ] && CTX=4096
  KK_ARGS=(--batch 256 --context "$CTX" --iters 20)
  [ "$BUDGET" -lt 120 ] && KK_ARGS+=(--configs bf16:64:4:0,asm:128:4:0,f16:64:4:0,asm:64:4:0 --prefill-prompts 0)
  DS_ARGS=(--shape qwen3-0.6b --batch 256 --context "$CTX" --iters 10)
  KK_ENV=(env)
  KCAP=28 DCAP=22 TCAP=25; [ "$BUDGET" -lt 120 ] && KCAP=20
fi

# ---- a) kernels: bf16 cache, fp8 old vs new operand paths and tiles
t=$(slot "$KCAP" 37)
timeout -k 5 "$t" "${KK_ENV[@]}" $PY benchmarks/kv_fp8_kernels.py "${KK_ARGS[@]}" --json "$OUT_DIR/kv_fp8_kernels.json" \
  > "$OUT_DIR/kv_fp8_kernels.log" 2>&1
say "a) kv_fp8_kernels rc=$? ($t s limit)"
grep -E '^(decode|prefill) ' "$OUT_DIR/kv_fp8_kernels.log" | sed 's/^/a) /' | tee -a "$OUT_DIR/summary.txt"

# ---- b) GPU tests (skipped on CPU: the dry run checks they collect)
t=$(slot "$TCAP" 15)
RLSERVE_GPU_REPORT="$OUT_DIR/gpu_report" timeout -k 5 "$t" $PY -m pytest -v -p no:cacheprovider -rfEs \
  tests/gpu/test_gpu_kv_fp8.py -k "not engine" > "$OUT_DIR/tests_kv_fp8_gpu.log" 2>&1
say "b) tests rc=$? ($t s limit): $(tail -1 "$OUT_DIR/tests_kv_fp8_gpu.log")"
grep -E '^(FAILED|ERROR)' "$OUT_DIR/tests_kv_fp8_gpu.log" | head -8 | sed 's/^/b) /' | tee -a "$OUT_DIR/summary.txt"

# ---- c) the whole decode step, fp8 cache, new operands
decode_step() {  # TAG LABEL ARGS...: one decode_step.py process, its log decode_step_LABEL.log
  local tag=$1 label=$2 t; shift 2
  t=$(slot "$DCAP" 0)
  timeout -k 5 "$t" $PY benchmarks/decode_step.py "${DS_ARGS[@]}" "$@" \
    --json "$OUT_DIR/decode_step_$label.json" > "$OUT_DIR/decode_step_$label.log" 2>&1
  say "$tag) decode_step $label ($*) rc=$? ($t s limit)"
}
decode_step c fp8new --kv-cache-dtype fp8 --fp8-operand "$NEW"
OLD_DONE=0
if [ "$BUDGET" -lt 180 ] && { [ "$(left)" -ge 18 ] || [ "$DRY_RUN" = 1 ]; }; then  # K2 with vLLM is out of reach
  decode_step c fp8old --kv-cache-dtype fp8; OLD_DONE=1
fi
$PY benchmarks/device/decode_step_summary.py "$OUT_DIR" "c)" fp8new fp8old 2>&1 | tee -a "$OUT_DIR/summary.txt"

# ---- d) offline workload K2, --kv-cache-dtype fp8: rlserve (new operands), then vLLM
k2_args
if [ "$(left)" -ge 135 ] || [ "$DRY_RUN" = 1 ]; then
  throughput_pair d 35 100 130 0 --shape "$SHAPE" "${TP_ARGS[@]}" --kv-cache-dtype fp8 --fp8-operand "$NEW" \
    --vllm "${VLLM_ARGS[@]}"
elif [ "$(left)" -ge 40 ]; then
  t=$(slot 35 0)
  timeout -k 5 "$t" $PY benchmarks/throughput.py --engine rlserve --no-hf --shape "$SHAPE" "${TP_ARGS[@]}" \
    --kv-cache-dtype fp8 --fp8-operand "$NEW" --json "$OUT_DIR/throughput_rlserve.json" > "$OUT_DIR/throughput_rlserve.log" 2>&1
  say "d) rlserve alone rc=$? ($t s limit): $(grep -E '^  rlserve ' "$OUT_DIR/throughput_rlserve.log" | tr -s ' ')"
else
  say "d) K2 skipped: $(left) s left"
fi
gpu_cleanup

# ---- e) with what is left: the old kernel's whole step, the bf16 cache's
for run in "fp8old --kv-cache-dtype fp8" "auto --kv-cache-dtype auto"; do
  [ "${run%% *}" = fp8old ] && [ "$OLD_DONE" = 1 ] && continue
  if [ "$(left)" -ge 18 ] || [ "$DRY_RUN" = 1 ]; then
    decode_step e $run
  else
    say "e) decode_step ${run%% *} skipped: $(left) s left"
  fi
done
$PY benchmarks/device/decode_step_summary.py "$OUT_DIR" "e)" fp8new fp8old auto 2>&1 | tee -a "$OUT_DIR/summary.txt"
say "done"
exit 0
