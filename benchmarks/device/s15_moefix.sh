#!/usr/bin/env bash
# Issue 35, session 15 (moefix15), one GPU, budget 90 s, most important first:
#   a) the packed CUDA IPC replay on the GPU: tests/gpu/test_ipc_packed_gpu.py (the trainer's one-launch
#      pack and the server's bucket-plan replay at new addresses, compiled, on a side stream; no server)
#      and tests/gpu/test_moe_gpu.py::test_ipc_packed_second_sync_replays_each_bucket_at_its_new_address
#      (fixed: window 1 failed it because the trainer's cloned tensors were never updated; now two
#      replayed syncs of in-place updated tensors, /weight_checker + greedy, then one sync without checksums).
#   b) benchmarks/sync.py, CUDA IPC of the 2-layer Qwen3-30B-A3B shape (3.737 GB) vs the device-copy floor:
#      unpacked (IPC's default) fused then per-expert names, packed fused then per-expert (256 MiB buckets),
#      packed fused with 1024 MiB buckets (the per-call cost); "[phases]" lines: each mode's last sync.
# DRY_RUN=1: the GPU tests are collected and skipped on the CPU; the sync step runs the CPU (gloo) section
# of a tiny MoE and prints the GPU rows it would run.
NAME=s15_moefix BUDGET=${BUDGET:-90}; source "$(dirname "$0")/lib.sh"
say "card: $CARD; git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"

# ---- a) GPU tests (~10 s + the e2e test's server start ~15 s)
bounded 48 $PY -m pytest -v -p no:cacheprovider -rfEs tests/gpu/test_ipc_packed_gpu.py \
  "tests/gpu/test_moe_gpu.py::test_ipc_packed_second_sync_replays_each_bucket_at_its_new_address" \
  > "$OUT_DIR/test_ipc_replay.log" 2>&1
say "a) tests rc=$?: $(tail -1 "$OUT_DIR/test_ipc_replay.log")"
grep -E '(PASSED|FAILED|SKIPPED|ERROR)' "$OUT_DIR/test_ipc_replay.log" | grep '::' | sed 's/^/a)   /' \
  | tee -a "$OUT_DIR/summary.txt"
gpu_cleanup

# ---- b) sync rows vs the copy floor
if [ "$DRY_RUN" = 1 ]; then
  bounded 200 $PY benchmarks/sync.py --cpu-shape small-qwen3-moe --gpu off --nccl off --repeats 1 \
    --json "$OUT_DIR/sync.json" > "$OUT_DIR/sync.log" 2>&1
  say "b) sync (cpu, gloo) rc=$?: $(grep -c '| gloo |' "$OUT_DIR/sync.log") rows"
  $PY - <<'PYEOF' 2>&1 | tee -a "$OUT_DIR/summary.txt"
import argparse, torch
from benchmarks.sync import gpu_modes, model_tensors
named = model_tensors("qwen3-30b-a3b-2l", torch.bfloat16, "meta")
a = argparse.Namespace(gpu_expert_names="both", gpu_quick=True, bucket_mb=256, gpu_packed_bucket_mb=1024)
print("b) GPU rows:", [(m, len(t), mb) for m, _c, t, mb in gpu_modes(a, named)])
PYEOF
else
  bounded 60 $PY benchmarks/sync.py --cpu off --gpu on --nccl off --gpu-shape qwen3-30b-a3b-2l --repeats 1 \
    --gpu-expert-names both --gpu-quick --gpu-packed-bucket-mb 1024 --json "$OUT_DIR/sync.json" \
    > "$OUT_DIR/sync.log" 2>&1
  say "b) sync rc=$?, qwen3-30b-a3b-2l: $(grep -E '^\[gpu\] ' "$OUT_DIR/sync.log" | tr '\n' '|')"
  grep -E '^\| (ipc|cuda) ' "$OUT_DIR/sync.log" | tee -a "$OUT_DIR/summary.txt"
fi
gpu_cleanup
say "done"
exit 0
