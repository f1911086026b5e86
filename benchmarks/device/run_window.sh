#!/usr/bin/env bash
# Runs device scripts back to back inside ONE device call, each under its own wall-clock budget.
#
#   bash benchmarks/device/run_window.sh NAME:BUDGET_S [NAME:BUDGET_S ...]
#
# runs the newest benchmarks/device/sNN_NAME.sh (the highest session number NN) with OUT_DIR=/tmp/win/NAME (a fresh folder) under `timeout BUDGET_S`,
# then kills whatever GPU process it left, and tars the folder into $OUT/NAME.tgz (the device tool returns at
# most 8 files per call: one tarball per script). rlserve's wheels (.whl, from ../shared/tools/device-wheels.sh)
# are installed into /tmp/site once per machine; /tmp survives between back-to-back calls on a warm machine.
# DRY_RUN=1 runs the same on CPU (no nvidia-smi needed).
set -u
cd "$(dirname "$0")/../.."
: "${OUT:=/tmp/win-out}"; mkdir -p "$OUT"
if [ -d .whl ] && [ ! -f /tmp/site/.rlserve-wheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.rlserve-wheels || echo "run_window: wheel install failed" | tee -a "$OUT/summary.txt"
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# the GPU image lacks rlserve's non-torch dependencies: fetch them with
#   ../shared/tools/device-wheels.sh uvloop httptools msgspec partial-json-parser ijson pyzmq
# (session 18's first window lost two scripts to a .whl without msgspec); say so at once, not per script
python3 -c "import fastapi, uvicorn, pydantic, msgspec, zmq, partial_json_parser, ijson" 2>&1 | tail -n 1 \
  | sed 's/^/run_window: missing dependency: /' | tee -a "$OUT/summary.txt"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/summary.txt"
fi
gpu_pids() { command -v nvidia-smi >/dev/null && nvidia-smi --query-compute-apps=pid --format=csv,noheader; }
for spec in "$@"; do
  name=${spec%%:*}; budget=${spec#*:}
  export OUT_DIR=/tmp/win/$name
  rm -rf "$OUT_DIR"; mkdir -p "$OUT_DIR"
  t0=$(date +%s)
  # the newest session's script of that name (sNN_NAME.sh with the highest NN)
  script=$(ls benchmarks/device/ | grep -E "^s[0-9]+_${name}\.sh$" | sed 's|^s\([0-9]*\)_.*|\1 benchmarks/device/&|' \
    | sort -n | tail -n 1 | cut -d' ' -f2)
  [ -n "$script" ] || { echo "$name: no benchmarks/device/s*_$name.sh" | tee -a "$OUT/summary.txt"; continue; }
  BUDGET=$budget timeout -k 10 "$budget" bash "$script" > "$OUT_DIR/stdout.log" 2>&1
  rc=$?
  pkill -9 -f 'vllm serve|-m rlserve serve|vllm.entrypoints|EngineCore' 2>/dev/null
  for p in $(gpu_pids); do kill -9 "$p" 2>/dev/null; done
  echo "$name rc=$rc wall=$(( $(date +%s) - t0 ))s budget=${budget}s" | tee -a "$OUT/summary.txt"
  tail -n 12 "$OUT_DIR/stdout.log"
  tar czf "$OUT/$name.tgz" -C /tmp/win "$name"
done
