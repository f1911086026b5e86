# The batch-invariance device scripts' workloads (s13_bi.sh, s14_bi.sh): `source` it after lib.sh. Sets DEV,
# DT, the shapes S06 (Qwen3-0.6B) and S8 (Qwen3-8B), their `benchmarks/batch_invariant.py cost` flags N06 / N8
# (prompts x input / output tokens, max_num_seqs) and engine kwargs KW06 / KW8 (CUDA graphs of the batch
# sizes the runs use); in a dry run tiny-llama on the CPU, 6 prompts.
if [ "$DRY_RUN" = 1 ]; then
  DEV=cpu; DT=float32; S06=tiny-llama; S8=tiny-llama
  N06="--num-prompts 6 --input-len 24 --output-len 4 --max-num-seqs 8"; N8=$N06; KW06='{}'; KW8='{}'
else
  DEV=cuda; DT=bfloat16; S06=qwen3-0.6b; S8=qwen3-8b
  N06="--num-prompts 128 --input-len 256 --output-len 128 --max-num-seqs 128"
  N8="--num-prompts 64 --input-len 256 --output-len 128 --max-num-seqs 64"
  KW06='{"extra": {"cuda_graph_sizes": [1, 32, 128]}}'; KW8='{"extra": {"cuda_graph_sizes": [1, 32, 64]}}'
fi
