#!/usr/bin/env bash
# Issue 37, session 25: the streaming targets in ONE call, vLLM 0.24.0's own server beside rlserve (session 25's
# window lost vLLM's figure: s22_stream.sh gave vLLM's server 150 s, its start took 54 s, its first requests 6-14 s,
# and the kill came at 52% of its c256 run). Budget ~420 s (BUDGET); each step adapts to what is left:
#   1) vLLM's own server FIRST (the figure every target is measured against), c256 then c64, up to 220 s;
#   2) rlserve with main's defaults (`--api-server-count 1`), c256 then c64;
#   3) rlserve `--api-server-count 4` (session 25's H100 run: c256 p99 ITL 19.1 ms against 125.6 / 119.0 with one
#      API process, p99 TTFT 798 against 770 / 761), c256 then c64.
# Workload (lib.sh stream_workload): 768 prompts 512 -> 256, ignore_eos, greedy, Qwen3-0.6B shape, dummy bf16,
# `vllm bench serve`'s client. DRY_RUN=1: tiny-llama on the CPU, vLLM skipped unless VLLM_DRY=1.
#   OUT_DIR=/tmp/x DRY_RUN=1 bash benchmarks/device/s25_stream.sh
NAME=s25_stream BUDGET=${BUDGET:-420}; source "$(dirname "$0")/lib.sh"
say "card: $CARD (BUDGET $BUDGET s); git $(git rev-parse --short HEAD 2>/dev/null)"
say "host: $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"
http_site
stream_workload 256,64
SITE=${HTTP_SITE:+@PYTHONPATH=$HTTP_SITE:${PYTHONPATH:-$PWD}}
if [ "$DRY_RUN" = 1 ] && [ -z "${VLLM_DRY:-}" ]; then
  say "vLLM's server skipped in a dry run (VLLM_DRY=1 starts vLLM CPU: its compile takes 5-20 minutes here)"
elif [ "$DRY_RUN" != 1 ] && [ ! -f /tmp/vsite/env.sh ]; then
  say "vLLM's server skipped: not installed on this machine (/tmp/vsite/env.sh missing: the carry calls did not run)"
else
  touch "$OUT_DIR/start"
  CONFIGS=("vllm=$C vllm $VFLAGS")
  L=$(( $(left) >= 400 ? 220 : $(left) / 2 ))
  STEM=vllm_bench_vllm stream_bench "$L" "$MIN_STEPS"
fi
for n in 1 4; do
  if [ "$(left)" -lt 50 ]; then say "api-server-count $n skipped: $(left) s left"; continue; fi
  touch "$OUT_DIR/start"
  CONFIGS=("n$n=$C $SITE $FLAGS --api-server-count $n")
  [ "$n" = 1 ] && L=$(( $(left) / 2 )) || L=$(( $(left) - 4 ))
  STEM=vllm_bench_n$n stream_bench "$L" "$MIN_STEPS"
done
say "done"
exit 0
