#!/usr/bin/env bash
# Session 20: issue 37's streamed c256 workload (s19_stream.sh's: vLLM 0.24.0's `vllm bench serve` client, 768
# prompts 512 -> 256, Qwen3-0.6B shape, split steps) with the piecewise prefill CUDA graphs: rlserve's default
# ("split"), RLSERVE_PREFILL_CUDA_GRAPHS=1 ("pg": buckets 256..8192, the short prefill step 12.1 -> 2.8 ms in s19),
# and pg with mixed prefill + decode steps and chunked prefill ("pgmix"), then vLLM's server. Budget ~300 s.
#   DRY_RUN=1 OUT_DIR=/tmp/x bash benchmarks/device/s20_pgstream.sh   # CPU: tiny shape (pg off the GPU: emulated? no: eager)
export STREAM_ARMS="split pg pgmix"
export ARM_ENV_pg=RLSERVE_PREFILL_CUDA_GRAPHS=1 ARM_ENV_pgmix=RLSERVE_PREFILL_CUDA_GRAPHS=1
export ARM_FLAGS_pgmix="--mixed-prefill-decode --enable-chunked-prefill"
exec bash "$(dirname "$0")/s19_stream.sh"
