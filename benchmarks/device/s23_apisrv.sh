#!/usr/bin/env bash
# Issue 37, session 23 (APISRV): `rlserve serve --api-server-count N` (rlserve/server/multi_api.py) at 256 streaming
# clients, N = 1, 2, 4, one server each, then N = 1 again when time is left (the same-run baseline at both ends: the
# host's own drift). On the CPU one API process saturated at ~58 us of CPU per streamed event (BENCHMARKS.md H29)
# and the H100 engine makes ~26,000 events/s at c256; the question here is whether N > 1 raises output tok/s and
# lowers the p99 inter-token latency on the GPU host. Budget ~330 s, each step adapts to what is left.
# Workload (lib.sh stream_workload): 768 prompts 512 -> 256, ignore_eos, greedy, Qwen3-0.6B shape, dummy bf16,
# `vllm bench serve`'s client (one client process per server, --one-client).
# DRY_RUN=1: tiny-llama on the CPU (24 prompts 300 -> 16 at c8).
#   OUT_DIR=/tmp/x DRY_RUN=1 bash benchmarks/device/s23_apisrv.sh
NAME=s23_apisrv BUDGET=${BUDGET:-330}; source "$(dirname "$0")/lib.sh"
say "card: $CARD (BUDGET $BUDGET s); git $(git rev-parse --short HEAD 2>/dev/null)"
say "host: $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"
http_site
stream_workload 256
if [ "$(left)" -lt 40 ]; then say "skipped: $(left) s left of BUDGET=$BUDGET"; say "done"; exit 0; fi
SITE="${HTTP_SITE:+@PYTHONPATH=$HTTP_SITE:${PYTHONPATH:-$PWD}}"
run() {  # run NAME N LIMIT: one server with --api-server-count N under stream_bench LIMIT
  touch "$OUT_DIR/start"
  CONFIGS=("$1=$C $SITE $FLAGS --api-server-count $2")
  STEM=vllm_bench_$1 stream_bench "$3" "$MIN_STEPS"
  [ "$2" -gt 1 ] || return 0
  local line; line=$(grep -h "API servers 1\.\.$(( $2 - 1 )) started" \
                     $(find "$OUT_DIR" -name 'rlserve-server-*.log' -newer "$OUT_DIR/start") /dev/null | head -1)
  say "$1: ${line:-no API-servers-started line in the server logs of this run}"
}
# a start takes ~60-90 s on the GPU host; each run gets a quarter of what is left, the last the rest
for step in "n1 1" "n2 2" "n4 4" "n1b 1"; do
  set -- $step
  if [ "$1" = n1b ]; then
    [ "$(left)" -ge 90 ] || [ "$DRY_RUN" = 1 ] || { say "n1b skipped: $(left) s left (< 90)"; break; }
    L=$(( $(left) - 4 ))
  else
    [ "$(left)" -ge 40 ] || { say "$1 skipped: $(left) s left (< 40)"; continue; }
    L=$(( $(left) / 3 )); [ "$L" -lt 90 ] && [ "$(left)" -ge 94 ] && L=90
  fi
  run "$1" "$2" "$L"
done
say "done"
exit 0
