#!/usr/bin/env bash
# Issue 35 (MoE on one GPU), session 16, budget $BUDGET (300 s: all of a); under 280 s, e.g. the second
# window's 150 s: a) is batch-1 decode only, then b / c with what is left), most important first:
#   a) benchmarks/throughput.py, Qwen3-30B-A3B shape (48 layers, 61 GB, dummy bf16), the offline workload
#      (256 prompts of 100..1024 tokens) AND batch-1 decode (128-token prompt, 512 greedy tokens, ms/token),
#      rlserve then vLLM 0.24.0 with its MoE kernels (/tmp/vsite), one process each, same card, each at
#      its own default gpu_memory_utilization. rlserve's fused-MoE tiles: RLSERVE_MOE_TUNED_CONFIGS=$MOE_TUNED
#      (default 1: the tuned table, the faster in window 1; vLLM runs its H200 table on an H200, else its default rule). Falls back to the
#      24-layer shape on a card under 75 GiB. rlserve with --floor (the HBM floor + roofline of its own steps:
#      how far 1.3x vLLM is from what the bytes allow) and its step trace (step_trace_rlserve.jsonl). vLLM's start-up is ~90 s (torch.compile + graphs): ~155 s.
#   b) benchmarks/sync.py, CUDA IPC unpacked (IPC's default; fused names, then the trainer's per-expert
#      names) against the device-copy floor of the same bytes: the FULL 61 GB shape; on a card with
#      >= 130 GiB (H200) the trainer holds a whole copy (122 GB on the card), else one layer's tensors serve
#      every layer's names (--gpu-trainer layer-pool; the server still receives all 61 GB).
#   c) with what is left (>= 30 s; on a card under 130 GiB before b): benchmarks/moe_kernels.py --tuned
#      --vllm-default --triton-only: one MoE layer, rlserve's default tile rule vs the tuned table vs vLLM 0.24's
#      default rule (vllm024_default) per batch (decode ~100 tokens; an 8192-token prefill; GPU us, CUDA graphs).
# DRY_RUN=1: every Python step once on the CPU with a tiny MoE shape (vLLM only with VLLM_PYTHONPATH set
# to a CPU vLLM's site dir; the sync through gloo; moe_kernels --help: CUDA only).
NAME=s16_moe BUDGET=${BUDGET:-300}; source "$(dirname "$0")/lib.sh"
# rlserve's best tiles: the tuned table (vLLM's H200 table for this shape, coarsened: TUNED_SM90), faster than the
# default rule on the H100 at every batch of session 16's first window (moespeed b: 433.5 vs 453.5 us a layer
# at 128 tokens ... 895.1 vs 1100.5 at 4096; equal at 24); MOE_TUNED=0 for the default rule
MOE_TUNED=${MOE_TUNED:-1}
say "card: $CARD; git $(git rev-parse --short HEAD 2>/dev/null || echo '?'); RLSERVE_MOE_TUNED_CONFIGS=$MOE_TUNED"
# BUDGET >= 280: the offline workload + batch-1 (both engines); below (the lead's second window: 150 s), batch-1
# alone: a 4-sequence workload (100..128 tokens) stands in for the offline one (its tok/s means nothing)
FULL=0; [ "$BUDGET" -ge 280 ] && FULL=1
# on a >= 130 GiB card (H200) the full 61 GB sync (b) is the measurement no earlier window could make: it runs
# first, with up to 150 s (its own budget: the offline pair keeps BUDGET - 150 s)
BIG=0; [ "$DRY_RUN" != 1 ] && [ "$MEM_MIB" -ge 133120 ] && BIG=1
[ "$BIG" = 1 ] && FULL=$([ "$BUDGET" -ge 430 ] && echo 1 || echo 0)
if [ "$DRY_RUN" = 1 ]; then
  SHAPE=small-qwen3-moe
  ARGS=(--device cpu --num-seqs 4 --min-len 8 --max-len 16 --max-num-seqs 4 --batch1-tokens 4 --batch1-prompt-len 8)
  VLLM_ARGS=(--gpu-memory-utilization 0.1 --vllm-pythonpath "${VLLM_PYTHONPATH:-/nonexistent}")
else
  SHAPE=qwen3-30b-a3b; [ "$MEM_MIB" -lt 76800 ] && SHAPE=qwen3-30b-a3b-24l
  ARGS=(--device cuda --batch1-tokens 512)
  VLLM_ARGS=(--vllm-pythonpath /tmp/vsite)
  # max_num_seqs 8: both engines capture decode graphs up to 8 / 16 rows only (vLLM's took 13 s for 86 graphs
  # in s15); batch 1 replays the same size-1 graph either way
  [ "$FULL" = 0 ] && ARGS+=(--num-seqs 4 --min-len 100 --max-len 128 --max-num-seqs 8)
fi
[ "$FULL" = 1 ] && ARGS+=(--floor --step-trace "$OUT_DIR/step_trace_rlserve.jsonl")
say "a) shape $SHAPE, budget $BUDGET s: $([ "$FULL" = 1 ] && echo 'offline + batch-1' || echo 'batch-1 only (4-sequence stand-in workload)')"
gpu_cleanup

# ---- a) rlserve then vLLM, each its own process. FULL: rlserve <= 85 s (s15: 54 s), vLLM <= 185 s (s15: 151 s),
# 40 s kept for b). Batch-1 only: rlserve <= 40 s (load + warm-up ~20 s), vLLM <= 125 s (start-up ~90 s)
step_a() {
export RLSERVE_MOE_TUNED_CONFIGS=$MOE_TUNED
if [ "$FULL" = 1 ]; then
  throughput_pair a 85 210 185 40 --shape "$SHAPE" "${ARGS[@]}" --vllm "${VLLM_ARGS[@]}"
else
  RCAP=40; [ "$DRY_RUN" = 1 ] && RCAP=150  # a loaded 2-core CPU needs more than the GPU's 40 s
  throughput_pair a "$RCAP" 105 125 0 --shape "$SHAPE" "${ARGS[@]}" --vllm "${VLLM_ARGS[@]}"
fi
unset RLSERVE_MOE_TUNED_CONFIGS
gpu_cleanup
}

# ---- b) CUDA IPC sync vs the device-copy floor
step_b() {
if [ "$DRY_RUN" = 1 ]; then
  bounded 200 $PY benchmarks/sync.py --cpu-shape small-qwen3-moe --gpu off --nccl off --repeats 1 \
    --json "$OUT_DIR/sync.json" > "$OUT_DIR/sync.log" 2>&1
  say "b) sync (cpu, gloo; dry run) rc=$?: $(grep -c '| gloo |' "$OUT_DIR/sync.log") rows"
else
  # the full 61 GB shape on every card: on one under 130 GiB the trainer holds one layer's tensors for every
  # layer's names (sync.py --gpu-trainer layer-pool: an FSDP-style gather; the server still receives all 61 GB)
  TRAINER=full; [ "$BIG" = 1 ] || TRAINER=layer-pool
  bounded "$(slot 150 "$1")" $PY benchmarks/sync.py --cpu off --gpu on --nccl off --gpu-shape qwen3-30b-a3b \
    --gpu-trainer $TRAINER --repeats 3 --gpu-unpacked-only --gpu-expert-names both --json "$OUT_DIR/sync.json" \
    > "$OUT_DIR/sync.log" 2>&1
  say "b) sync rc=$?, qwen3-30b-a3b, trainer $TRAINER: $(grep -E '^\[gpu\] ' "$OUT_DIR/sync.log" | tr '\n' '|')"
  grep -E '^\| (ipc|cuda) ' "$OUT_DIR/sync.log" | tee -a "$OUT_DIR/summary.txt"
fi
gpu_cleanup
}

# ---- c) one MoE layer: default tile rule vs the tuned table (only with >= 30 s left)
step_c() {
if [ "$DRY_RUN" = 1 ]; then
  bounded 90 $PY benchmarks/moe_kernels.py --help > "$OUT_DIR/moe_kernels.log" 2>&1
  say "c) moe_kernels --help rc=$? (CUDA only)"
elif [ "$(( $(left) - $1 ))" -ge 30 ]; then
  bounded "$(slot 45 "$1")" $PY benchmarks/moe_kernels.py --tokens 96,128,256,8192 --tuned --vllm-default --triton-only \
    --iters 10 --json "$OUT_DIR/moe_kernels.json" > "$OUT_DIR/moe_kernels.log" 2>&1
  say "c) moe_kernels rc=$?"
  moe_kernel_rows c "$OUT_DIR/moe_kernels.log"
else
  say "c) skipped: $(left) s left"
fi
gpu_cleanup
}

# the full 61 GB sync is new on a >= 130 GiB card: b first there; on an H100 the 28-layer sync repeats s13's
# subset, so the tile A/B goes first
# MOE_STEPS (default abc) picks the steps, e.g. MOE_STEPS=ac when b ran in an earlier call
MOE_STEPS=${MOE_STEPS:-abc}
run_step() { case "$MOE_STEPS" in *"$1"*) "step_$1" "${@:2}";; *) say "$1) not in MOE_STEPS=$MOE_STEPS";; esac; }
if [ "$BIG" = 1 ]; then run_step b 0; run_step a; run_step c 0; else run_step a; run_step c 35; run_step b 0; fi
say "done"
exit 0
