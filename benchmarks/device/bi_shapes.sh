# The batch-invariance device scripts' workloads (s13_bi.sh, s14_bi.sh): `source` it after lib.sh. Sets DEV,
# DT, the shapes S06 (Qwen3-0.6B) and S8 (Qwen3-8B), their `benchmarks/batch_invariant.py cost` flags N06 / N8
# (prompts x input / output tokens, max_num_seqs) and engine kwargs KW06 / KW8 (CUDA graphs of the batch
# sizes the runs use); in a dry run tiny-llama on the CPU, 6 prompts. Defines
#   cost LABEL SHAPE NARGS KW SECONDS   benchmarks/batch_invariant.py cost, off vs on (same run), under
#                                       `bounded SECONDS x X` -> $OUT_DIR/cost-LABEL.{jsonl,log}, a summary line
# (uses lib.sh's bounded / say / gpu_cleanup and the script's X, the step-bound factor of a dry run).
if [ "$DRY_RUN" = 1 ]; then
  DEV=cpu; DT=float32; S06=tiny-llama; S8=tiny-llama
  N06="--num-prompts 6 --input-len 24 --output-len 4 --max-num-seqs 8"; N8=$N06; KW06='{}'; KW8='{}'
else
  DEV=cuda; DT=bfloat16; S06=qwen3-0.6b; S8=qwen3-8b
  N06="--num-prompts 128 --input-len 256 --output-len 128 --max-num-seqs 128"
  N8="--num-prompts 64 --input-len 256 --output-len 128 --max-num-seqs 64"
  KW06='{"extra": {"cuda_graph_sizes": [1, 32, 128]}}'; KW8='{"extra": {"cuda_graph_sizes": [1, 32, 64]}}'
fi
cost() {  # cost LABEL SHAPE NARGS KW SECONDS
  bounded "$(( $5 * X ))" $PY benchmarks/batch_invariant.py cost --shape "$2" --device $DEV --dtype $DT $3 \
      --reps 1 --modes off,on --engine-kw "$4" --run-timeout $(( 30 * X )) --json "$OUT_DIR/cost-$1.jsonl" \
      > "$OUT_DIR/cost-$1.log" 2>&1
  say "cost $2 rc=$?"; grep -h '^COST' "$OUT_DIR/cost-$1.log" | sed 's/^/    /'; grep -h '^run ' "$OUT_DIR/cost-$1.log" | head -2
  gpu_cleanup
}
