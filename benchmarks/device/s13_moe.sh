#!/usr/bin/env bash
# Issue 35 (MoE) on one GPU, most important first, inside a 420 s budget:
#   a) benchmarks/throughput.py, Qwen3-30B-A3B shape (48 layers, 61 GB; dummy bf16): the offline
#      workload + batch-1 decode (256 tokens), rlserve then vLLM 0.24.0 (its MoE kernels, /tmp/vsite),
#      one process per engine, same GPU, same workload, both at gpu_memory_utilization 0.9 (each
#      engine's default); each reports the KV cache it got. Falls back to the 24-layer shape on a card
#      under 75 GiB.
#   b) tests/gpu/test_moe_gpu.py (the bf16 routing test first), reports under $OUT_DIR/gpu_report.
#   c) benchmarks/sync.py: CUDA IPC sync of the 30B-A3B shape vs the device-copy floor of the same
#      bytes; the trainer's copy + the server's copy must fit, so the most layers that do (48 on an
#      H200, ~28 on an H100); fused names, once per-expert names.
#   d) whatever time is left: tests/gpu/test_vllm_wire_gpu.py -k qwen3_moe (vLLM's IPC trainer, MoE).
# DRY_RUN=1: every Python step once on the CPU with a tiny MoE shape (vLLM only when VLLM_PYTHONPATH
# is set: a CPU vLLM's site dir).
NAME=s13_moe BUDGET=${BUDGET:-420}; source "$(dirname "$0")/lib.sh"
say "card: $CARD; git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"

# ---- a) offline workload + batch-1: rlserve, then vLLM (each its own process, so the GPU is empty
# for the next one; the 61 GB model cannot be held twice)
if [ "$DRY_RUN" = 1 ]; then
  SHAPE=small-qwen3-moe
  TP_ARGS=(--device cpu --num-seqs 4 --min-len 8 --max-len 16 --max-num-seqs 4 --batch1-tokens 8)
  VLLM_ARGS=(--gpu-memory-utilization 0.1 --vllm-pythonpath "${VLLM_PYTHONPATH:-/nonexistent}")
elif [ "$MEM_MIB" -ge 76800 ]; then  # 75 GiB: an H100 80 GB (81,559 MiB) holds 61 GB + a KV cache
  SHAPE=qwen3-30b-a3b
  TP_ARGS=(--device cuda --batch1-tokens 256)
  VLLM_ARGS=(--vllm-pythonpath /tmp/vsite)
else
  SHAPE=qwen3-30b-a3b-24l
  TP_ARGS=(--device cuda --batch1-tokens 256)
  VLLM_ARGS=(--vllm-pythonpath /tmp/vsite)
fi
say "a) shape $SHAPE"
throughput_pair a 130 270 260 110 --shape "$SHAPE" "${TP_ARGS[@]}" --vllm "${VLLM_ARGS[@]}"

# ---- b) GPU tests (skip on CPU: the dry run checks they collect and skip)
t=$(slot 100 70)
RLSERVE_GPU_REPORT="$OUT_DIR/gpu_report" timeout -k 5 "$t" $PY -m pytest -v -p no:cacheprovider -rfEs \
  tests/gpu/test_moe_gpu.py > "$OUT_DIR/tests_moe_gpu.log" 2>&1
say "b) tests rc=$? ($t s limit): $(tail -1 "$OUT_DIR/tests_moe_gpu.log")"

# ---- c) CUDA IPC sync vs the copy floor: the most layers for which two copies fit
if [ "$DRY_RUN" = 1 ]; then
  # the CPU section with a tiny MoE shape (gloo), and the GPU section's byte count of the chosen shape
  t=$(slot 200 5)
  timeout -k 5 "$t" $PY benchmarks/sync.py --cpu-shape small-qwen3-moe --gpu off --nccl off --repeats 1 \
    --json "$OUT_DIR/sync.json" > "$OUT_DIR/sync.log" 2>&1
  say "c) sync (cpu, gloo) rc=$?: $(grep -c '| gloo |' "$OUT_DIR/sync.log") rows"
  NL=28
else
  # per layer 1.2463 GB (128 experts x 3 x 2048 x 768 + attention), + 1.2447 GB embedding and head;
  # two copies, 12 GB left for two CUDA contexts, the server's workspace and the pack buffers
  NL=$(( ( (MEM_MIB * 1048576 / 1000000 - 12000) / 2 - 1245 ) / 1246 ))
  [ "$NL" -gt 48 ] && NL=48
  t=$(slot 200 5)
  timeout -k 5 "$t" $PY benchmarks/sync.py --cpu off --gpu on --nccl off --gpu-shape "qwen3-30b-a3b-${NL}l" \
    --repeats 1 --gpu-expert-names both --json "$OUT_DIR/sync.json" > "$OUT_DIR/sync.log" 2>&1
  say "c) sync rc=$? ($t s limit), qwen3-30b-a3b-${NL}l"
  grep -E '^\| (ipc|cuda) ' "$OUT_DIR/sync.log" | tee -a "$OUT_DIR/summary.txt"
fi
# ---- d) with what is left: vLLM 0.24's own IPC trainer engine syncs a tiny Qwen3-MoE (fused expert
# names) into rlserve serve
if [ "$(left)" -gt 60 ]; then
  t=$(slot 200 5)
  RLSERVE_VLLM_PYTHONPATH=/tmp/vsite RLSERVE_GPU_REPORT="$OUT_DIR/gpu_report" timeout -k 5 "$t" \
    $PY -m pytest -v -p no:cacheprovider -rfEs tests/gpu/test_vllm_wire_gpu.py -k qwen3_moe \
    > "$OUT_DIR/tests_vllm_wire_moe.log" 2>&1
  say "d) vLLM wire MoE tests rc=$? ($t s limit): $(tail -1 "$OUT_DIR/tests_vllm_wire_moe.log")"
fi
[ "$DRY_RUN" = 1 ] && $PY - "qwen3-30b-a3b-${NL}l" <<'EOF' 2>&1 | tee -a "$OUT_DIR/summary.txt"
import sys
sys.path.insert(0, "benchmarks")
from sync import model_tensors, nbytes
from rlserve.loader.weight_utils import split_fused_experts
named = model_tensors(sys.argv[1], __import__("torch").bfloat16, "meta")
print(f"c) {sys.argv[1]}: {nbytes(named) / 1e9:.2f} GB, {len(named)} tensors (fused names), "
      f"{len(split_fused_experts(named))} with per-expert names")
EOF
say "done"
exit 0
