#!/usr/bin/env bash
# Issue 37, session 23 (APISRV): `rlserve serve --api-server-count N` (rlserve/server/multi_api.py) at 256 streaming
# clients, N = 1, 2, 4, one server each, then N = 1 again when time is left (the same-run baseline at both ends: the
# host's own drift). On the CPU one API process saturated at ~58 us of CPU per streamed event (BENCHMARKS.md H29)
# and the H100 engine makes ~26,000 events/s at c256; the question here is whether N > 1 raises output tok/s and
# lowers the p99 inter-token latency on the GPU host. Budget ~330 s, each step adapts to what is left.
# Workload (lib.sh stream_workload): 768 prompts 512 -> 256, ignore_eos, greedy, Qwen3-0.6B shape, dummy bf16,
# `vllm bench serve`'s client (one client process per server, --one-client).
# DRY_RUN=1: tiny-llama on the CPU (24 prompts 300 -> 16 at c8); give it BUDGET=1000.
#   OUT_DIR=/tmp/x DRY_RUN=1 BUDGET=1000 bash benchmarks/device/s23_apisrv.sh
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
# one run ~80 s on the GPU host (start, 768 requests at c256; s22_stream.sh's figure): n1 and n2 get up to 90 s
# each, n4 up to 100 (its three more API processes start beside), n1b what is left if >= 85 s; a dry run on the
# 2-core CPU needs ~200 s a run (four API processes importing torch at once: n4 took over 136 s to start at load 9)
[ "$DRY_RUN" = 1 ] && CAP=240 || CAP=90
run n1 1 "$(slot $CAP $(( 2 * CAP + 10 )))"
run n2 2 "$(slot $CAP $(( CAP + 10 )))"
run n4 4 "$(slot $(( CAP + 10 )) 0)"
if [ "$(left)" -ge $(( CAP - 5 )) ]; then run n1b 1 $(( $(left) - 4 )); else say "n1b skipped: $(left) s left"; fi
say "done"
exit 0
