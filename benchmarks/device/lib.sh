# Shared preamble of the device scripts (benchmarks/device/s*_NAME.sh): `source` it after setting NAME and
# BUDGET (seconds), e.g.
#   NAME=s14_moe BUDGET=${BUDGET:-300}; source "$(dirname "$0")/lib.sh"
# It cds to the repository root and defines:
#   OUT_DIR (default /tmp/${NAME}_out, created), DRY_RUN (0/1), T0, PY (python3), CARD (nvidia-smi's
#   "name, memory.total", or "cpu (dry run)"; also written to $OUT_DIR/card.txt)
#   left            seconds of BUDGET left
#   say MSG...      a timestamped line to stdout and $OUT_DIR/summary.txt
#   bounded S CMD.. run CMD under `timeout -k 5 S` (S clipped to what is left minus 3 s; skipped, rc 124,
#                   when fewer than 5 s are left); returns CMD's status
#   start_bg LOG CMD...  start CMD in its own session (setsid), stdout+stderr to LOG; prints its PID
#   stop_bg PID     kill the process group of PID (TERM, then KILL after 5 s)
#   wait_http URL S poll URL until it answers 200 or S seconds pass; returns 0 when up
#   gpu_cleanup     kill -9 every process nvidia-smi still lists on the GPU
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
gpu_cleanup() {
  command -v nvidia-smi >/dev/null || return 0
  for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
}
if [ "$DRY_RUN" = 1 ] || ! command -v nvidia-smi >/dev/null; then
  CARD="cpu (dry run)"
else
  CARD=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1)
fi
echo "$CARD" > "$OUT_DIR/card.txt"
