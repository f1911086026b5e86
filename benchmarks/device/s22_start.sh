#!/usr/bin/env bash
# Session 22, issue 37 (start22; budget $BUDGET, 150 s by default; `run_window.sh start:180` leaves step B its time): `rlserve serve` of the dummy Qwen3-8B shape
# (tiny tokenizer, --max-model-len 2056), process start -> ready, this tree against the tree before session 22's
# start-up change: the base is main at 4494894 (session 22's start; base_4494894.patch, the diff of rlserve/ from
# there to main at session 23's end, taken out again), so it also lacks session 22-23's other rlserve changes: the
# engine-core process loading its tokenizer, and so transformers' tokenizer classes, before ready, is the start-up one. Target: <= 15 s; session 21's H100 run (T12): 15.11 s, the core's
# imports 9.47 s (engine modules 5.99 s, of which `from transformers import AutoTokenizer` 5.6 s cumulative).
# What to expect: with transformers 5.17 (that image) the model's config module imports `auto_factory` ->
# `GenerationMixin` anyway (its @auto_docstring reads `modeling_auto`), so most of those 5.6 s move to the
# "transformers configs" part; the cut is the tokenizer classes and the core's own tokenizer load (this run says how
# much it is on the H100).
# Steps (each takes what is left; the later ones are cut first):
#   P) import profile (benchmarks/import_profile.py, -X importtime): both trees' engine-core and API imports, both
#      processes at once as at a start, one round each (<= 60 s): the core's parts, CPU, and bytecode state
#   S) starts, interleaved in one startup_stop.py call: this tree, base, this tree, base (as many as finish),
#      RLSERVE_GPU_START_OVERLAP=1 in both (as s21_start.sh); the first start may compile Triton kernels no earlier
#      script left in ~/.triton/cache (the kernels' sources are the same in both trees): compare base with this
#      tree's second start
#   B) (if >= 30 s left) this tree's core imports twice with PYTHONPYCACHEPREFIX and bytecode writing on: what
#      caching the packages' .pyc would save on that image (the first round writes them, the second reads)
# Logs: $OUT_DIR/import_profile.{log,json}, serve_S.{log,json}, import_profile_pycache.{log,json}; summary.txt: ready, first request, phase lines.
# DRY_RUN=1: the tests' tiny Llama on the CPU.
NAME=s22_start BUDGET=${BUDGET:-150}; source "$(dirname "$0")/lib.sh"
say "card: $CARD; git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
if [ "$DRY_RUN" = 1 ]; then
  SHAPE=tiny-llama; DEV=cpu; SRV=(-- --max-model-len 256 --max-num-seqs 8)
else
  SHAPE=qwen3-8b; DEV=cuda; SRV=(-- --max-model-len 2056)
fi
NEW=$PWD
export RLSERVE_GPU_START_OVERLAP=1 RLSERVE_TRITON_PRECOMPILE=1
base_tree "$NEW/benchmarks/device/base_4494894.patch" /tmp/s22_start_base
$PY -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)" 2>&1 \
  | tail -n 1 | tee -a "$OUT_DIR/summary.txt"

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
co=(--checkout "$NEW"); [ -n "$BASE" ] && co+=(--checkout "$BASE")
bounded 60 $PY benchmarks/import_profile.py --side core --side api --device "$DEV" --parallel --model "$MODEL" \
  --top 20 "${co[@]}" --json "$OUT_DIR/import_profile.json" > "$OUT_DIR/import_profile.log" 2>&1
say "P) rc=$?"
grep -E "^\S+ (core|api):|by package|bytecode|^summary" "$OUT_DIR/import_profile.log" | cut -c1-700 \
  | tee -a "$OUT_DIR/summary.txt"

# S) starts
if [ "$(left)" -ge 20 ]; then
  bounded $(( $(left) - 4 )) $PY "$NEW/benchmarks/startup_stop.py" --reps 2 --device "$DEV" --shape "$SHAPE" \
    --show-start-log --greedy-tokens 16 "${co[@]}" --json "$OUT_DIR/serve_S.json" "${SRV[@]}" \
    > "$OUT_DIR/serve_S.log" 2>&1
  say "S) rc=$?"
  start_lines "$OUT_DIR/serve_S.log" 260
else
  say "S) skipped: $(left) s left"
fi
# B) what bytecode caching would give on this image (PYTHONDONTWRITEBYTECODE=1 there, no .pyc for torch, sympy,
#    triton, rlserve): this tree's core imports twice with a pycache prefix and bytecode writing on (the first
#    round writes the .pyc, the second reads them); compare with P)'s core line
if [ "$(left)" -ge 30 ]; then
  rm -rf /tmp/s22_pycache
  bounded $(( $(left) - 4 )) env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=/tmp/s22_pycache \
    $PY benchmarks/import_profile.py --side core --device "$DEV" --rounds 2 --top 10 \
    --json "$OUT_DIR/import_profile_pycache.json" > "$OUT_DIR/import_profile_pycache.log" 2>&1
  say "B) rc=$?"
  grep -E "^\S+ core:|bytecode|^summary" "$OUT_DIR/import_profile_pycache.log" | cut -c1-400 | tee -a "$OUT_DIR/summary.txt"
  rm -rf /tmp/s22_pycache
else
  say "B) skipped: $(left) s left"
fi
gpu_cleanup
keep_logs
rm -rf /tmp/s22_start_base
say done
exit 0
