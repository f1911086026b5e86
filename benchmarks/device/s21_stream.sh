#!/usr/bin/env bash
# Issue 37, session 21: where the c256 streams' > 200 ms inter-token gaps come from (budget ~150 s; BUDGET may be
# cut: every step adapts). Session 21's window 1 (main eda665a) measured p99 ITL 336 / 302 / 244 / 203 ms at c256
# (defaults / graphs 1024 / graphs 2048 / mixed) while the engine's own decode-to-decode gaps were 8-47 ms p99:
# something between the engine and the client. Each run here records, beside vLLM 0.24.0's `vllm bench serve`
# client with --save-detailed (every request's send time, TTFT and per-chunk gaps: benchmarks/stream_gaps.py
# places the long gaps by chunk index and time in the run):
#   - the API process's side (benchmarks/stream_trace.py): each stream's request arrival and the time and chunk
#     count of every body write, the event loop's late wake-ups, writes that waited on a paused transport; so each
#     client gap over 200 ms is server-side (the server's own gap between the same chunks was as long) or
#     client-side, and TTFT splits into send -> arrival -> first write -> client;
#   - the engine-core's Triton JIT cache misses during the run (a compile in the middle of serving stalls every
#     stream: window 1's default run had a 544 ms first prefill and an 891 ms prefill step at 86 running streams);
#   - the engine step trace (benchmarks/step_trace.py) and the client's full garbage collections
#     (benchmarks/vllm_bench_serve.py --gc-log).
# Runs, c256 only, 768 prompts 512 -> 256, ignore_eos, greedy, Qwen3-0.6B shape, dummy bf16 weights:
#   1) "default": main's defaults (piecewise prefill graphs on since session 21, 2,048-token budget while decoding)
#   2) and 3), while >= 45 s are left, in the order run 1 points to (more of its > 200 ms client gaps
#      client-side: "raw" first, else "h11" first):
#      "raw": the defaults with a client that costs almost nothing (benchmarks/raw_stream_bench.py: raw sockets, a
#      timestamp and an event count per read; 768 id prompts of 512 tokens -> 256, 256 streams): the server's ITL
#      without vLLM's Python client; "h11": RLSERVE_HTTP_IMPL=h11 (the asyncio + h11 stack of session 16, whose
#      c256 p99 ITL was 64 ms, before uvloop + httptools became the default in session 18)
#   4) "cgc": the defaults with vLLM's client's heap frozen (vllm_bench_serve.py --gc-freeze), then 5) "eager":
#      RLSERVE_PREFILL_CUDA_GRAPHS=0 (window 1's default), for its Triton JIT misses, each if >= 45 s are left
# The server side carries api_stream_probe's split timers (~0.3 us a timed call: ~2% of the API's loop at c256).
# rlserve only (vLLM's own server: window 1, 5,552 tok/s, ITL p99 61.9 ms). A dry run (DRY_RUN=1, CPU, tiny-llama,
# 24 prompts 300 -> 16 at @conc=8) runs the same steps.
#
#   OUT_DIR=/tmp/x bash benchmarks/device/s21_stream.sh
#   DRY_RUN=1 BUDGET=120 OUT_DIR=/tmp/x bash benchmarks/device/s21_stream.sh
# Results: $OUT_DIR/vllm_bench_<run>.{json,log} (per-request detail, generated texts dropped), gaps_<run>.json,
# chunks_<run>/ (the API and JIT traces), steps_<run>/, client_gc_<run>.txt, the servers' log tails; summary on stdout.
NAME=s21_stream BUDGET=${BUDGET:-150}; source "$(dirname "$0")/lib.sh"
say "card: $CARD (BUDGET $BUDGET s); git $(git rev-parse --short HEAD 2>/dev/null)"
# the host's CPU: the API process and the client are single-threaded Python, so the host sets their event rate
# (vLLM's own API-bound server made 8,225 tok/s at c256 in session 15's window and 5,552 in session 21's:
# window-to-window comparisons need the host's speed): model, cores, load, and one pure-Python timing
say "host: $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg);" \
    "pure Python: $($PY -c "import timeit; print(round(1e3 * min(timeit.repeat('sum(i * i for i in range(10000))', number=20, repeat=5)) / 20, 3))") ms per 10^4-term generator sum (min of 5)"
http_site
stream_workload 256
# the same with benchmarks/raw_stream_bench.py's client (NAME=raw), time limit $1
run_raw() {
  local n=raw d=$OUT_DIR/chunks_raw site raw=(--shape qwen3-0.6b --clients 256 --num-prompts 768 --max-tokens 256)
  [ "$DRY_RUN" = 1 ] && raw=(--shape tiny-llama --max-model-len 1024 --max-num-seqs 16 --clients 8 --num-prompts 24
                             --prompt-len 300 --max-tokens 16)
  mkdir -p "$d" "$OUT_DIR/steps_$n"
  site=$($PY -c "from benchmarks.stream_trace import site_dir; print(site_dir('$d'))")
  touch "$OUT_DIR/start"
  bounded "$1" $PY benchmarks/raw_stream_bench.py "${raw[@]}" --name raw --json "$OUT_DIR/vllm_bench_raw.json" \
      --words "@PYTHONPATH=$site:${HTTP_SITE:+$HTTP_SITE:}${PYTHONPATH:-$PWD} @STEP_TRACE_DIR=$OUT_DIR/steps_$n @STREAM_TRACE_DIR=$d @API_STREAM_PROBE_DIR=$d @API_STREAM_PROBE_SPLIT=1 @API_STREAM_PROBE_SLOW_MS=1000" \
      -- $FLAGS > "$OUT_DIR/vllm_bench_raw.log" 2>&1
  say "vllm_bench_raw rc=$? (limit $1 s): $(grep -h '(raw client)' "$OUT_DIR/vllm_bench_raw.log")"
  keep_logs
  gpu_cleanup
  $PY -c "import sys; from benchmarks.step_trace import summary_lines; print('\n'.join(summary_lines(sys.argv[1], sys.argv[2], int(sys.argv[3]))))" \
      "$OUT_DIR/steps_$n" "$n " "$MIN_STEPS" 2>&1 | tee -a "$OUT_DIR/summary.txt"
  say "stack ($n): $(server_stacks)"
  $PY benchmarks/stream_gaps.py "$OUT_DIR/vllm_bench_raw.json" --server "$d" --json "$OUT_DIR/gaps_raw.json" 2>&1 \
      | tee -a "$OUT_DIR/summary.txt"
}
if [ "$(left)" -lt 30 ]; then say "skipped: $(left) s left of BUDGET=$BUDGET"; say "done"; exit 0; fi
# 1) main's defaults (a server's start ~17 s, the run ~10 s, the client's import overlaps the start)
if [ "$DRY_RUN" = 1 ]; then L1=$(( $(left) / 3 )); else L1=$(( $(left) >= 100 ? 50 : $(left) - 5 )); fi
traced_stream default "$L1"
# 2), 3): the client-free arm first when run 1's long gaps were mostly client-side
ORDER=$($PY - "$OUT_DIR/gaps_default.json" <<'PYEOF' 2>/dev/null || echo "h11 raw"
import json, sys
a = json.load(open(sys.argv[1]))[0].get("attribution", {})
print("raw h11" if a.get("client-side", 0) > a.get("server-side", 0) else "h11 raw")
PYEOF
)
say "next runs: $ORDER (run 1's long gaps: $($PY -c "import json,sys; a=json.load(open(sys.argv[1]))[0].get('attribution',{}); print({k: v for k, v in a.items() if k != 'ttft_split_ms'})" "$OUT_DIR/gaps_default.json" 2>/dev/null))"
for arm in $ORDER cgc eager; do
  if [ "$(left)" -lt 45 ] && [ "$DRY_RUN" != 1 ]; then say "$arm skipped: $(left) s left (< 45)"; continue; fi
  [ "$DRY_RUN" = 1 ] && L=$(( $(left) / 3 )) || L=$(( $(left) >= 90 ? 45 : $(left) - 5 ))
  case $arm in
    cgc) traced_stream cgc "$L" -- --gc-freeze ;;
    h11) traced_stream h11 "$L" @RLSERVE_HTTP_IMPL=h11 ;;
    raw) run_raw "$L" ;;
    eager) traced_stream eager "$L" @RLSERVE_PREFILL_CUDA_GRAPHS=0 ;;
  esac
done
say "done"
exit 0
