#!/usr/bin/env bash
# Issue 35 (MoE offline speed), session 15, one GPU, budget 110 s, rlserve only (window 1 ran vLLM 0.24.0
# on the same card kind: 3,758.9 tok/s), most important first:
#   a) benchmarks/throughput.py, Qwen3-30B-A3B shape (48 layers, dummy bf16), the offline workload, on a
#      FRESH Triton cache (TRITON_CACHE_DIR an empty folder: what a new machine gets), through
#      count_compiles.py: every Triton specialization miss is logged ([jit] lines), with the warm-up's
#      log (the MoE precompile's counts, the warm-up's seconds); the summary counts the misses after
#      the warm-up (should be none from the MoE kernels). New since window 1: every fused-MoE tile class
#      compiled in the warm-up (in parallel children), the batch-sized ints unspecialized, the
#      permutation's count kernel on several programs. Tiles: vLLM's default rule (the tuned table is off
#      by default; MOE_TUNED=1 bash ... runs this step with RLSERVE_MOE_TUNED_CONFIGS=1 instead).
#   c) tests/gpu/test_moe_gpu.py (kernel tests only): the tuned configs against the float32 reference, no
#      compile after warm_up, the bf16 / float32 kernel tests, the permutation, the graph replay.
#   b) benchmarks/moe_kernels.py --tuned --triton-only: one MoE layer, vLLM's default rule against the
#      tuned table per batch (GPU us from CUDA graphs) and their largest output difference.
# DRY_RUN=1: a) with a tiny Qwen3-MoE on the CPU, b) --help only (CUDA-only benchmark), c) collection only.
NAME=s15_moespeed BUDGET=${BUDGET:-110}; source "$(dirname "$0")/lib.sh"
say "card: $CARD; git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
if [ "$DRY_RUN" = 1 ]; then
  SHAPE=small-qwen3-moe; ARGS=(--device cpu --num-seqs 4 --min-len 8 --max-len 16 --max-num-seqs 4)
else
  SHAPE=qwen3-30b-a3b; [ "$MEM_MIB" -lt 76800 ] && SHAPE=qwen3-30b-a3b-24l
  ARGS=(--device cuda)
fi
export TRITON_CACHE_DIR; TRITON_CACHE_DIR=$(mktemp -d /tmp/triton_fresh.XXXXXX)
say "a) shape $SHAPE, fresh TRITON_CACHE_DIR $TRITON_CACHE_DIR, RLSERVE_MOE_TUNED_CONFIGS=${MOE_TUNED:-0}"

# ---- a) the offline workload, fresh Triton cache
RLSERVE_MOE_TUNED_CONFIGS=${MOE_TUNED:-0} bounded "$(slot 80 27)" $PY benchmarks/device/count_compiles.py benchmarks/throughput.py --shape "$SHAPE" \
  --engine rlserve --no-hf "${ARGS[@]}" --json "$OUT_DIR/throughput_rlserve.json" > "$OUT_DIR/throughput_rlserve.log" 2>&1
say "a) rlserve rc=$?: $(grep -E '^  rlserve ' "$OUT_DIR/throughput_rlserve.log" | tr -s ' ')"
say "a) $(grep -E '^rlserve KV sizing' "$OUT_DIR/throughput_rlserve.log")"
say "a) $(grep -E 'Triton precompile:|warm-up \(kernel' "$OUT_DIR/throughput_rlserve.log" | sed 's/^\[log\] //' | tr '\n' '|')"
$PY - "$OUT_DIR/throughput_rlserve.log" <<'PYEOF' 2>&1 | tee -a "$OUT_DIR/summary.txt"
import collections, sys
lines = open(sys.argv[1], errors="replace").read().splitlines()
warm = [i for i, l in enumerate(lines) if "warm-up (kernel compilation" in l]
jit = [(i, l.split()[-1]) for i, l in enumerate(lines) if l.startswith("[jit] +")]
cut = warm[-1] if warm else len(lines)
before = collections.Counter(n.rsplit(".", 1)[-1] for i, n in jit if i < cut)
after = collections.Counter(n.rsplit(".", 1)[-1] for i, n in jit if i > cut)
print(f"a) Triton specialization misses: {sum(before.values())} up to the warm-up's end, "
      f"{sum(after.values())} after it: {dict(after)}; fused-MoE kernels before: "
      f"{ {k: v for k, v in before.items() if 'moe' in k or 'topk' in k} }")
PYEOF
gpu_cleanup

# ---- c) GPU tests of the changed kernels
SEL="tuned_table or no_fused_moe_compile or bf16_experts_near and triton or float32_experts_equal and triton or replay_in_a_cuda_graph or moe_align"
if [ "$DRY_RUN" = 1 ]; then
  bounded 60 $PY -m pytest -q -p no:cacheprovider --collect-only tests/gpu/test_moe_gpu.py -k "$SEL" > "$OUT_DIR/tests.log" 2>&1
else
  bounded "$(slot 30 14)" $PY -m pytest -v -p no:cacheprovider -rfEs tests/gpu/test_moe_gpu.py -k "$SEL" > "$OUT_DIR/tests.log" 2>&1
fi
say "c) tests rc=$?: $(tail -1 "$OUT_DIR/tests.log")"
grep -E 'PASSED|FAILED|ERROR' "$OUT_DIR/tests.log" | sed 's/^/c) /' | head -40 >> "$OUT_DIR/summary.txt"
gpu_cleanup
# ---- b) one MoE layer: vLLM's default rule vs the tuned table (same fresh cache: compiles outside the timing)
if [ "$DRY_RUN" = 1 ]; then
  bounded 30 $PY benchmarks/moe_kernels.py --help > "$OUT_DIR/moe_kernels.log" 2>&1
  say "b) moe_kernels --help rc=$? (CUDA only)"
else
  bounded "$(slot 30 2)" $PY benchmarks/moe_kernels.py --tokens 24,128,256,1024,4096 --tuned --triton-only \
    --iters 10 --json "$OUT_DIR/moe_kernels.json" > "$OUT_DIR/moe_kernels.log" 2>&1
  say "b) moe_kernels rc=$?"
  moe_kernel_rows b "$OUT_DIR/moe_kernels.log"
fi
gpu_cleanup

rm -rf "$TRITON_CACHE_DIR"
say "done"
exit 0
