#!/usr/bin/env bash
# Session 17, issue 37 (start17; budget $BUDGET, 120 s by default): `rlserve serve` of the dummy Qwen3-8B shape
# (tiny tokenizer, --max-model-len 2056), process start -> ready (benchmarks/startup_stop.py --reps 1
# --show-start-log --greedy-tokens 16), with the start-up phase log ("start-up: ... took X s" lines of the API
# and engine-core processes, rlserve/startup_log.py). Target: <= 15 s (session 16: 19.94 s cold).
#   C) cold Triton cache (a fresh TRITON_CACHE_DIR each, RLSERVE_TRITON_PRECOMPILE=1): baseline, then this tree
#   W) warm: the same directories again (each tree its own cold run's), this tree, then the baseline
#   then, while 30 s are left: W again (second warm pair)
# The baseline is this tree with session 17's start-up patch taken out again (s17_start_base.patch, applied in
# reverse to a copy in /tmp; `git apply -R`, else `patch -R`); where that fails, this tree alone.
# Every run's log: $OUT_DIR/serve_LABEL.{log,json}; summary.txt: ready, loading->engine ready, the phase lines.
# DRY_RUN=1: the tests' tiny Llama on the CPU (every step once).
NAME=s17_start BUDGET=${BUDGET:-120}; source "$(dirname "$0")/lib.sh"
say "card: $CARD; git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
if [ "$DRY_RUN" = 1 ]; then
  SHAPE=tiny-llama; DEV=cpu; SRV=(-- --max-model-len 256 --max-num-seqs 8); NEED=(60 30)
else
  SHAPE=qwen3-8b; DEV=cuda; SRV=(-- --max-model-len 2056); NEED=(45 30)
fi
NEW=$PWD
BASE=/tmp/s17_start_base
rm -rf "$BASE"; mkdir -p "$BASE"
cp -r rlserve tests benchmarks "$BASE"/ 2>/dev/null
PATCH=$NEW/benchmarks/device/s17_start_base.patch
if (cd "$BASE" && git apply -R "$PATCH" 2>"$OUT_DIR/base_patch.err") \
   || (cd "$BASE" && patch -s -R -p1 < "$PATCH" >>"$OUT_DIR/base_patch.err" 2>&1); then
  say "baseline: $BASE (this tree minus s17_start_base.patch)"
else
  say "baseline: patch did not apply ($(head -c 300 "$OUT_DIR/base_patch.err")): this tree alone"
  BASE=
fi
TC=/tmp/s17_start_triton
rm -rf "$TC"; mkdir -p "$TC/new" "$TC/base"

one() {  # LABEL TREE TRITON_DIR LIMIT
  local label=$1 tree=$2 tdir=$3 limit=$4
  if [ "$(left)" -lt "$limit" ]; then say "$label) skipped: $(left) s left"; return; fi
  TRITON_CACHE_DIR=$tdir RLSERVE_TRITON_PRECOMPILE=1 bounded "$limit" $PY "$NEW/benchmarks/startup_stop.py" \
    --reps 1 --device "$DEV" --shape "$SHAPE" --show-start-log --greedy-tokens 16 --checkout "$tree" \
    --json "$OUT_DIR/serve_$label.json" "${SRV[@]}" > "$OUT_DIR/serve_$label.log" 2>&1
  local rc=$?
  say "$label) rc=$rc $(grep -E ': ready [0-9.]+s' "$OUT_DIR/serve_$label.log" | cut -c1-160 | sed "s|$tree|tree|")"
  grep -E 'start-up: ' "$OUT_DIR/serve_$label.log" | sed -E 's/^ *(\+ *[0-9.]+s) .*start-up: /  \1 /' \
    | tee -a "$OUT_DIR/summary.txt"
  gpu_cleanup
}

[ -n "$BASE" ] && one C_base "$BASE" "$TC/base" "${NEED[0]}"
one C_new "$NEW" "$TC/new" "${NEED[0]}"
one W_new "$NEW" "$TC/new" "${NEED[1]}"
[ -n "$BASE" ] && one W_base "$BASE" "$TC/base" "${NEED[1]}"
one W2_new "$NEW" "$TC/new" "${NEED[1]}"
[ -n "$BASE" ] && one W2_base "$BASE" "$TC/base" "${NEED[1]}"

$PY - "$OUT_DIR" <<'PYEOF' | tee -a "$OUT_DIR/summary.txt"
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "serve_*.json"))):
    try:
        d = json.load(open(f))
        (tree, runs), = d["runs"].items()
        r = runs[0]
    except Exception as e:  # noqa: BLE001 -- cut or failed: its log says why
        print(f"{os.path.basename(f)}: none ({type(e).__name__})")
        continue
    print(f"{os.path.basename(f)[6:-5]:8s} ready {r['ready_s']:6.2f} s, loading->engine ready {r['load_s']:6.2f} s, "
          f"first request (16 tokens) {r.get('first_request_s') or float('nan'):.3f} s, tokens {r['tokens']}")
PYEOF
keep_logs
rm -rf "$TC" /tmp/s17_start_base
say done
exit 0
