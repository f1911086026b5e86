#!/usr/bin/env bash
# Session 18, fix18 item 10 (budget $BUDGET, 150 s by default): session 17 saw a first level-1 sleep take 20.1 s
# on a busy machine with --batch-invariant (1.4 s on another server); not reproduced on the CPU (tiny Llama,
# 0.6-0.8 s first, 0.4 s later, either config; the server's own part 0.05-0.15 s). Here on the GPU:
# benchmarks/sleep_time.py, dummy Qwen3-1.7B shape (the 3.4 GB host copy of BENCHMARKS Z1), one server per
# config (default, --batch-invariant), interleaved, 2 rounds of POST /sleep?level=1 + POST /wake_up each.
# Where the time goes, per server (summary.txt): the client's seconds per call; the API's "asleep (level 1) ...
# in X s" (pause + abort + the cores' sleep); the core's "sleep level 1 ... in Y s"; the worker's "sleep: ...
# offloaded: host buffer A s (new), copy B s, unmap C s" (A: the first sleep's page-locked buffer).
# X >> Y: the time is before the core's sleep (the pause, or the core busy in a step); A large: the pinning.
# DRY_RUN=1: the tests' tiny Llama on the CPU.
NAME=s18_fix18 BUDGET=${BUDGET:-150}; source "$(dirname "$0")/lib.sh"
say "card: $CARD; git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
if [ "$DRY_RUN" = 1 ]; then
  ARGS=(--device cpu); REPS=1
else
  ARGS=(--device cuda --shape qwen3-1.7b --max-model-len 1024); REPS=1
  [ "$BUDGET" -ge 280 ] && REPS=2
fi
bounded $(( $(left) - 5 )) $PY benchmarks/sleep_time.py "${ARGS[@]}" --reps "$REPS" --rounds 2 \
    --json "$OUT_DIR/sleep_time.json" > "$OUT_DIR/sleep_time.log" 2>&1
say "sleep_time rc=$? (reps $REPS)"
keep_logs
gpu_cleanup
$PY - "$OUT_DIR/sleep_time.json" <<'PYEOF' 2>&1 | tee -a "$OUT_DIR/summary.txt"
import json, sys
try:
    rows = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(f"no rows: {e}")
for r in rows:
    print(f"{r['config']} rep {r['rep']}: " + (r.get("error") or " | ".join(
        f"sleep {x['sleep_s']:.3f} s wake {x['wake_s']:.3f} s" for x in r["rounds"]) + f" (load {r['load_avg']})"))
    for line in r.get("server_lines", []):
        print("   ", line[24:200])
PYEOF
