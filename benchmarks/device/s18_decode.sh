#!/usr/bin/env bash
# Session 18, issue 37 (decode18): why the small-batch decode GEMM (RLSERVE_DECODE_GEMM_ROWS) ran 1.9x cuBLAS's
# 8B step (13.7 vs 7.3 ms at batch 16, H100, s18 w1) while alone it matched cuBLAS. Found on the CPU (sm_90 SASS
# of the K loop, Triton 3.6): the folded prologues (add + RMSNorm before qkv / gate_up, SiLU-and-mul before down)
# are computed in the MMA's A-operand layout, which holds the whole [16, 128] input tile in each of the 4 warps,
# and redone by each of the N / 64 column tiles: 1067 instructions a K step with SiLU-and-mul, 346 with the norm
# (plus a synchronous 2-byte norm-weight load + CTA barrier), 145 plain. The standalone benchmark timed only the
# plain form. Now (default, RLSERVE_DECODE_GEMM_ROWS_FOLD=0) the norm / SiLU-and-mul run as their own fused
# kernel before the plain GEMM; =1 keeps the fold (norm weight now pipelined). Also the 64-row tile: 128 x 128 x 3
# stages took 144 KB of shared memory (one program an SM, the split plan's two a SM ran as two waves); now
# 128 x 64 x 4 stages (96 KB). Budget 90 s, most important first:
#   a) decode_step.py Qwen3-8B, batch 1 / 16 / 64, context 1024: auto (cuBLAS at 16 / 64) vs pdl:64 (the GEMM,
#      unfolded: the new default) vs pdl:64f (folded), graph / eager ms vs the HBM floor; kernel tables of 5
#      steps at batch 16 (with PDL a GEMM's time in the table includes its wait for the kernel before it)
#   b) decode_step.py --gemms, the 8B linears at 16 / 64 rows: plain chains as before plus each linear in the
#      model's form with cold weights (benchmarks/rows_forms.py: cuBLAS / GEMM unfolded / GEMM folded)
#   c) Qwen3-0.6B, batch 16 / 64: auto vs pdl:64
#   d) (BUDGET >= 130) tests/gpu/test_gemm_rows_gpu.py at the 8B shapes
#   e) (BUDGET >= 160, what is left) the 8B linears at 64 rows over decode_step's ROWS_SWEEP[64] tiles (the first:
#      session 17's 128 x 128 x 3)
# DRY_RUN=1 BUDGET=120: a), c) on the CPU with a tiny shape (no Triton path there), the CPU tests of the switch.
NAME=s18_decode BUDGET=${BUDGET:-90}; source "$(dirname "$0")/lib.sh"
say "card: $CARD; git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
unset RLSERVE_DECODE_GEMV RLSERVE_DECODE_GEMM_ROWS RLSERVE_DECODE_GEMM_ROWS_FOLD
if [ "$DRY_RUN" = 1 ]; then
  D8=(--device cpu --shape tiny-llama --context 64 --iters 2 --batch 1,4)
  D06=(--device cpu --shape tiny-llama --context 64 --iters 2 --batch 4)
  TESTS=(tests/test_gemm_rows.py -k "unfolded or env")
  CAP=(60 0 30 40)
else
  D8=(--shape qwen3-8b --context 1024 --iters 10 --batch 1,16,64 --profile --profile-batches 16)
  D06=(--shape qwen3-0.6b --context 1024 --iters 10 --batch 16,64)
  TESTS=(tests/gpu/test_gemm_rows_gpu.py -k "4096 or 12288 or chain")
  CAP=(45 25 15 30)  # seconds: a), b), c), d)
fi
bounded "$(slot "${CAP[0]}" 30)" $PY benchmarks/decode_step.py "${D8[@]}" --decode-gemv auto,pdl:64,pdl:64f \
  --json "$OUT_DIR/decode_8b.json" > "$OUT_DIR/decode_8b.log" 2>&1
say "a) 8B rc=$? $(grep -A10 '^shape ' "$OUT_DIR/decode_8b.log" | tr -s ' ' | tr '\n' '|')"
say "a) $(grep -E 'GPU kernels:' "$OUT_DIR/decode_8b.log" | tr '\n' '|')"
grep -A3 -E 'GPU kernels:.*B=16 graph' "$OUT_DIR/decode_8b.log" | cut -c1-110 | while read -r l; do say "a) $l"; done
gpu_cleanup
if [ "$DRY_RUN" != 1 ]; then  # b) CUDA only (CUDA graphs)
  bounded "$(slot "${CAP[1]}" 12)" $PY benchmarks/decode_step.py --shape qwen3-8b --gemms --gemm-rows 16,64 \
    --no-models --iters 10 --json "$OUT_DIR/gemms.json" > "$OUT_DIR/gemms.log" 2>&1
  say "b) rc=$?"
  $PY benchmarks/device/rows_summary.py forms < "$OUT_DIR/gemms.log" 2>&1 | tee -a "$OUT_DIR/summary.txt"
  gpu_cleanup
fi
bounded "$(slot "${CAP[2]}" 3)" $PY benchmarks/decode_step.py "${D06[@]}" --decode-gemv auto,pdl:64 \
  --json "$OUT_DIR/decode_06b.json" > "$OUT_DIR/decode_06b.log" 2>&1
say "c) 0.6B rc=$? $(grep -A5 '^shape ' "$OUT_DIR/decode_06b.log" | tr -s ' ' | tr '\n' '|')"
gpu_cleanup
if [ "$DRY_RUN" = 1 ] || [ "$BUDGET" -ge 130 ]; then
  bounded "$(slot "${CAP[3]}" 0)" $PY -m pytest -q -p no:cacheprovider "${TESTS[@]}" > "$OUT_DIR/pytest_rows.log" 2>&1
  say "d) tests rc=$? $(tail -1 "$OUT_DIR/pytest_rows.log")"
  grep -E "^(FAILED|ERROR)" "$OUT_DIR/pytest_rows.log" | head -5 | while read -r l; do say "d) $l"; done
  gpu_cleanup
fi
if [ "$DRY_RUN" != 1 ] && [ "$BUDGET" -ge 160 ]; then
  bounded "$(( $(left) - 3 ))" $PY benchmarks/decode_step.py --shape qwen3-8b --gemms --gemm-rows 64 --rows-sweep 64 \
    --no-models --iters 10 --json "$OUT_DIR/sweep.json" > "$OUT_DIR/sweep.log" 2>&1
  say "e) rc=$?"
  $PY benchmarks/device/rows_summary.py sweep < "$OUT_DIR/sweep.log" 2>&1 | tee -a "$OUT_DIR/summary.txt"
  gpu_cleanup
fi
say done
exit 0
