#!/usr/bin/env bash
# Issue 35 (MoE), session 14, one GPU, budget 230 s, most important first:
#   a) benchmarks/throughput.py, Qwen3-30B-A3B shape (48 layers, 61 GB, dummy bf16), the offline
#      workload (256 prompts of 100..1024 tokens, as many output tokens), rlserve then vLLM 0.24.0
#      (its Triton fused-MoE, /tmp/vsite), one process each, same GPU and workload, each at ITS OWN
#      default gpu_memory_utilization (rlserve now 0.92 = vLLM's; and its rotary table shared by the
#      48 layers: 1.875 GiB more KV); each reports the KV tokens it got. No batch-1 run (met in s13).
#      Falls back to the 24-layer shape on a card under 75 GiB.
#   b) with what is left: benchmarks/sync.py, CUDA IPC packed sync (per-expert names first, then fused
#      names, then unpacked) of the first layers of the shape against the device-copy floor of the
#      same bytes (packed buckets now replay a recorded load at each new address:
#      rlserve/transfer/server/bucket_plan.py; s13: 0.12 ms per tensor).
#   c) with what is left: tests/gpu/test_moe_gpu.py::test_ipc_packed_second_sync_replays_each_bucket_at_its_new_address
#      (~15 s, server --enforce-eager: the GPU check of the new packed IPC path, IPCTrainerEngine's
#      default; its one-launch replay also runs on the CPU through Triton's interpreter).
# DRY_RUN=1: every Python step once on the CPU with a tiny MoE shape (vLLM only with VLLM_PYTHONPATH
# set to a CPU vLLM's site dir; the sync through gloo).
NAME=s14_moe BUDGET=${BUDGET:-230}; source "$(dirname "$0")/lib.sh"
say "card: $CARD; git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
if [ "$DRY_RUN" = 1 ]; then
  SHAPE=small-qwen3-moe; MEM_MIB=0
  ARGS=(--device cpu --num-seqs 4 --min-len 8 --max-len 16 --max-num-seqs 4)
  VLLM_ARGS=(--gpu-memory-utilization 0.1 --vllm-pythonpath "${VLLM_PYTHONPATH:-/nonexistent}")
else
  MEM_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | tr -d ' ')
  SHAPE=qwen3-30b-a3b; [ "$MEM_MIB" -lt 76800 ] && SHAPE=qwen3-30b-a3b-24l
  ARGS=(--device cuda)
  VLLM_ARGS=(--vllm-pythonpath /tmp/vsite)
fi
say "a) shape $SHAPE"

# ---- a) rlserve, then vLLM (each in its own process: the 61 GB model cannot be held twice)
bounded 80 $PY benchmarks/throughput.py --shape "$SHAPE" --engine rlserve --no-hf "${ARGS[@]}" \
  --json "$OUT_DIR/throughput_rlserve.json" > "$OUT_DIR/throughput_rlserve.log" 2>&1
say "a) rlserve rc=$?: $(grep -E '^  rlserve ' "$OUT_DIR/throughput_rlserve.log" | tr -s ' ')"
say "a) $(grep -E '^rlserve KV sizing' "$OUT_DIR/throughput_rlserve.log")"
gpu_cleanup
if [ "$DRY_RUN" = 1 ] && [ -z "${VLLM_PYTHONPATH:-}" ]; then
  say "a) vllm skipped (dry run without VLLM_PYTHONPATH)"
else
  # vLLM's own environment only in this subshell (env.sh: offline, no flashinfer sampler); the child
  # that runs vLLM gets PYTHONPATH=/tmp/vsite alone (throughput.run_vllm)
  ( [ -f /tmp/vsite/env.sh ] && source /tmp/vsite/env.sh
    bounded 165 $PY benchmarks/throughput.py --shape "$SHAPE" --engine vllm --no-hf "${ARGS[@]}" \
      "${VLLM_ARGS[@]}" --json "$OUT_DIR/throughput_vllm.json" ) > "$OUT_DIR/throughput_vllm.log" 2>&1
  say "a) vllm rc=$?: $(grep -E '^  vllm' "$OUT_DIR/throughput_vllm.log" | tr -s ' ')"
  say "a) vllm KV: $(grep -E 'GPU KV cache size|Available KV cache memory' "$OUT_DIR/throughput_vllm.log" \
    | sed 's/.*\] //' | tr '\n' ' ')"
fi
gpu_cleanup
$PY benchmarks/device/throughput_summary.py "$OUT_DIR" "$CARD" 2>&1 | tee -a "$OUT_DIR/summary.txt"

# ---- b) CUDA IPC sync vs the copy floor, the first layers of the shape (whatever time is left)
if [ "$DRY_RUN" = 1 ]; then
  bounded 200 $PY benchmarks/sync.py --cpu-shape small-qwen3-moe --gpu off --nccl off --repeats 1 \
    --json "$OUT_DIR/sync.json" > "$OUT_DIR/sync.log" 2>&1
  say "b) sync (cpu, gloo) rc=$?: $(grep -c '| gloo |' "$OUT_DIR/sync.log") rows"
  bounded 200 $PY benchmarks/moe_sync_cpu.py --layers 2 --experts 16 --syncs 2 \
    --json "$OUT_DIR/moe_sync_cpu.json" > "$OUT_DIR/moe_sync_cpu.log" 2>&1
  say "b) moe_sync_cpu rc=$?: $(tail -1 "$OUT_DIR/moe_sync_cpu.log")"
else
  # 2 layers: 3.7 GB (1.2463 GB a layer + 1.2447 GB embedding and head), 768 per-expert tensors
  bounded 60 $PY benchmarks/sync.py --cpu off --gpu on --nccl off --gpu-shape qwen3-30b-a3b-2l \
    --repeats 1 --gpu-expert-names both --gpu-quick --json "$OUT_DIR/sync.json" > "$OUT_DIR/sync.log" 2>&1
  say "b) sync rc=$?, qwen3-30b-a3b-2l: $(grep -E '^\[gpu\] ' "$OUT_DIR/sync.log" | tr '\n' '|')"
  grep -E '^\| (ipc|cuda) ' "$OUT_DIR/sync.log" | tee -a "$OUT_DIR/summary.txt"
fi
gpu_cleanup
# ---- c) the GPU test of the packed IPC replay (a tiny Qwen2-MoE: the second sync of changed weights
# replays every bucket at its new address and the server then generates the trainer's greedy tokens)
bounded 35 $PY -m pytest -v -p no:cacheprovider -rfEs \
  "tests/gpu/test_moe_gpu.py::test_ipc_packed_second_sync_replays_each_bucket_at_its_new_address" \
  > "$OUT_DIR/test_ipc_replay.log" 2>&1
say "c) test rc=$?: $(tail -1 "$OUT_DIR/test_ipc_replay.log")"
gpu_cleanup
say "done"
exit 0
