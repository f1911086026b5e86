#!/usr/bin/env bash
# Session 21, issue 37 (start21; budget $BUDGET, 90 s by default): `rlserve serve` of the dummy Qwen3-8B shape
# (tiny tokenizer, --max-model-len 2056), process start -> ready, this tree against the tree before session 21's
# start-up change (s21_start_base.patch taken out again), with the start-up timeline (every "start-up: ... took"
# line of both processes, now with CPU seconds, the core's import parts, the API process's threads and its wait
# for the tokenizer after the core's ready message). Target: <= 15 s. The morning's H100 run (main eda665a,
# benchmarks/results/s21_w1/start): 29.12 s cold, 18.78 s warm; the core ready at 22.5 / 12.8 s, the API ~6 s later.
# Steps (each takes what is left; the later ones are cut first):
#   P) import profile (benchmarks/import_profile.py, -X importtime): this tree's engine-core and API imports,
#      both processes at once as at a start (<= 25 s): where the core's 10.6-13.8 s of imports go
#   S) starts, interleaved in one startup_stop.py call: this tree, base, this tree, base (as many as finish).
#      Triton's default cache (~/.triton/cache): the first start compiles what no earlier script left there
#      (the kernels' sources are the same in both trees), so base's start and this tree's second are the pair
#      to compare; RLSERVE_GPU_START_OVERLAP=1 in both (as s17_start.sh)
# Logs: $OUT_DIR/import_profile.{log,json}, serve_S.{log,json}; summary.txt: ready, first request, phase lines.
# DRY_RUN=1: the tests' tiny Llama on the CPU.
NAME=s21_start BUDGET=${BUDGET:-90}; source "$(dirname "$0")/lib.sh"
say "card: $CARD; git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
if [ "$DRY_RUN" = 1 ]; then
  SHAPE=tiny-llama; DEV=cpu; SRV=(-- --max-model-len 256 --max-num-seqs 8)
else
  SHAPE=qwen3-8b; DEV=cuda; SRV=(-- --max-model-len 2056)
fi
NEW=$PWD
export RLSERVE_GPU_START_OVERLAP=1 RLSERVE_TRITON_PRECOMPILE=1
base_tree "$NEW/benchmarks/device/s21_start_base.patch" /tmp/s21_start_base

# P) where the imports go (a model directory with the 8B shape's config and the tiny tokenizer for the API side)
MODEL=$($PY - "$SHAPE" <<'PYEOF'
import sys, tempfile
from benchmarks.model_shapes import save_shape
from tests.tiny_models import build_tokenizer, make_tiny_model
if sys.argv[1] == "tiny-llama":
    print(make_tiny_model("llama", tempfile.mkdtemp()))
else:
    d = save_shape(sys.argv[1], tempfile.mkdtemp()); build_tokenizer().save_pretrained(d); print(d)
PYEOF
)
bounded 25 $PY benchmarks/import_profile.py --side core --side api --device "$DEV" --parallel --model "$MODEL" \
  --top 20 --json "$OUT_DIR/import_profile.json" > "$OUT_DIR/import_profile.log" 2>&1
say "P) rc=$?"
grep -E "^\S+ (core|api):|by package|bytecode" "$OUT_DIR/import_profile.log" | cut -c1-700 | tee -a "$OUT_DIR/summary.txt"

# S) starts
co=(--checkout "$NEW"); [ -n "$BASE" ] && co+=(--checkout "$BASE")
if [ "$(left)" -ge 20 ]; then
  bounded $(( $(left) - 4 )) $PY "$NEW/benchmarks/startup_stop.py" --reps 2 --device "$DEV" --shape "$SHAPE" \
    --show-start-log --greedy-tokens 16 "${co[@]}" --json "$OUT_DIR/serve_S.json" "${SRV[@]}" \
    > "$OUT_DIR/serve_S.log" 2>&1
  say "S) rc=$?"
  start_lines "$OUT_DIR/serve_S.log" 260
else
  say "S) skipped: $(left) s left"
fi
gpu_cleanup
keep_logs
rm -rf /tmp/s21_start_base
say done
exit 0
