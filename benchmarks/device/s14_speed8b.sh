#!/usr/bin/env bash
# Session 14, issue 37 (speed8b, budget 190 s): the Qwen3-8B shape's start-up to ready, offline throughput and
# batch-1 decode against vLLM 0.24.0 in the same run.
#   A1) `rlserve serve` (dummy 8B, tiny tokenizer) process start -> ready, cold Triton cache (fresh
#       TRITON_CACHE_DIR) with RLSERVE_TRITON_PRECOMPILE=1 (the default: the kernels the cache lacks compile
#       in parallel processes); the server's INFO lines with their second (where the start-up goes); 16 greedy
#       tokens of a fixed prompt
#   A2) the same, warm (A1's cache): a second start on one machine; its tokens must equal A1's
#   B)  throughput.py --shape qwen3-8b --engine rlserve,vllm --batch1-tokens 128 --floor (the nano-vllm offline
#       workload + batch-1; rlserve's in-process LLM() start-up warm; the workload's own HBM floor / roofline
#       for rlserve; vLLM's start-up is ~90-110 s of this step)
#   D)  decode_step.py 8B batch 1 with the batch-1 GEMV off / on (--decode-gemv 0,1: decode14's kernels at the
#       8B shape) vs the HBM floor, if time is left
#   C)  A1 with RLSERVE_TRITON_PRECOMPILE=0 (a cold start compiling one kernel after the other), if time is left
# DRY_RUN=1: tiny shapes on the CPU, rlserve only.
NAME=s14_speed8b BUDGET=${BUDGET:-190}; source "$(dirname "$0")/lib.sh"
say "card: $CARD"
TC_ON=/tmp/s14_speed8b_triton_on; TC_OFF=/tmp/s14_speed8b_triton_off
rm -rf "$TC_ON" "$TC_OFF"; mkdir -p "$TC_ON" "$TC_OFF"
if [ "$DRY_RUN" = 1 ]; then
  S8=tiny-llama; DEV=cpu; ENG=rlserve; SRV=(-- --max-model-len 256 --max-num-seqs 8); LA=(150 150 150)
  DS=(--device cpu --context 64)
  TP=(--device cpu --num-seqs 8 --min-len 8 --max-len 24 --max-num-seqs 8 --batch1-tokens 8)
else
  S8=qwen3-8b; DEV=cuda; ENG=rlserve,vllm; SRV=(-- --max-model-len 2056); TP=(--device cuda --batch1-tokens 128); DS=()
  LA=(32 25 45)  # seconds for A1 (cold), A2 (warm), C (cold, serial compiles): B needs ~150 s
fi

TRITON_CACHE_DIR=$TC_ON RLSERVE_TRITON_PRECOMPILE=1 serve_start A1_cold_precompile ${LA[0]}
TRITON_CACHE_DIR=$TC_ON RLSERVE_TRITON_PRECOMPILE=1 serve_start A2_warm ${LA[1]}

TRITON_CACHE_DIR=$TC_ON bounded 170 $PY benchmarks/throughput.py --shape $S8 --engine $ENG --no-hf "${TP[@]}" --floor \
  --json "$OUT_DIR/throughput_8b.json" > "$OUT_DIR/throughput_8b.log" 2>&1
rc=$?; B=$(grep -E '^  (rlserve|vllm) ' "$OUT_DIR/throughput_8b.log" | tr -s ' ' | tr '\n' '|')
# cut before its table: the per-engine lines printed as each engine finished
[ -n "$B" ] || B=$(grep -E '^(rlserve|vllm): ' "$OUT_DIR/throughput_8b.log" | cut -c1-600 | tr '\n' '|')
say "B) rc=$rc $B"
gpu_cleanup

if [ "$(left)" -ge 35 ]; then
  TRITON_CACHE_DIR=$TC_ON bounded 45 $PY benchmarks/decode_step.py "${DS[@]}" --shape $S8 --batch 1 --iters 20 \
    --decode-gemv 0,1 --json "$OUT_DIR/decode_8b_b1.json" > "$OUT_DIR/decode_8b_b1.log" 2>&1
  say "D) rc=$? $(grep -A3 '^shape ' "$OUT_DIR/decode_8b_b1.log" | tr -s ' ' | tr '\n' '|')"
  gpu_cleanup
else
  say "D) skipped: $(left) s left"
fi
if [ "$(left)" -ge 35 ]; then
  TRITON_CACHE_DIR=$TC_OFF RLSERVE_TRITON_PRECOMPILE=0 serve_start C_cold_serial ${LA[2]}
else
  say "C) skipped: $(left) s left"
fi
$PY - "$OUT_DIR" <<'PYEOF' | tee -a "$OUT_DIR/summary.txt"
import json, os, sys
runs = {}
for name in ("A1_cold_precompile", "A2_warm", "C_cold_serial"):
    try:
        runs[name] = json.load(open(os.path.join(sys.argv[1], f"serve_{name}.json")))["runs"]["."][0]
    except Exception:  # noqa: BLE001 -- not run or failed
        pass
for name, r in runs.items():
    print(f"{name}: ready {r['ready_s']:.2f} s, loading->engine ready {r['load_s']:.2f} s, tokens {r['tokens']}")
toks = {name: r["tokens"] for name, r in runs.items()}
print("tokens equal across start-ups:", len(set(map(str, toks.values()))) == 1, sorted(toks))
PYEOF
rm -rf "$TC_OFF"
say done
exit 0
