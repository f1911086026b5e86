#!/usr/bin/env bash
# Session 14, issue 37 (Qwen3-0.6B: batch-1 <= 1.0 ms/token; offline within 1.15x of its HBM floor),
# rlserve only, budget 80 s, most important first:
#   b) (first: 18 s) tests/gpu/test_gemv_gpu.py: each folded form vs the unfused ops (bf16 at the 0.6B
#      and 8B shapes, fp32 / fp16 at 0.6B ones), a PDL chain in a CUDA graph = plain launches bitwise,
#      the qwen3 engine at batch 1 with / without the GEMV and graphs = eager
#   a) decode_step.py, Qwen3-0.6B shape, batch 1, context 1024: the batch-1 GEMV path off / on / on
#      with programmatic dependent launch (--decode-gemv 0,1,pdl: one engine each in this process):
#      graph ms, eager ms, engine-step ms, HBM floor, and the forward's GPU kernel tables (--profile)
#   c) throughput.py, Qwen3-0.6B shape, RLSERVE_DECODE_GEMV=1: the offline workload (256 seqs,
#      100..1024) with --floor: the workload's own HBM floor (weights + KV read per step over the
#      timed run's steps) and roofline (per step bytes or FLOPs), time / each; batch-1 ms/token
#      (128-token prompt, 1024 greedy tokens: issue 37's measure); then, if 10 s are left, the
#      batch-1 run again with RLSERVE_DECODE_GEMV=0 (the baseline, a 2-prompt workload)
# DRY_RUN=1: every Python step once on the CPU with tiny shapes.
NAME=s14_decode BUDGET=${BUDGET:-80}; source "$(dirname "$0")/lib.sh"
say "card: $CARD; git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
if [ "$DRY_RUN" = 1 ]; then
  DS=(--device cpu --shape tiny-llama --context 64 --iters 2 --engine-steps 2); PROF=()
  TP=(--device cpu --shape smollm2-135m --num-seqs 4 --min-len 8 --max-len 16); B1=(--batch1-tokens 8 --batch1-prompt-len 16)
  TESTS=(tests/test_gemv.py)
else
  DS=(--shape qwen3-0.6b --context 1024 --iters 50 --engine-steps 50); PROF=(--profile)
  TP=(--device cuda --shape qwen3-0.6b); B1=(--batch1-tokens 1024)
  TESTS=(tests/gpu/test_gemv_gpu.py)
fi
if [ "$BUDGET" -lt 60 ]; then  # a cut budget: a) without kernel tables, then c); b) only if time is left
  bounded 26 $PY benchmarks/decode_step.py "${DS[@]}" --batch 1 --decode-gemv 0,1,pdl \
    --json "$OUT_DIR/decode_06b_b1.json" > "$OUT_DIR/decode_06b_b1.log" 2>&1
  say "a) rc=$? $(grep -A4 '^shape ' "$OUT_DIR/decode_06b_b1.log" | tr -s ' ' | tr '\n' '|')"
  RLSERVE_DECODE_GEMV=1 bounded 22 $PY benchmarks/throughput.py "${TP[@]}" "${B1[@]}" --engine rlserve --no-hf --floor \
    --json "$OUT_DIR/throughput_06b_floor.json" > "$OUT_DIR/throughput_06b_floor.log" 2>&1
  say "c) rc=$? $(grep -E '^rlserve timed|^  rlserve ' "$OUT_DIR/throughput_06b_floor.log" | tr -s ' ' | tr '\n' '|')"
  bounded 30 $PY -m pytest -q -p no:cacheprovider -k "not llama" "${TESTS[@]}" > "$OUT_DIR/pytest_gemv.log" 2>&1
  say "b) tests rc=$? $(tail -1 "$OUT_DIR/pytest_gemv.log")"
  gpu_cleanup; say done; exit 0
fi
# b) first: its compilations (bf16 at the 0.6B shapes) are in Triton's cache for a)
bounded 18 $PY -m pytest -q -p no:cacheprovider -k "not llama" "${TESTS[@]}" > "$OUT_DIR/pytest_gemv.log" 2>&1
say "b) tests rc=$? $(tail -1 "$OUT_DIR/pytest_gemv.log")"
bounded 30 $PY benchmarks/decode_step.py "${DS[@]}" "${PROF[@]}" --batch 1 --decode-gemv 0,1,pdl \
  --json "$OUT_DIR/decode_06b_b1.json" > "$OUT_DIR/decode_06b_b1.log" 2>&1
say "a) rc=$? $(grep -A4 '^shape ' "$OUT_DIR/decode_06b_b1.log" | tr -s ' ' | tr '\n' '|')"
RLSERVE_DECODE_GEMV=1 bounded 22 $PY benchmarks/throughput.py "${TP[@]}" "${B1[@]}" --engine rlserve --no-hf --floor \
  --json "$OUT_DIR/throughput_06b_floor.json" > "$OUT_DIR/throughput_06b_floor.log" 2>&1
say "c) rc=$? $(grep -E '^rlserve timed|^  rlserve ' "$OUT_DIR/throughput_06b_floor.log" | tr -s ' ' | tr '\n' '|')"
if [ "$(left)" -ge 10 ]; then  # the batch-1 baseline: the same command's batch-1 run without the GEMV
  RLSERVE_DECODE_GEMV=0 bounded 12 $PY benchmarks/throughput.py "${TP[@]}" "${B1[@]}" --engine rlserve --no-hf \
    --num-seqs 2 --min-len 16 --max-len 32 --json "$OUT_DIR/batch1_gemv0.json" > "$OUT_DIR/batch1_gemv0.log" 2>&1
  say "c2) rc=$? $(grep -E '^  rlserve ' "$OUT_DIR/batch1_gemv0.log" | tr -s ' ')"
fi
gpu_cleanup
say done
exit 0
