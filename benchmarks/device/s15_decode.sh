#!/usr/bin/env bash
# Session 15, issue 37 (Qwen3-0.6B: batch-1 <= 1.0 ms/token end to end, the batch-1 GEMV on by default),
# rlserve only, budget 90 s, most important first:
#   b) tests/gpu/test_gemv_gpu.py, all of it (48 s: window 1 cut it at 18 s after 19 of ~31 tests,
#      every (K, dtype, prologue) compiles once): a PDL chain of GEMVs in a CUDA graph = plain launches
#      bitwise, a tiny Qwen3 engine at batch 1 with PDL everywhere (set_neighbours) = without bitwise, the qwen3 and llama engines at
#      batch 1 with / without the GEMV and graphs = eager, each folded form vs the unfused ops
#   a) decode_step.py (its first line: Triton, the CUDA driver and pdl_unavailable -- None: PDL runs,
#      else why not), Qwen3-0.6B shape, batch 1, context 1024, --decode-gemv 0,1,pdl,pdla (one engine
#      each in this process; pdl, the default: PDL on the GEMVs; pdla: also on the attention and
#      q-k-norm-rope kernels, pdl.set_neighbours): graph / engine-step ms and, new, --batch1-tokens 1024: a 128-token prompt
#      decoding 1024 greedy tokens through LLM.generate (issue 37's ms/token) with the GPU span per
#      step, the host's launch and wait times and the gap between steps (benchmarks/batch1_latency.py)
#   d) decode_step.py --gemms at 1 row, Qwen3-0.6B and -8B linears: cuBLAS vs the GEMV plain / PDL, chains of 10
#      launches in a CUDA graph (us a launch): whether the default GEMV also wins at the 8B's sizes
#   c) throughput.py, Qwen3-0.6B shape, RLSERVE_DECODE_GEMV unset (the default): the offline workload
#      (256 seqs, 100..1024) with --floor, and batch-1 ms/token (throughput.py's own measure)
# DRY_RUN=1 BUDGET=400: every Python step once on the CPU with tiny shapes.
NAME=s15_decode BUDGET=${BUDGET:-90}; source "$(dirname "$0")/lib.sh"
say "card: $CARD; git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
unset RLSERVE_DECODE_GEMV  # c) runs the default
if [ "$DRY_RUN" = 1 ]; then
  DS=(--device cpu --shape tiny-llama --context 64 --iters 2 --engine-steps 2 --batch1-tokens 16)
  TP=(--device cpu --shape smollm2-135m --num-seqs 4 --min-len 8 --max-len 16); B1=(--batch1-tokens 8 --batch1-prompt-len 16)
  TESTS=(tests/test_gemv.py -k "pdl or mode or env")  # the CPU interpreter: a quick subset
  CAP=(120 120 120 0)  # a loaded 2-core CPU: run with BUDGET=400
else
  DS=(--shape qwen3-0.6b --context 1024 --iters 20 --engine-steps 20 --batch1-tokens 1024)
  TP=(--device cuda --shape qwen3-0.6b); B1=(--batch1-tokens 1024)
  TESTS=(tests/gpu/test_gemv_gpu.py)
  CAP=(48 28 24 8)  # seconds: b), a), c), d); c) last: it gets what is left
fi
bounded "${CAP[0]}" $PY -m pytest -q -p no:cacheprovider "${TESTS[@]}" > "$OUT_DIR/pytest_gemv.log" 2>&1
say "b) tests rc=$? $(tail -1 "$OUT_DIR/pytest_gemv.log")"
bounded "$(slot "${CAP[1]}" 10)" $PY benchmarks/decode_step.py "${DS[@]}" --batch 1 --decode-gemv 0,1,pdl,pdla \
  --json "$OUT_DIR/decode_06b_b1.json" > "$OUT_DIR/decode_06b_b1.log" 2>&1
say "a) rc=$? $(grep -A5 '^shape ' "$OUT_DIR/decode_06b_b1.log" | tr -s ' ' | tr '\n' '|')"
say "a) $(grep -m1 '"pdl_unavailable"' "$OUT_DIR/decode_06b_b1.log" | grep -oE '"(triton|cuda_driver|pdl_unavailable)": [^,]*' | tr '\n' ' ')"
if [ "$DRY_RUN" != 1 ]; then  # d) CUDA only
  bounded "$(slot "${CAP[3]}" 12)" $PY benchmarks/decode_step.py --shape qwen3-0.6b,qwen3-8b --gemms --gemm-rows 1 \
    --no-models --iters 20 --json "$OUT_DIR/gemv_vs_cublas.json" > "$OUT_DIR/gemv_vs_cublas.log" 2>&1
  say "d) rc=$? $(grep chain_cublas_us "$OUT_DIR/gemv_vs_cublas.log" | grep -oE '"(shape|linear|chain_[a-z_]+)": [^,}]*' \
    | sed 's/"chain_//; s/_us"//; s/"//g' | tr '\n' ' ')"
fi
bounded "${CAP[2]}" $PY benchmarks/throughput.py "${TP[@]}" "${B1[@]}" --engine rlserve --no-hf --floor \
  --json "$OUT_DIR/throughput_06b_floor.json" > "$OUT_DIR/throughput_06b_floor.log" 2>&1
say "c) rc=$? $(grep -E '^rlserve timed|^  rlserve ' "$OUT_DIR/throughput_06b_floor.log" | tr -s ' ' | tr '\n' '|')"
gpu_cleanup
say done
exit 0
