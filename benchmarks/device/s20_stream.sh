#!/usr/bin/env bash
# Issue 37, streaming p99 inter-token latency at concurrency 256 and 64, session 20, engine side (budget ~300 s;
# BUDGET may be cut: every step adapts). stream_schedule_sim.py --fit s19 (the real scheduler over session 19's
# H100 step times; BENCHMARKS.md "HTTP serving", s20 row) puts the engine's own c256 p99 gap at 20.4 ms with the
# defaults (eager prefill steps of <= 2,048 tokens while streams decode: ~12 ms of launches each), 13.0 ms with
# piecewise prefill graphs (RLSERVE_PREFILL_CUDA_GRAPHS=1, off by default) and 1,024-token prefill steps, 16.8 ms
# with graphs and 2,048 (c64: 15.1 / 7.9 / 11.5 ms; tok/s 23.8k / 25.0k / 25.9k at c256). This measures them:
#   1) vLLM 0.24.0's `vllm bench serve` client (/tmp/vsite, benchmarks/vllm_bench.py --one-client), 768 random
#      prompts 512 in / 256 out, ignore_eos, greedy, streamed, Qwen3-0.6B shape, dummy bf16 weights, concurrency
#      256 then 64 on one server each, against rlserve "default" then "g1024" (graphs, 1,024-token budget while
#      decoding), each with the engine step trace (benchmarks/step_trace.py: prefill step times say whether the
#      graphs replayed; session 19's engine never replayed them: s20_pgdebug.sh looks for why) and the server
#      log's prefill-graph line
#   2) "g2048" (graphs, the default 2,048 budget) when >= 175 s are left (so vLLM's server still fits)
#   3) vLLM's own server on the same workload when >= 110 s are left (its start-up is ~75 s; the issue's target:
#      rlserve's p99 ITL and p99 TTFT <= vLLM's, mean TTFT <= vLLM's, output tok/s >= 1.3x)
#   4) with >= 50 s left (a BUDGET above ~300 s): "m1024", graphs + mixed chunked steps with
#      --max-consecutive-prefill-steps 0 and the 1,024 budget
# A dry run (DRY_RUN=1, CPU, tiny-llama, 24 prompts 300 -> 16 at @conc=8) scales the budgets to 64 / 128 tokens.
#
#   OUT_DIR=/tmp/x bash benchmarks/device/s20_stream.sh
#   DRY_RUN=1 BUDGET=120 OUT_DIR=/tmp/x bash benchmarks/device/s20_stream.sh
# Results: $OUT_DIR/vllm_bench{,_g2048,_vllm,_m1024}.{json,log}, steps_*/, card.txt, the servers' log tails; summary on stdout.
NAME=s20_stream BUDGET=${BUDGET:-300}; source "$(dirname "$0")/lib.sh"
say "card: $CARD (BUDGET $BUDGET s); git $(git rev-parse --short HEAD 2>/dev/null)"
http_site
stream_workload 256,64
if [ "$DRY_RUN" = 1 ]; then
  B1=64 B2=128 LIMIT=$(( $(left) - 10 ))
else
  B1=1024 B2=2048 LIMIT=$(( $(left) >= 240 ? $(left) - 130 : $(left) - 5 ))  # two servers x two runs: ~90 s
  [ "$LIMIT" -gt 120 ] && LIMIT=120
fi
G=RLSERVE_PREFILL_CUDA_GRAPHS=1
graph_lines() {  # what each rlserve server's log said about the prefill graphs (captured, or off and why)
  local logs
  logs=$(find "$OUT_DIR" -maxdepth 1 -name 'rlserve-server-*.log' -newer "$OUT_DIR/start")
  [ -z "$logs" ] && { say "  log: no rlserve server log"; return 0; }
  grep -h "prefill piecewise CUDA graphs" $logs | sed 's/^.*prefill piecewise/prefill piecewise/' \
    | sort | uniq -c | while read -r l; do say "  log: $l"; done
}
if [ "$(left)" -lt 30 ]; then say "vllm_bench skipped: $(left) s left of BUDGET=$BUDGET"; say "done"; exit 0; fi
# 1) the defaults, then graphs with the 1,024-token budget
# (since session 21 the graphs are on by default: this arm keeps its eager prefill steps, the baseline it measured)
CONFIGS=("default=$C $(server_words default RLSERVE_PREFILL_CUDA_GRAPHS=0) $FLAGS"
         "g$B1=$C $(server_words "g$B1" $G) $FLAGS --max-prefill-tokens-while-decoding $B1")
STEM=vllm_bench stream_bench "$LIMIT" "$MIN_STEPS" default "g$B1"
say "stacks (default, g$B1): $(server_stacks)"
graph_lines
# 2) graphs with the default 2,048-token budget
if [ "$(left)" -ge 175 ] || [ "$DRY_RUN" = 1 ]; then
  touch "$OUT_DIR/start"
  CONFIGS=("g$B2=$C $(server_words "g$B2" $G) $FLAGS --max-prefill-tokens-while-decoding $B2")
  [ "$DRY_RUN" = 1 ] && L2=$(( $(left) / 2 )) || L2=$(( $(left) - 120 ))
  STEM=vllm_bench_g2048 stream_bench "$L2" "$MIN_STEPS" "g$B2"
  graph_lines
else
  say "g$B2 skipped: $(left) s left (< 175)"
fi
# 3) vLLM's server, same workload and client
if [ "$(left)" -ge 110 ] || { [ "$DRY_RUN" = 1 ] && [ -n "${VLLM_DRY:-}" ]; }; then
  vllm_stream
else
  say "vLLM's server skipped: $(left) s left (< 110; its s15 w1 figures: c256 8,225 tok/s, TTFT 1,563 / 3,934 ms, ITL p99 42.4 ms; c64 9,851 tok/s, 113 / 203 ms, 748.3 ms)"
fi
# 4) what is left: graphs + mixed chunked steps, every step mixed while prompts wait, the 1,024 budget (the model's
#    lowest c256 gap with TTFT near the defaults' in fit A: 11.4 ms; fit B: 17.1 ms, TTFT 418 / 1,871 ms)
if [ "$(left)" -ge 50 ]; then
  touch "$OUT_DIR/start"
  CONFIGS=("m$B1=$C $(server_words "m$B1" $G) $FLAGS --max-prefill-tokens-while-decoding $B1 --mixed-prefill-decode --enable-chunked-prefill --max-consecutive-prefill-steps 0")
  STEM=vllm_bench_m1024 stream_bench $(( $(left) - 4 )) "$MIN_STEPS" "m$B1"
  graph_lines
else
  say "m$B1 skipped: $(left) s left (< 50)"
fi
say "done"
exit 0
