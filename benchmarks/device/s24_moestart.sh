#!/usr/bin/env bash
# Session 24 (TIDY item 2; budget $BUDGET, 300 s by default): a MoE model's COLD start with the parallel Triton
# precompile recording its whole warm-up (ModelRunner._record_pass: the fused-MoE kernels, then the forwards with the
# routed experts switched off, the decode attention variants, the weight sync's four copy_sum variants), against the
# tree before (base: this tree minus s24_moestart_base.patch, `git diff` of rlserve/ over this change), where a model
# with routed experts recorded only its fused-MoE kernels and compiled the rest one after the other in the warm-up
# (session 23's note: the four copy_sum compiles alone added ~4 s).
# Each start gets an EMPTY Triton cache of its own (TRITON_CACHE_DIR=$(mktemp -d)): new, base, new, base (as many
# as the budget allows): `rlserve serve` of $SHAPE (default small-qwen3-moe: 32 experts, top-4, 4 layers; dummy
# weights, the tests' tiny tokenizer; SHAPE=qwen3-30b-a3b for the real shape, ~61 GB of bf16 weights) start ->
# ready -> 16 greedy tokens -> SIGINT (benchmarks/startup_stop.py --show-start-log).
# Summary per start: ready s; the warm-up's line ("warm-up (kernel compilation, CUDA graph capture) took"); the
# precompile's lines ("Triton precompile: N kernel specializations recorded ..., compiled by P processes": new, one
# line covering everything; base, the MoE kernels' line only); the greedy tokens (the same in every start: same
# dummy weights). What to expect: new's warm-up shorter by the serial compiles it moved into the children (the
# record of new > base's by the dense kernels + 4 copy_sum), or no gain if the children's compile was already the
# long pole. Logs: $OUT_DIR/serve_{new,base}_N.{log,json}.
# DRY_RUN=1: the same shape on the CPU (no Triton warm-up on the CPU: the script's plumbing only).
NAME=s24_moestart BUDGET=${BUDGET:-300}; source "$(dirname "$0")/lib.sh"
say "card: $CARD; git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
if [ "$DRY_RUN" = 1 ]; then
  DEV=cpu; SHAPE=${SHAPE:-small-qwen3-moe}; SRV=(-- --max-model-len 256 --max-num-seqs 8)
else
  DEV=cuda; SHAPE=${SHAPE:-small-qwen3-moe}; SRV=(-- --max-model-len 2056)
fi
NEW=$PWD
export RLSERVE_TRITON_PRECOMPILE=1
base_tree "$NEW/benchmarks/device/s24_moestart_base.patch" /tmp/s24_moestart_base
trees=(new); [ -n "$BASE" ] && trees+=(base)
for i in 1 2; do
  for t in "${trees[@]}"; do
    if [ "$(left)" -lt 40 ]; then say "$t $i) skipped: $(left) s left"; continue; fi
    dir=$NEW; [ "$t" = base ] && dir=$BASE
    cache=$(mktemp -d /tmp/s24_triton_XXXX)
    TRITON_CACHE_DIR=$cache bounded $(( $(left) - 4 < 240 ? $(left) - 4 : 240 )) $PY "$NEW/benchmarks/startup_stop.py" \
      --reps 1 --device "$DEV" --shape "$SHAPE" --show-start-log --greedy-tokens 16 --checkout "$dir" \
      --json "$OUT_DIR/serve_${t}_$i.json" "${SRV[@]}" > "$OUT_DIR/serve_${t}_$i.log" 2>&1
    rc=$?
    say "$t $i) rc=$rc cache files $(find "$cache" -type f | wc -l)"
    grep -E "^$dir: ready" "$OUT_DIR/serve_${t}_$i.log" | sed "s|^$dir|$t|" | cut -c1-300 | tee -a "$OUT_DIR/summary.txt"
    grep -E "Triton precompile|warm-up \(kernel|fused-MoE" "$OUT_DIR/serve_${t}_$i.log" | cut -c1-300 \
      | sed "s|^|  $t $i: |" | tee -a "$OUT_DIR/summary.txt"
    rm -rf "$cache"
    gpu_cleanup
  done
done
$PY - "$OUT_DIR" <<'PYEOF' 2>&1 | tee -a "$OUT_DIR/summary.txt"
import glob, json, os, sys
rows = []
for f in sorted(glob.glob(os.path.join(sys.argv[1], "serve_*_*.json"))):
    runs = [r for rs in json.load(open(f))["runs"].values() for r in rs]
    rows += [(os.path.basename(f)[6:-5], r["ready_s"], r["tokens"]) for r in runs]
for name, ready, _ in rows:
    print(f"{name}: ready {ready:.2f} s")
print("greedy tokens equal in every start:", len({json.dumps(t) for _, _, t in rows}) == 1 if rows else "no runs")
PYEOF
keep_logs
rm -rf /tmp/s24_moestart_base
say done
exit 0
