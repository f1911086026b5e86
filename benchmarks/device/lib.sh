# Shared preamble of the device scripts (benchmarks/device/s*_NAME.sh): `source` it after setting NAME and
# BUDGET (seconds), e.g.
#   NAME=s14_moe BUDGET=${BUDGET:-300}; source "$(dirname "$0")/lib.sh"
# It cds to the repository root and defines:
#   OUT_DIR (default /tmp/${NAME}_out, created), DRY_RUN (0/1), T0, PY (python3), CARD (nvidia-smi's
#   "name, memory.total", or "cpu (dry run)"; also written to $OUT_DIR/card.txt), MEM_MIB (the card's
#   memory in MiB, 0 in a dry run: for sizes that depend on the card)
#   left            seconds of BUDGET left
#   slot MAX KEEP   seconds for a step: at most MAX, leaving KEEP for the steps after it (at least 5)
#   say MSG...      a timestamped line to stdout and $OUT_DIR/summary.txt
#   bounded S CMD.. run CMD under `timeout -k 5 S` (S clipped to what is left minus 3 s; skipped, rc 124,
#                   when fewer than 5 s are left); returns CMD's status
#   start_bg LOG CMD...  start CMD in its own session (setsid), stdout+stderr to LOG; prints its PID
#   stop_bg PID     kill the process group of PID (TERM, then KILL after 5 s)
#   wait_http URL S poll URL until it answers 200 or S seconds pass; returns 0 when up
#   gpu_cleanup     kill -9 every process nvidia-smi still lists on the GPU
#   moe_kernel_rows TAG LOG  one summary line per row of benchmarks/moe_kernels.py's LOG (its JSON lines), to
#                   stdout and $OUT_DIR/summary.txt
#   keep_logs       copy the last 300 lines of every rlserve / vLLM server log in /tmp newer than this script's
#                   start ($OUT_DIR/start, touched here) into $OUT_DIR (a failed start says why there)
#   trace CONFIG    benchmarks/vllm_bench.py server words that run config CONFIG with the engine step trace
#                   (benchmarks/step_trace.py) into $OUT_DIR/steps_CONFIG
#   stream_bench LIMIT MIN_STEPS CONFIG...  benchmarks/vllm_bench.py --one-client over the caller's arrays ARGS
#                   (vllm_bench's own flags), CONFIGS (its --configs) and BENCH (`vllm bench serve` random-dataset
#                   flags; --ignore-eos --temperature 0 added) under `bounded LIMIT`, into $OUT_DIR/$STEM.{json,log}
#                   (STEM: default vllm_bench; set it to keep an earlier call's files);
#                   then keep_logs, gpu_cleanup, one summary line per run and the step-trace summaries of each
#                   CONFIG name (runs of MIN_STEPS steps at least)
#   throughput_pair TAG RCAP RKEEP VCAP VKEEP ARGS... [--vllm VLLM_ARGS...]
#                   benchmarks/throughput.py --engine rlserve --no-hf ARGS (under `slot RCAP RKEEP`), then
#                   --engine vllm ARGS VLLM_ARGS (under `slot VCAP VKEEP`, /tmp/vsite/env.sh sourced in a
#                   subshell; skipped in a dry run without VLLM_PYTHONPATH), each its own process: logs and JSON
#                   $OUT_DIR/throughput_{rlserve,vllm}.*, a summary line each ("TAG) ...") and rlserve / vLLM,
#                   both results in $OUT_DIR/throughput.json (benchmarks/device/throughput_summary.py)
#   k2_args         sets SHAPE, TP_ARGS and VLLM_ARGS to BENCHMARKS.md's K2 offline workload (Qwen3-0.6B shape, 256
#                   seqs, prompts and outputs 768..1280 tokens; vLLM from /tmp/vsite), tiny on the CPU in a dry run
#   kv_fp8_error TAG CAP  benchmarks/kv_fp8_error.py (BENCHMARKS.md's K3: fp8 vs bf16 cache, random Qwen3-0.6B shape;
#                   tiny on the CPU in a dry run) under `slot CAP 0`: $OUT_DIR/kv_fp8_error.{json,log}, summary lines
#   http_site       HTTP_SITE: a folder of links to /tmp/vsite's uvloop + httptools when $PY cannot import them (the
#                   servers' RLSERVE_HTTP_IMPL=auto stack; empty when .whl has them), with a line saying which
#   server_words CONFIG [ENV=V]  trace CONFIG's words with HTTP_SITE first on PYTHONPATH, plus the config's own @ENV=V
#   server_stacks   the HTTP stack each rlserve server since $OUT_DIR/start named in its log, oldest first
#   stream_workload CONC  issue 37's streaming workload for stream_bench at concurrency CONC (e.g. 256 or 256,64):
#                   sets ARGS, C (@conc=CONC), FLAGS (rlserve's flags: bf16, no access log, chunked prefill off),
#                   VFLAGS (vLLM's), BENCH (768 prompts 512 -> 256), MIN_STEPS; Qwen3-0.6B shape on the GPU, tiny-llama
#                   on the CPU in a dry run (300 -> 16 tokens, 24 prompts, @conc=8, budgets 256 / 128 tokens)
#   stream_limit CAP KEEP  LIMIT, the seconds of a first stream_bench pair: 300 in a dry run, else CAP when at least
#                   KEEP s are left (the steps after it keep theirs), else what is left minus 5
#   vllm_stream     vLLM's own server (VFLAGS) on stream_workload's workload and client: stream_bench into
#                   $OUT_DIR/vllm_bench_vllm.*, limited to what is left minus 4 s
#   base_tree PATCH DIR  BASE: a copy of this tree's rlserve, tests and benchmarks in DIR with PATCH (a diff of
#                   this tree's change) applied in reverse (`git apply -R`, else `patch -R`): the tree before the
#                   change, for an A/B in one run; BASE empty (this tree alone) where it does not apply, with a line
#                   saying why ($OUT_DIR/base_patch.err). A feature's own diff stops reversing once later commits
#                   touch its lines (session 23 found all three of its base patches broken): the base_REV.patch files
#                   are `git diff REV HEAD -- rlserve/` (base = main at REV); regenerate one after rlserve/ moves
#   start_lines LOG WIDTH  from benchmarks/startup_stop.py --show-start-log's LOG, one line per run (which tree:
#                   new = $NEW, base = $BASE; ready; first request) and that run's "start-up: ... took" lines, cut to
#                   WIDTH characters, to stdout and $OUT_DIR/summary.txt
#   serve_start LABEL LIMIT  one `rlserve serve` of shape $S8 on device $DEV (extra flags: the array SRV, starting
#                   with --) start -> ready -> 16 greedy tokens -> SIGINT (benchmarks/startup_stop.py
#                   --show-start-log), bounded by LIMIT s: $OUT_DIR/serve_LABEL.{json,log}, a summary line
#   traced_stream RUN LIMIT [WORDS...] [-- CLIENT_FLAGS...]  one rlserve server (config RUN: $C, WORDS = @ENV=V /
#                   flags, $FLAGS) on stream_workload's workload under stream_bench LIMIT, with the API process's chunk
#                   trace and split timers (benchmarks/stream_trace.py, api_stream_probe; $OUT_DIR/chunks_RUN/), the
#                   engine step trace ($OUT_DIR/steps_RUN/), the client's per-request detail (--save-detailed) and full
#                   collections (client_gc_RUN.txt); then benchmarks/stream_gaps.py's attribution of the long gaps
#                   (gaps_RUN.json) and the client's JSON without its generated texts
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
: "${NAME:?set NAME before sourcing lib.sh}"
: "${BUDGET:?set BUDGET before sourcing lib.sh}"
: "${OUT_DIR:=/tmp/${NAME}_out}"; mkdir -p "$OUT_DIR"
DRY_RUN=${DRY_RUN:-0}
T0=$(date +%s)
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
say() { echo "[$NAME +$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT_DIR/summary.txt"; }
bounded() {
  local s=$1; shift
  local l=$(( $(left) - 3 ))
  [ "$s" -gt "$l" ] && s=$l
  if [ "$s" -lt 5 ]; then say "skipped (budget): $*"; return 124; fi
  timeout -k 5 "$s" "$@"
}
slot() { local l; l=$(( $(left) - $2 )); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
start_bg() { local log=$1; shift; setsid "$@" > "$log" 2>&1 & echo $!; }
stop_bg() {
  local pid=$1
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null
  for _ in 1 2 3 4 5; do kill -0 "$pid" 2>/dev/null || return 0; sleep 1; done
  kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null
  return 0
}
wait_http() {
  local url=$1 s=$2 t=$(date +%s)
  while [ $(( $(date +%s) - t )) -lt "$s" ]; do
    $PY - "$url" <<'PYEOF' 2>/dev/null && return 0
import sys, urllib.request
sys.exit(0 if urllib.request.urlopen(sys.argv[1], timeout=2).status == 200 else 1)
PYEOF
    sleep 1
  done
  return 1
}
touch "$OUT_DIR/start"
keep_logs() {
  for f in $(find /tmp -maxdepth 1 \( -name 'rlserve-server-*.log' -o -name 'vllm-serve-*.log' \) -newer "$OUT_DIR/start" 2>/dev/null); do
    tail -n 300 "$f" > "$OUT_DIR/$(basename "$f")"
  done
}
trace() {  # the step trace's site first on PYTHONPATH, its directory
  local d=$OUT_DIR/steps_$1 site
  mkdir -p "$d"
  site=$($PY -c "from benchmarks.step_trace import site_dir; print(site_dir('$d'))")
  echo "@PYTHONPATH=$site:${PYTHONPATH:-$PWD} @STEP_TRACE_DIR=$d"
}
stream_bench() {
  local limit=$1 min=$2 c stem=${STEM:-vllm_bench}; shift 2
  bounded "$limit" $PY benchmarks/vllm_bench.py "${ARGS[@]}" --one-client --configs "${CONFIGS[@]}" \
      --json "$OUT_DIR/$stem.json" \
      -- --backend vllm --dataset-name random "${BENCH[@]}" --ignore-eos --temperature 0 > "$OUT_DIR/$stem.log" 2>&1
  say "$stem rc=$? (limit $limit s)"
  keep_logs
  gpu_cleanup
  $PY -c "import sys; from benchmarks.vllm_bench import summary_lines; print('\n'.join(summary_lines(sys.argv[1])))" \
      "$OUT_DIR/$stem.json" | tee -a "$OUT_DIR/summary.txt"
  for c in "$@"; do
    $PY -c "import sys; from benchmarks.step_trace import summary_lines; print('\n'.join(summary_lines(sys.argv[1], sys.argv[2], int(sys.argv[3]))))" \
        "$OUT_DIR/steps_$c" "$c " "$min" 2>&1 | tee -a "$OUT_DIR/summary.txt"
  done
}
gpu_cleanup() {
  command -v nvidia-smi >/dev/null || return 0
  for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
}
moe_kernel_rows() {
  grep -E '^\{' "$2" | $PY -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l)
    print(f\"$1) T={r['T']:5d} {r['path']:40s} graph {r.get('graph_us', 0):8.1f} us  floor {r['floor_us']:7.1f}  \"
          f\"diff {r.get('max_abs_diff_vs_triton', '-')} {r.get('error', '')}\")" | tee -a "$OUT_DIR/summary.txt"
}
throughput_pair() {
  local tag=$1 rcap=$2 rkeep=$3 vcap=$4 vkeep=$5 t; shift 5
  local args=() vargs=()
  while [ $# -gt 0 ] && [ "$1" != --vllm ]; do args+=("$1"); shift; done
  [ $# -gt 0 ] && shift && vargs=("$@")
  t=$(slot "$rcap" "$rkeep")
  timeout -k 5 "$t" $PY benchmarks/throughput.py --engine rlserve --no-hf "${args[@]}" \
    --json "$OUT_DIR/throughput_rlserve.json" > "$OUT_DIR/throughput_rlserve.log" 2>&1
  say "$tag) rlserve rc=$? ($t s limit): $(grep -E '^  rlserve ' "$OUT_DIR/throughput_rlserve.log" | tr -s ' ')"
  if [ "$DRY_RUN" = 1 ] && [ -z "${VLLM_PYTHONPATH:-}" ]; then
    say "$tag) vllm skipped (dry run without VLLM_PYTHONPATH)"
  else
    t=$(slot "$vcap" "$vkeep")
    # vLLM's own environment only in this subshell (env.sh: offline, no flashinfer sampler); the child
    # that runs vLLM gets PYTHONPATH=/tmp/vsite alone (throughput.run_vllm)
    ( [ -f /tmp/vsite/env.sh ] && source /tmp/vsite/env.sh
      timeout -k 5 "$t" $PY benchmarks/throughput.py --engine vllm --no-hf "${args[@]}" "${vargs[@]}" \
        --json "$OUT_DIR/throughput_vllm.json" ) > "$OUT_DIR/throughput_vllm.log" 2>&1
    say "$tag) vllm rc=$? ($t s limit): $(grep -E '^  vllm' "$OUT_DIR/throughput_vllm.log" | tr -s ' ')"
    # the KV lines, and kv_cache_dtype's value alone (it sits in vLLM's one-line engine config)
    say "$tag) vllm KV: $( { grep -E 'GPU KV cache size|Available KV cache memory' "$OUT_DIR/throughput_vllm.log" \
      | sed 's/.*\] //' | head -2; grep -oE 'kv_cache_dtype=[A-Za-z0-9_]+' "$OUT_DIR/throughput_vllm.log" \
      | head -1; } | tr '\n' ' ')"
  fi
  $PY benchmarks/device/throughput_summary.py "$OUT_DIR" "$CARD" "$tag)" 2>&1 | tee -a "$OUT_DIR/summary.txt"
}
k2_args() {
  if [ "$DRY_RUN" = 1 ]; then
    SHAPE=tiny-llama
    TP_ARGS=(--device cpu --num-seqs 4 --min-len 8 --max-len 16 --max-num-seqs 4)
    VLLM_ARGS=(--vllm-pythonpath "${VLLM_PYTHONPATH:-/nonexistent}")
  else
    SHAPE=qwen3-0.6b
    TP_ARGS=(--device cuda --num-seqs 256 --min-len 768 --max-len 1280)
    VLLM_ARGS=(--vllm-pythonpath /tmp/vsite)
  fi
}
kv_fp8_error() {
  local t err=(--shape qwen3-0.6b --kv auto,fp8 --num-prompts 8 --min-len 512 --max-len 2048 --gen 32)
  [ "$DRY_RUN" = 1 ] && err=(--shape tiny-llama --device cpu --num-prompts 2 --min-len 8 --max-len 16 --gen 4)
  t=$(slot "$2" 0)
  timeout -k 5 "$t" $PY benchmarks/kv_fp8_error.py "${err[@]}" --json "$OUT_DIR/kv_fp8_error.json" \
    > "$OUT_DIR/kv_fp8_error.log" 2>&1
  say "$1) error rc=$? ($t s limit)"
  grep -E ' vs auto: ' "$OUT_DIR/kv_fp8_error.log" | sed "s/^/$1) /" | tee -a "$OUT_DIR/summary.txt"
}
serve_start() {
  bounded "$2" $PY benchmarks/startup_stop.py --reps 1 --device "$DEV" --shape "$S8" --show-start-log \
    --greedy-tokens 16 --json "$OUT_DIR/serve_$1.json" "${SRV[@]}" > "$OUT_DIR/serve_$1.log" 2>&1
  local rc=$?
  say "$1) rc=$rc $(grep -E '^\.: ready' "$OUT_DIR/serve_$1.log" | cut -c1-400)"
  gpu_cleanup
}
http_site() {
  HTTP_SITE=""
  $PY -c "import uvloop, httptools" 2>/dev/null && return 0
  HTTP_SITE=$OUT_DIR/http_site; mkdir -p "$HTTP_SITE"
  for m in uvloop httptools; do [ -d "/tmp/vsite/$m" ] && ln -sfn "/tmp/vsite/$m" "$HTTP_SITE/$m"; done
  PYTHONPATH=$HTTP_SITE:${PYTHONPATH:-} $PY -c "import uvloop, httptools" 2>/dev/null \
    && say "uvloop + httptools from /tmp/vsite (not in .whl)" \
    || say "WARNING: uvloop / httptools do not import: the servers run asyncio+h11"
}
server_words() {
  local words
  words=$(trace "$1")
  [ -n "${HTTP_SITE:-}" ] && words=${words/@PYTHONPATH=/@PYTHONPATH=$HTTP_SITE:}
  echo "$words${2:+ @$2}"
}
server_stacks() {
  local f logs
  logs=$(find /tmp -maxdepth 1 -name 'rlserve-server-*.log' -newer "$OUT_DIR/start" 2>/dev/null)
  [ -z "$logs" ] && return 0
  for f in $(ls -tr $logs); do
    grep -h -m1 "HTTP: uvicorn on" "$f" | sed 's/.*HTTP: uvicorn on //' | tr '\n' ' '
  done
}
stream_limit() {
  if [ "$DRY_RUN" = 1 ]; then LIMIT=300; else LIMIT=$(( $(left) >= $2 ? $1 : $(left) - 5 )); fi
}
vllm_stream() {
  CONFIGS=("vllm=$C vllm $VFLAGS")
  STEM=vllm_bench_vllm stream_bench $(( $(left) - 4 )) "$MIN_STEPS"
}
stream_workload() {
  if [ "$DRY_RUN" = 1 ]; then
    ARGS=(--shape tiny-llama --vllm-python "${RLSERVE_VLLM_PYTHON:-/work/vvenv/bin/python}" --max-model-len 1024
          --max-num-seqs 16 --bench-timeout 300)
    C="@conc=8"
    FLAGS="--max-num-batched-tokens 256 --max-prefill-tokens-while-decoding 128 --disable-access-log --no-enable-chunked-prefill"
    VFLAGS="--max-model-len 1024 --max-num-seqs 16 --gpu-memory-utilization 0.1"  # vLLM CPU: the share of host memory it takes
    BENCH=(--random-input-len 300 --random-output-len 16 --num-prompts 24); MIN_STEPS=5
  else
    [ -f /tmp/vsite/env.sh ] || say "WARNING: /tmp/vsite/env.sh missing (vLLM not installed): the client will fail"
    ARGS=(--shape qwen3-0.6b --bench-timeout 60)
    C="@conc=$1"; FLAGS="--dtype bfloat16 --disable-access-log --no-enable-chunked-prefill"
    VFLAGS="--dtype bfloat16 --attention-backend FLASH_ATTN --disable-uvicorn-access-log"
    BENCH=(--random-input-len 512 --random-output-len 256 --num-prompts 768); MIN_STEPS=50
  fi
}
if [ "$DRY_RUN" = 1 ] || ! command -v nvidia-smi >/dev/null; then
  CARD="cpu (dry run)"; MEM_MIB=0
else
  CARD=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1)
  MEM_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | tr -d ' ')
fi
echo "$CARD" > "$OUT_DIR/card.txt"
base_tree() {
  local patch=$1
  BASE=$2
  rm -rf "$BASE"; mkdir -p "$BASE"
  cp -r rlserve tests benchmarks "$BASE"/ 2>/dev/null
  if (cd "$BASE" && git apply -R "$patch" 2>"$OUT_DIR/base_patch.err") \
     || (cd "$BASE" && patch -s -R -p1 < "$patch" >>"$OUT_DIR/base_patch.err" 2>&1); then
    say "baseline: $BASE (this tree minus $(basename "$patch"))"
  else
    say "baseline: patch did not apply ($(head -c 300 "$OUT_DIR/base_patch.err")): this tree alone"
    BASE=
  fi
}
start_lines() {
  sed -E -e "s|^$NEW: |new: |" -e "s|^${BASE:-/nonexistent}: |base: |" "$1" \
    | grep -E '^(new|base): ready|start-up: ' \
    | sed -E -e 's/^ *(\+ *[0-9.]+s) .*start-up: /  \1 /' -e 's/, stop .*first request/, first request/' \
    | cut -c1-"$2" | tee -a "$OUT_DIR/summary.txt"
}
traced_stream() {
  local n=$1 lim=$2 d=$OUT_DIR/chunks_$1 site words=() client=() saved=("${BENCH[@]}")
  shift 2
  while [ $# -gt 0 ] && [ "$1" != -- ]; do words+=("$1"); shift; done
  [ $# -gt 0 ] && shift && client=("$@")
  mkdir -p "$d" "$OUT_DIR/steps_$n"
  site=$($PY -c "from benchmarks.stream_trace import site_dir; print(site_dir('$d'))")
  touch "$OUT_DIR/start"
  CONFIGS=("$n=$C @PYTHONPATH=$site:${HTTP_SITE:+$HTTP_SITE:}${PYTHONPATH:-$PWD} @STEP_TRACE_DIR=$OUT_DIR/steps_$n @STREAM_TRACE_DIR=$d @API_STREAM_PROBE_DIR=$d @API_STREAM_PROBE_SPLIT=1 @API_STREAM_PROBE_SLOW_MS=1000 ${words[*]} $FLAGS")
  BENCH+=(--save-detailed --gc-log "$OUT_DIR/client_gc_$n.txt" "${client[@]}")
  STEM=vllm_bench_$n stream_bench "$lim" "$MIN_STEPS" "$n"
  BENCH=("${saved[@]}")
  say "stack ($n): $(server_stacks)"
  $PY benchmarks/stream_gaps.py "$OUT_DIR/vllm_bench_$n.json" --server "$d" --client-gc "$OUT_DIR/client_gc_$n.txt" \
      --json "$OUT_DIR/gaps_$n.json" 2>&1 | tee -a "$OUT_DIR/summary.txt"
  $PY - "$OUT_DIR/vllm_bench_$n.json" <<'PYEOF' 2>/dev/null  # the texts are most of the file and say nothing here
import json, sys
d = json.load(open(sys.argv[1]))
for r in d.get("rows", []):
    (r.get("result") or {}).pop("generated_texts", None)
json.dump(d, open(sys.argv[1], "w"))
PYEOF
}
