#!/usr/bin/env bash
# Session 17, issue 37 (decode17): the small-batch decode GEMM (rlserve/layers/gemm_rows_kernels.py, steps of
# 2..64 rows: weights streamed on the tensor cores, split-K reduced in the same launch, SiLU-and-mul folded
# into down_proj; RLSERVE_DECODE_GEMM_ROWS) and the batch-1 GEMV at the 8B's sizes ('pdl'), old vs new in one
# process each. Budget 150 s, most important first:
#   a) tests/gpu/test_gemm_rows_gpu.py (bf16 vs cuBLAS at the 0.6B / 8B shapes, split-K chain in a CUDA graph
#      = eager bitwise, a tiny Qwen3 engine at batch 4 with / without, graphs = eager)
#   b) decode_step.py Qwen3-8B, batch 1 / 16 / 64, context 1024: --decode-gemv auto (old default: cuBLAS at
#      every 8B linear) vs pdl:64 (new: GEMV at batch 1, the GEMM at 2..64 rows), graph / eager ms vs the HBM
#      floor, batch-1 ms/token over 256 tokens, the kernel table of 5 graph steps at batch 16 (kernels a step)
#   c) the same for Qwen3-0.6B (batch 1 is the same code in both: auto already takes every 0.6B linear)
#   d) decode_step.py --gemms: each linear of both shapes at 1 / 16 / 64 rows, cuBLAS vs the GEMV / the GEMM
#      in chains of 10 launches from a CUDA graph (us a launch, weight TB/s, the tile plan)
#   e) (full budget only, what is left) the GEMM's tile sweep on the 8B linears at 16 rows (decode_step --rows-sweep)
# Batch 256 is not run: the GEMM takes at most 64 rows, so a 256-row step is the same code old and new.
# The 8B offline workload (throughput.py) does not fit 150 s next to these (two engines of ~60 s each).
# BUDGET < 140 (a cut window): a) the 8B shapes only, b), d) the 8B only, no c).
# DRY_RUN=1 BUDGET=400: every Python step once on the CPU with tiny shapes (the GEMM through Triton's
# interpreter in the tests only: decode_step on CPU has no Triton path).
NAME=s17_decode BUDGET=${BUDGET:-150}; source "$(dirname "$0")/lib.sh"
say "card: $CARD; git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
unset RLSERVE_DECODE_GEMV RLSERVE_DECODE_GEMM_ROWS
if [ "$DRY_RUN" = 1 ]; then
  TESTS=(tests/test_gemm_rows.py -k "split or takes or env")
  D8=(--device cpu --shape tiny-llama --context 64 --iters 2 --batch 1,4 --batch1-tokens 8)
  D06=(--device cpu --shape tiny-llama --context 64 --iters 2 --batch 1,4)
  CAP=(200 100 100 0)
elif [ "$BUDGET" -ge 140 ]; then
  TESTS=(tests/gpu/test_gemm_rows_gpu.py)
  D8=(--shape qwen3-8b --context 1024 --iters 10 --batch 1,16,64 --batch1-tokens 256 --profile --profile-batches 16)
  D06=(--shape qwen3-0.6b --context 1024 --iters 10 --batch 1,16,64 --profile --profile-batches 16)
  CAP=(35 50 25 20)  # seconds: a), b), c), d); e) what is left
  GEMM_SHAPES=qwen3-8b,qwen3-0.6b
else  # a cut budget (the lead's UPDATE 20:55): the 8B shapes' tests, the 8B A/B, the 8B linears; no 0.6B
  TESTS=(tests/gpu/test_gemm_rows_gpu.py -k "not 1024 and not 2048 and not 3072")
  D8=(--shape qwen3-8b --context 1024 --iters 10 --batch 1,16,64 --profile --profile-batches 16)
  D06=()
  CAP=($(( BUDGET * 30 / 100 )) $(( BUDGET * 45 / 100 )) 0 $(( BUDGET * 25 / 100 )))
  GEMM_SHAPES=qwen3-8b
fi
gemm_rows() {  # one summary line per linear and row count of decode_step --gemms' log $OUT_DIR/$1.log
  grep -E '^\{"shape' "$OUT_DIR/$1.log" | $PY -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l)
    new = r.get('chain_rows_us', r.get('chain_gemv_pdl_us', r.get('chain_gemv_us')))
    if new:
        print(f\"d) {r['shape']} {r['linear']:8s} M={r['M']:3d} cublas {r['chain_cublas_us']:7.2f} us  new {new:7.2f} us \"
              f\"({r['N'] * r['K'] * 2 / new / 1e6:.2f} TB/s) tile {r.get('rows_tile', '-')} diff {r.get('rows_max_abs_diff', '-')}\")
" 2>&1 | tee -a "$OUT_DIR/summary.txt"
}
bounded "${CAP[0]}" $PY -m pytest -q -p no:cacheprovider "${TESTS[@]}" > "$OUT_DIR/pytest_rows.log" 2>&1
say "a) tests rc=$? $(tail -1 "$OUT_DIR/pytest_rows.log")"
grep -E "^(FAILED|ERROR)" "$OUT_DIR/pytest_rows.log" | head -5 | while read -r l; do say "a) $l"; done
gpu_cleanup
bounded "$(slot "${CAP[1]}" $(( CAP[2] + CAP[3] > 40 ? 40 : CAP[2] + CAP[3] )))" $PY benchmarks/decode_step.py "${D8[@]}" --decode-gemv auto,pdl:64 \
  --json "$OUT_DIR/decode_8b.json" > "$OUT_DIR/decode_8b.log" 2>&1
say "b) 8B rc=$? $(grep -A7 '^shape ' "$OUT_DIR/decode_8b.log" | tr -s ' ' | tr '\n' '|')"
say "b) $(grep -E 'GPU kernels:' "$OUT_DIR/decode_8b.log" | tr '\n' '|')"
gpu_cleanup
if [ "${#D06[@]}" -gt 0 ]; then
  bounded "$(slot "${CAP[2]}" 20)" $PY benchmarks/decode_step.py "${D06[@]}" --decode-gemv auto,pdl:64 \
    --json "$OUT_DIR/decode_06b.json" > "$OUT_DIR/decode_06b.log" 2>&1
  say "c) 0.6B rc=$? $(grep -A7 '^shape ' "$OUT_DIR/decode_06b.log" | tr -s ' ' | tr '\n' '|')"
  say "c) $(grep -E 'GPU kernels:' "$OUT_DIR/decode_06b.log" | tr '\n' '|')"
  gpu_cleanup
fi
if [ "$DRY_RUN" != 1 ]; then  # d) CUDA only (CUDA graphs)
  bounded "$(slot "${CAP[3]}" 3)" $PY benchmarks/decode_step.py --shape "$GEMM_SHAPES" --gemms --gemm-rows 16,64,1 \
    --no-models --iters 10 --json "$OUT_DIR/gemms.json" > "$OUT_DIR/gemms.log" 2>&1
  say "d) rc=$?"
  gemm_rows gemms
  if [ "$BUDGET" -ge 140 ]; then
    bounded "$(( $(left) - 3 ))" $PY benchmarks/decode_step.py --shape qwen3-8b --gemms --gemm-rows 16 --rows-sweep 16 \
      --no-models --iters 10 --json "$OUT_DIR/sweep.json" > "$OUT_DIR/sweep.log" 2>&1
    say "e) rc=$?"
    grep -E '^\{"shape' "$OUT_DIR/sweep.log" | $PY -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l)
    print(f\"e) {r['linear']:8s} M={r['M']} \" + ' '.join(f\"{t['tile']}:{t['us']}us\" for t in r.get('rows_sweep', [])))
" 2>&1 | tee -a "$OUT_DIR/summary.txt"
  fi
fi
gpu_cleanup
say done
exit 0
