#!/usr/bin/env bash
# Session 18, issue 37 (prefill18): the eager prefill step's fixed cost (~10.7 ms + 0.74 us a token in the s16-s17
# H100 traces) and the piecewise prefill CUDA graphs (RLSERVE_PREFILL_CUDA_GRAPHS, off by default:
# rlserve/engine/worker/prefill_graphs.py), old vs new in one process. Budget 120 s, most important first:
#   b) benchmarks/prefill_step.py, Qwen3-0.6B shape (random bf16 weights): runner steps of 16 / 512 / 2048 / 8192
#      prompt tokens (prompts of <= 2048) and each with 64 decode rows first (a mixed step), eager (off) vs
#      piecewise graphs (on, buckets 256..8192): host ms (until execute returns), wall ms, GPU span ms,
#      torch.profiler's host syncs / kernel launches / kernel ms per step, logits of on vs off (max |diff|,
#      argmax), LLMEngine.step() of the prompts (max_tokens=1: schedule, forward, sampler, outputs)
#   a) tests/gpu/test_prefill_graphs_gpu.py (float32 tiny Qwen3: the graphs captured and replayed, greedy tokens =
#      eager = HF, logprobs within 1e-4, whole prompts, chunks, mixed steps)
# BUDGET < 90: b) without the engine steps and 16 tokens.
# DRY_RUN=1 BUDGET=300: the same on the CPU with a tiny model (the pieces as plain calls, nothing captured).
NAME=s18_prefill BUDGET=${BUDGET:-120}; source "$(dirname "$0")/lib.sh"
say "card: $CARD; git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
unset RLSERVE_PREFILL_CUDA_GRAPHS
if [ "$DRY_RUN" = 1 ]; then
  TESTS=(tests/test_prefill_graphs.py -k "parse or off_where")
  P=(--device cpu --shape tiny --tokens 32,64 --seq-len 32 --context 32 --mixed-prefill-decode 4 --iters 2
     --buckets 32,64,128 --engine --profile)
  CAP=(200 60)
elif [ "$BUDGET" -ge 90 ]; then
  TESTS=(tests/gpu/test_prefill_graphs_gpu.py)
  P=(--tokens 16,512,2048,8192 --mixed-prefill-decode 64 --iters 10 --engine --profile)
  CAP=($(( BUDGET * 65 / 100 )) 30)
else
  TESTS=(tests/gpu/test_prefill_graphs_gpu.py)
  P=(--tokens 512,2048,8192 --mixed-prefill-decode 64 --iters 8 --profile)
  CAP=($(( BUDGET * 70 / 100 )) 20)
fi
bounded "$(slot "${CAP[0]}" "${CAP[1]}")" $PY benchmarks/prefill_step.py "${P[@]}" --prefill-graphs off,on \
  --json "$OUT_DIR/prefill_step.json" > "$OUT_DIR/prefill_step.log" 2>&1
say "b) rc=$? $(grep -E '^\{"prefill_graphs"' "$OUT_DIR/prefill_step.log")"
grep -E '^\{"shape' "$OUT_DIR/prefill_step.log" | $PY -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l)
    syncs = sum(r.get('syncs_per_step', {}).values())
    print(f\"b) {r['tokens']:5d} tok + {r['decode_rows']:3d} dec {r['prefill_graphs']:3s}: host {r['host_ms']:7.2f} \"
          f\"wall {r['wall_ms']:7.2f} gpu {r.get('gpu_ms', 0):7.2f} ms, kernels {r.get('kernel_ms_per_step', 0):6.2f} ms \"
          f\"in {r.get('launches_per_step', 0):5.0f} launches, {syncs:g} syncs, engine step {r.get('engine_step_ms', '-')} \"
          f\"ms, vs off: diff {r.get('max_abs_logit_diff', '-')} argmax {r.get('argmax_equal', '-')}\")
" 2>&1 | tee -a "$OUT_DIR/summary.txt"
grep -E "Error|error" "$OUT_DIR/prefill_step.log" | grep -v USDT | tail -3 | while read -r l; do say "b) $l"; done
gpu_cleanup
bounded "$(slot "${CAP[1]}" 0)" $PY -m pytest -q -p no:cacheprovider "${TESTS[@]}" > "$OUT_DIR/pytest.log" 2>&1
say "a) tests rc=$? $(tail -1 "$OUT_DIR/pytest.log")"
grep -E "^(FAILED|ERROR)" "$OUT_DIR/pytest.log" | head -5 | while read -r l; do say "a) $l"; done
gpu_cleanup
say done
