#!/usr/bin/env bash
# Session 16, issue 37 (speed16, budget 240 s): the Qwen3-8B shape offline against vLLM 0.24.0 in the same run,
# where rlserve's time goes step by step, and the start-up to ready of both. In this order:
#   A1) `rlserve serve` (dummy 8B, tiny tokenizer) process start -> ready with a cold Triton cache (fresh
#       TRITON_CACHE_DIR, RLSERVE_TRITON_PRECOMPILE=1, the default), the server's INFO lines with their second
#       (where the start-up goes), 16 greedy tokens of a fixed prompt
#   R)  throughput.py --shape qwen3-8b --engine rlserve (the nano-vllm offline workload: 256 sequences, 100..1024
#       in / out) --floor --step-trace: the workload's HBM floor / roofline and the serial floor (per step
#       max(weights, GEMM FLOPs) + KV bytes, in sequence), every step (prefill / decode, sequences, rows incl.
#       CUDA-graph padding, launch time) as JSON lines, steps per class and their time; rlserve's in-process
#       LLM() start-up with A1's (warm) Triton cache; its KV cache tokens
#   V)  the same workload, vLLM 0.24 (/tmp/vsite, its own process): its LLM() start-up to ready (torch.compile +
#       graphs, cold caches on a fresh machine: ~90-110 s, most of the budget), tok/s, KV cache tokens
#   A2) A1 again, warm (A1's cache), if 25 s are left: tokens must equal A1's
# DRY_RUN=1: tiny shapes on the CPU, rlserve only (vLLM only with VLLM_PYTHONPATH set).
NAME=s16_speed8b BUDGET=${BUDGET:-240}; source "$(dirname "$0")/lib.sh"
say "card: $CARD"
TC=/tmp/s16_speed8b_triton_cold
rm -rf "$TC"; mkdir -p "$TC"
if [ "$DRY_RUN" = 1 ]; then
  S8=tiny-llama; DEV=cpu; SRV=(-- --max-model-len 256 --max-num-seqs 8); LA=(150 150)
  TP=(--shape $S8 --device cpu --num-seqs 8 --min-len 8 --max-len 24 --max-num-seqs 8)
  VCAP=150; RCAP=150
else
  S8=qwen3-8b; DEV=cuda; SRV=(-- --max-model-len 2056); LA=(40 25)
  TP=(--shape $S8 --device cuda)
  VCAP=150; RCAP=60  # vLLM: ~90-110 s start-up + ~18 s workload; rlserve: ~5 s start-up + ~18 s + floor
fi

TRITON_CACHE_DIR=$TC RLSERVE_TRITON_PRECOMPILE=1 serve_start A1_cold ${LA[0]}

# R) rlserve, same workload, with the floor and the step trace
t=$(slot $RCAP 120)
TRITON_CACHE_DIR=$TC timeout -k 5 "$t" $PY benchmarks/throughput.py --engine rlserve --no-hf "${TP[@]}" --floor \
  --step-trace "$OUT_DIR/steps_rlserve.jsonl" --json "$OUT_DIR/throughput_rlserve.json" \
  > "$OUT_DIR/throughput_rlserve.log" 2>&1
say "R) rlserve rc=$? ($t s limit): $(grep -E '^  rlserve ' "$OUT_DIR/throughput_rlserve.log" | tr -s ' ')"
grep -E '^serial floor|^  steps ' "$OUT_DIR/throughput_rlserve.log" | tee -a "$OUT_DIR/summary.txt"
gpu_cleanup

# V) vLLM, its own process and environment
if [ "$DRY_RUN" = 1 ] && [ -z "${VLLM_PYTHONPATH:-}" ]; then
  say "V) vllm skipped (dry run without VLLM_PYTHONPATH)"
else
  t=$(slot $VCAP ${LA[1]})
  ( [ -f /tmp/vsite/env.sh ] && source /tmp/vsite/env.sh
    timeout -k 5 "$t" $PY benchmarks/throughput.py --engine vllm --no-hf "${TP[@]}" \
      --json "$OUT_DIR/throughput_vllm.json" ) > "$OUT_DIR/throughput_vllm.log" 2>&1
  say "V) vllm rc=$? ($t s limit): $(grep -E '^  vllm' "$OUT_DIR/throughput_vllm.log" | tr -s ' ')"
  say "V) vllm KV: $(grep -E 'GPU KV cache size|Available KV cache memory|Maximum concurrency' \
    "$OUT_DIR/throughput_vllm.log" | sed 's/.*\] //' | head -3 | tr '\n' ' ')"
  gpu_cleanup
fi
$PY benchmarks/device/throughput_summary.py "$OUT_DIR" "$CARD" "R+V)" 2>&1 | tee -a "$OUT_DIR/summary.txt"

if [ "$(left)" -ge $(( LA[1] )) ]; then
  TRITON_CACHE_DIR=$TC RLSERVE_TRITON_PRECOMPILE=1 serve_start A2_warm ${LA[1]}
else
  say "A2) skipped: $(left) s left"
fi
$PY - "$OUT_DIR" <<'PYEOF' | tee -a "$OUT_DIR/summary.txt"
import json, os, sys
d = sys.argv[1]
runs = {}
for name in ("A1_cold", "A2_warm"):
    try:
        runs[name] = json.load(open(os.path.join(d, f"serve_{name}.json")))["runs"]["."][0]
    except Exception:  # noqa: BLE001 -- not run or failed
        pass
for name, r in runs.items():
    print(f"{name}: rlserve serve ready {r['ready_s']:.2f} s, loading->engine ready {r['load_s']:.2f} s, tokens {r['tokens']}")
print("tokens equal across start-ups:", len(set(map(str, (r["tokens"] for r in runs.values())))) == 1, sorted(runs))
for eng in ("rlserve", "vllm"):
    try:
        r = json.load(open(os.path.join(d, f"throughput_{eng}.json")))["results"][0]
        print(f"{eng}: LLM() start-up {r['startup_s']:.1f} s, {r['tokens_per_s']:.0f} tok/s, KV {r.get('kv_cache_tokens')} tokens")
    except Exception as e:  # noqa: BLE001 -- not run or failed
        print(f"{eng}: no result ({type(e).__name__})")
PYEOF
rm -rf "$TC"
say done
exit 0
