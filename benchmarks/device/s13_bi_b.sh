#!/usr/bin/env bash
# Issue 39, session 13's second (short) device call, budget 120 s: after the first window's findings
# (cuBLASLt without split-K is not M-invariant on the H100; the fused sampler's logprob moved with the
# batch), the mode now runs the Triton GEMM and reads every logprob from log_softmax. Re-checks:
#   1. tests/gpu/test_batch_invariant_gpu.py (GEMM rows M = 1 vs 2..2048, cuBLAS / cuBLASLt reported;
#      alone vs 1..255 neighbours; prefix hit; graphs vs eager; reference = server; the Qwen3-0.6B shape
#      alone vs 15 / 127 neighbours, greedy / seeded / seeded top-p) -> pytest.log, reports/
#   2. cost Qwen3-0.6B, 128 x 256 / 128, off and on (+ first prompt alone = in batch) -> cost-0.6b.jsonl
#   3. cost Qwen3-8B, 64 x 256 / 128, off and on -> cost-8b.jsonl
#   OUT_DIR=/tmp/x bash benchmarks/device/s13_bi_b.sh ;  DRY_RUN=1 ... (CPU: tiny shapes, interpreter tests)
# The steps are s13_bi.sh's, run with PART=b.
NAME=s13_bi_b BUDGET=${BUDGET:-${BI_BUDGET:-112}} PART=b exec bash "$(dirname "$0")/s13_bi.sh"
