#!/usr/bin/env bash
# Issue 37, session 22: rlserve's streams at 256 and 64 clients against vLLM 0.24.0's own server IN THE SAME CALL
# (session 21 had vLLM's server only in window 1, on a slower host), after session 22's API-process changes
# (the DecodeStream detokenizer, one detokenizer call per request per pass) and session 21's fix of the mid-run
# `_prefill_kernel` compile (8d28eef, never run on a GPU). Budget ~330 s, each step adapts to what is left:
#   1) "default": rlserve with main's defaults, c256 then c64 (one server), no probes (the figure to compare);
#   2) "vllm": vLLM's own server on the same workload and client, c256 then c64 (its start compiles: ~60-90 s);
#   3) "traced" (>= 60 s left): rlserve again at c256 with the API's chunk trace, split timers, step trace and the
#      core's Triton JIT misses (lib.sh traced_stream), so every gap > 200 ms is placed (server- or client-side)
#      and any compile after ready is named.
# Workload (lib.sh stream_workload): 768 prompts 512 -> 256, ignore_eos, greedy, Qwen3-0.6B shape, dummy bf16.
# DRY_RUN=1: tiny-llama on the CPU (vLLM CPU from RLSERVE_VLLM_PYTHON / /work/vvenv when VLLM_DRY=1).
#   OUT_DIR=/tmp/x bash benchmarks/device/s22_stream.sh
NAME=s22_stream BUDGET=${BUDGET:-330}; source "$(dirname "$0")/lib.sh"
say "card: $CARD (BUDGET $BUDGET s); git $(git rev-parse --short HEAD 2>/dev/null)"
say "host: $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"
http_site
stream_workload 256,64
if [ "$(left)" -lt 40 ]; then say "skipped: $(left) s left of BUDGET=$BUDGET"; say "done"; exit 0; fi
touch "$OUT_DIR/start"
[ "$DRY_RUN" = 1 ] && L1=$(( $(left) / 3 )) || L1=$(( $(left) >= 200 ? 80 : $(left) / 2 ))
CONFIGS=("default=$C ${HTTP_SITE:+@PYTHONPATH=$HTTP_SITE:${PYTHONPATH:-$PWD}} $FLAGS")
STEM=vllm_bench_default stream_bench "$L1" "$MIN_STEPS"
say "stack (default): $(server_stacks)"
if [ "$DRY_RUN" = 1 ] && [ -z "${VLLM_DRY:-}" ]; then
  say "vLLM's server skipped in a dry run (VLLM_DRY=1 starts vLLM CPU: its compile takes 5-20 minutes here)"
elif [ "$DRY_RUN" != 1 ] && [ ! -f /tmp/vsite/env.sh ]; then
  say "vLLM's server skipped: not installed on this machine (/tmp/vsite/env.sh missing: the .v1-.v3 carry calls did not run)"
elif [ "$(left)" -ge 110 ] || [ "$DRY_RUN" = 1 ]; then
  touch "$OUT_DIR/start"
  CONFIGS=("vllm=$C vllm $VFLAGS")
  [ "$DRY_RUN" = 1 ] && L2=$(( $(left) / 2 )) || L2=$(( $(left) >= 170 ? 150 : $(left) - 5 ))
  STEM=vllm_bench_vllm stream_bench "$L2" "$MIN_STEPS"
else
  say "vLLM's server skipped: $(left) s left (< 110)"
fi
if [ "$(left)" -ge 60 ] || [ "$DRY_RUN" = 1 ]; then
  C="@conc=${C#@conc=}"; C=${C%%,*}  # c256 only
  traced_stream traced $(( $(left) - 4 ))
else
  say "traced skipped: $(left) s left (< 60)"
fi
say "done"
exit 0
