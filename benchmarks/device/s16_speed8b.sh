#!/usr/bin/env bash
# Session 16, issue 37 (speed16; budget $BUDGET, 240 s by default, the second window gives 130 s): the Qwen3-8B
# shape offline against vLLM 0.24.0 in the same call, where rlserve's time goes step by step, and start-up to
# ready. In this order (the first window, 2026-12-06 18:20, measured rlserve alone: 8,204 tok/s and a cold
# `rlserve serve` ready in 19.9 s; vLLM was cut at the end of its 102 s):
#   VR) throughput.py --shape qwen3-8b --engine vllm,rlserve (the nano-vllm offline workload: 256 sequences,
#       100..1024 in / out) in ONE process (one torch import for both): vLLM 0.24 (/tmp/vsite) first in its
#       child process -- its LLM() start-up to ready (torch.compile + graphs; ~65 s of its ~90 s), tok/s, KV
#       cache tokens -- then rlserve with --floor --step-trace: its LLM() start-up, tok/s ("rlserve timed:" as
#       soon as the run ends, the step trace next, then the floor: the serial floor per step class)
#   A2) `rlserve serve` (dummy 8B, tiny tokenizer) start -> ready with the Triton cache VR's rlserve warmed
#       (never measured: the ~15 s target), if 25 s are left
#   A1) the same with a cold Triton cache (fresh TRITON_CACHE_DIR), if 40 s are left
# DRY_RUN=1: tiny shapes on the CPU, rlserve only (vLLM only with VLLM_PYTHONPATH set).
NAME=s16_speed8b BUDGET=${BUDGET:-240}; source "$(dirname "$0")/lib.sh"
say "card: $CARD"
TC=/tmp/s16_speed8b_triton_cold
rm -rf "$TC"; mkdir -p "$TC"
if [ "$DRY_RUN" = 1 ]; then
  S8=tiny-llama; DEV=cpu; SRV=(-- --max-model-len 256 --max-num-seqs 8); LA=(150 150)
  TP=(--shape $S8 --device cpu --num-seqs 8 --min-len 8 --max-len 24 --max-num-seqs 8)
  ENG=rlserve; [ -n "${VLLM_PYTHONPATH:-}" ] && ENG=vllm,rlserve
else
  S8=qwen3-8b; DEV=cuda; SRV=(-- --max-model-len 2056); LA=(40 25); ENG=vllm,rlserve
  TP=(--shape $S8 --device cuda)
fi

# VR) both engines, one process, vLLM first; vLLM's own environment only in this subshell (env.sh: offline, no
# flashinfer sampler); its child gets PYTHONPATH=/tmp/vsite alone (throughput.run_vllm)
t=$(( $(left) - 2 )); [ "$t" -gt 200 ] && t=200
( [ "$DRY_RUN" != 1 ] && [ -f /tmp/vsite/env.sh ] && source /tmp/vsite/env.sh
  timeout -k 3 "$t" $PY benchmarks/throughput.py --engine $ENG --no-hf "${TP[@]}" --floor \
    --step-trace "$OUT_DIR/steps_rlserve.jsonl" --json "$OUT_DIR/throughput_8b.json" ) > "$OUT_DIR/throughput_8b.log" 2>&1
say "VR) rc=$? ($t s limit)"
grep -E '^(vllm|rlserve): |^rlserve timed' "$OUT_DIR/throughput_8b.log" | cut -c1-300 | tee -a "$OUT_DIR/summary.txt"
grep -E '^  (rlserve|vllm)|^serial floor|^  steps ' "$OUT_DIR/throughput_8b.log" | tee -a "$OUT_DIR/summary.txt"
say "VR) vllm KV: $(grep -E 'GPU KV cache size|init engine|torch.compile took' "$OUT_DIR/throughput_8b.log" \
  | sed 's/.*\] //' | head -3 | tr '\n' ' ')"
gpu_cleanup

if [ "$(left)" -ge "${LA[1]}" ]; then serve_start A2_warm ${LA[1]}; else say "A2) skipped: $(left) s left"; fi
if [ "$(left)" -ge "${LA[0]}" ]; then
  TRITON_CACHE_DIR=$TC RLSERVE_TRITON_PRECOMPILE=1 serve_start A1_cold ${LA[0]}
else
  say "A1) skipped: $(left) s left"
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
try:
    res = {r["engine"].split("-")[0]: r for r in json.load(open(os.path.join(d, "throughput_8b.json")))["results"]}
except Exception as e:  # noqa: BLE001 -- cut or failed: the log's lines above are what there is
    res = {}
    print(f"throughput_8b.json: none ({type(e).__name__})")
for eng, r in res.items():
    print(f"{eng}: LLM() start-up {r['startup_s']:.1f} s, {r['tokens_per_s']:.0f} tok/s ({r['seconds']:.2f} s), "
          f"KV {r.get('kv_cache_tokens')} tokens")
if len(res) == 2:
    print(f"rlserve / vLLM: {res['rlserve']['tokens_per_s'] / res['vllm']['tokens_per_s']:.3f}x")
PYEOF
rm -rf "$TC"
say done
exit 0
