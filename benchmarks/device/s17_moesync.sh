#!/usr/bin/env bash
# Issue 35, session 17 (moesync17), budget $BUDGET (60 s), most important first:
#   b) benchmarks/sync.py: CUDA IPC unpacked sync of the FULL Qwen3-30B-A3B shape (61 GB bf16) against the
#      device-copy floor of the same bytes, fused expert names then the trainer's per-expert names (18,867
#      tensors); the trainer holds one layer's tensors for every layer's names (--gpu-trainer layer-pool: the
#      server still receives all 61 GB). Session 17's fix: aliased sources keep the replay's one-pass copy +
#      checksum + non-finite test (before: 5.0x / 20x the floor, w1 21:29 on an H100). Last, fused names with
#      checksums off (--gpu-unchecked): the trainer's checksum pass reads every byte once more, so with
#      checksums the floor is ~1.5x the copy (copy + one read); this row shows the server's pass alone.
#   t) with >= 30 s left: tests/gpu/test_nonfinite_gpu.py::test_ipc_nonfinite_sync_refused[False-none] (the
#      receiver's one-launch scan of sources the load did not sum).
#   k) with what is left (>= 15 s): benchmarks/multi_tensor_bw.py: that one pass alone over 4 layers of the
#      30B-A3B experts (4.8 GB; per-expert views) vs one flat copy_, for chunk / block / warps variants.
# DRY_RUN=1: the sync through gloo on the CPU with the tiny MoE shape, and the kernel rows through
# Triton's interpreter on a tiny shape.
NAME=s17_moesync BUDGET=${BUDGET:-60}; source "$(dirname "$0")/lib.sh"
say "card: $CARD; git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
gpu_cleanup
if [ "$DRY_RUN" = 1 ]; then
  bounded 200 $PY benchmarks/sync.py --cpu-shape small-qwen3-moe --gpu off --nccl off --repeats 1 \
    --json "$OUT_DIR/sync.json" > "$OUT_DIR/sync.log" 2>&1
  say "b) sync (cpu, gloo; dry run) rc=$?: $(grep -c '| gloo |' "$OUT_DIR/sync.log") rows"
else
  bounded "$(slot 100 0)" $PY benchmarks/sync.py --cpu off --gpu on --nccl off --gpu-shape qwen3-30b-a3b \
    --gpu-trainer layer-pool --repeats 3 --gpu-unpacked-only --gpu-unchecked --gpu-expert-names both --json "$OUT_DIR/sync.json" \
    > "$OUT_DIR/sync.log" 2>&1
  say "b) sync rc=$?: $(grep -E '^\[gpu\] ' "$OUT_DIR/sync.log" | tr '\n' '|')"
  grep -E '^\| (ipc|cuda) ' "$OUT_DIR/sync.log" | tee -a "$OUT_DIR/summary.txt"
  say "b) server: $(grep -oE '"checksums_fused": (true|false)|"checksum": [0-9.e-]+' "$OUT_DIR/sync.log" | tr '\n' ' ')"
fi
keep_logs
gpu_cleanup
# t) the GPU test of the receiver's new one-read scan of unfused sources (the first sync records its load, the
#    poisoned one is new tensors: both read the sources once more for every checksum + NaN test in one launch)
if [ "$DRY_RUN" = 1 ]; then
  say "t) skipped (dry run: CUDA only)"
elif [ "$(left)" -ge 30 ]; then
  bounded "$(( $(left) - 12 ))" $PY -m pytest -q -x -p no:cacheprovider \
    "tests/gpu/test_nonfinite_gpu.py::test_ipc_nonfinite_sync_refused[False-none]" > "$OUT_DIR/test_gpu.log" 2>&1
  say "t) test_ipc_nonfinite_sync_refused[False-none] rc=$?: $(tail -1 "$OUT_DIR/test_gpu.log")"
  gpu_cleanup
else
  say "t) skipped: $(left) s left"
fi
if [ "$(left)" -ge 15 ]; then
  if [ "$DRY_RUN" = 1 ]; then
    TRITON_INTERPRET=1 bounded 300 $PY benchmarks/multi_tensor_bw.py --cpu --layers 1 --repeats 1 --per-expert \
      --variants 256/128/4,64/128/4 --json "$OUT_DIR/mts_bw.json" > "$OUT_DIR/mts_bw.log" 2>&1
  else
    bounded "$(( $(left) - 3 ))" $PY benchmarks/multi_tensor_bw.py --layers 4 --repeats 5 --per-expert \
      --variants 1048576/2048/8,131072/2048/8,1048576/4096/16 --json "$OUT_DIR/mts_bw.json" > "$OUT_DIR/mts_bw.log" 2>&1
  fi
  say "k) multi_tensor_bw rc=$?"
  grep -E 'floor|failed' "$OUT_DIR/mts_bw.log" | tee -a "$OUT_DIR/summary.txt"
else
  say "k) skipped: $(left) s left"
fi
gpu_cleanup
say "done"
exit 0
