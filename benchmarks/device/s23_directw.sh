#!/usr/bin/env bash
# Issue 37, session 23 (DIRECTW): rlserve's streams at 256 clients with a plain stream's middle SSE chunks written
# to the transport from the per-step output callback (rlserve/server/direct_write.py) against the tree before that
# change: the base is main at 9f8b2e0 (session 22's end: base_9f8b2e0.patch, the diff of rlserve/ from there to
# main at session 23's end, taken out again; so the pair measures all of session 23's API changes: admission, direct
# writes, unfinished outputs' views, --api-server-count's routing at N = 1), IN THE SAME CALL, interleaved: new, base, new, base (as many
# as the budget finishes). What to read: output tok/s, p99 ITL and TTFT per run (vLLM 0.24.0's own server did
# 46-62 ms p99 ITL on this workload in sessions 15-22; rlserve main 56-250 ms), and the API process's CPU per
# event where vllm_bench.py reports it. On the CPU (2-core Xeon, fake core) the change took the API process's
# CPU per event from ~59-63 to ~41-52 us (BENCHMARKS.md, H31).
# Workload (lib.sh stream_workload): 768 prompts 512 -> 256, ignore_eos, greedy, Qwen3-0.6B shape, dummy bf16.
# Budget ~330 s (BUDGET); each server start ~30-60 s on an H100.
# DRY_RUN=1: tiny-llama on the CPU (vLLM's client from RLSERVE_VLLM_PYTHON / /work/vvenv).
#   OUT_DIR=/tmp/x DRY_RUN=1 bash benchmarks/device/s23_directw.sh
NAME=s23_directw BUDGET=${BUDGET:-330}; source "$(dirname "$0")/lib.sh"
say "card: $CARD (BUDGET $BUDGET s); git $(git rev-parse --short HEAD 2>/dev/null)"
say "host: $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"
http_site
stream_workload 256
base_tree "$PWD/benchmarks/device/base_9f8b2e0.patch" /tmp/s23_directw_base
touch "$OUT_DIR/start"
PP="${HTTP_SITE:+@PYTHONPATH=$HTTP_SITE:${PYTHONPATH:-$PWD}}"
CONFIGS=("new=$C $PP $FLAGS")
if [ -n "$BASE" ]; then
  CONFIGS+=("base=$C @tree=$BASE $PP $FLAGS" "new2=$C $PP $FLAGS" "base2=$C @tree=$BASE $PP $FLAGS")
fi
STEM=vllm_bench_directw stream_bench $(( $(left) - 5 )) "$MIN_STEPS"
say "stack: $(server_stacks)"
say "done"
exit 0
