#!/usr/bin/env bash
# Session 14, issue 36 (LoRA), one GPU, budget 60 s, rlserve only:
#   a) (background, from t=0) tests/gpu/test_lora_gpu.py -k "ipc or merged": the adapter-only IPC sync =
#      the trainer's PEFT model after the sync's fixed-cost cuts (batched slot commit, inline receive),
#      and the merged fast path = PEFT merged (float32); a tiny model beside step b's start-up
#   b) Qwen3-8B shape, bf16: adapter-only sync over IPC (one /sync_weights call per version) of PEFT
#      adapters of rank 16 and 64 vs a full sync, time and bytes, with the server's phases
#      (benchmarks/lora_gpu.py --parts sync; session 13: rank 16 32.2 ms, rank 64 36.2 ms, full 22.7 ms)
#   c) Qwen3-8B shape, bf16, rank 64: offline decode tok/s, base vs one adapter (per-row kernels) vs one
#      adapter merged by RLSERVE_LORA_MERGE=auto, the new default (reports whether auto kept it)
# Workload of c (as s13_lora.sh): 32 prompts x 128 random token ids, 64 greedy tokens, ignore_eos, median of 2.
# DRY_RUN=1: every step once on the CPU with a small shape (smollm2-135m, gloo instead of IPC).
[ "${DRY_RUN:-0}" = 1 ] && BUDGET=${BUDGET:-900}  # the CPU dry run: small shapes, slow machine
NAME=s14_lora BUDGET=${BUDGET:-60}; source "$(dirname "$0")/lib.sh"
say "card: $CARD"
WORK=$(mktemp -d /tmp/s14lora.XXXXXX)
if [ "$DRY_RUN" = 1 ]; then
  PY=/work/venv/bin/python; export PYTHONPATH=$PWD
  COMMON=(--shape smollm2-135m --device cpu --dtype float32 --batch 4 --prompt-len 8 --max-tokens 8)
  SCALE=10  # the 2-core CPU machine runs every step slower
else
  export PYTHONPATH=${PYTHONPATH:-/tmp/site:$PWD}
  COMMON=(--shape qwen3-8b --device cuda --dtype bfloat16 --batch 32 --prompt-len 128 --max-tokens 64)
  SCALE=1
fi
COMMON+=(--model-dir "$WORK/model" --adapter-root "$WORK/adapters" --gpu-memory-utilization 0.6)

# (dry run: the tests skip without a GPU; the selection is checked)
TPID=$(start_bg "$OUT_DIR/tests-gpu-lora.log" timeout -k 5 $(( $(left) - 5 )) $PY -m pytest -q -p no:cacheprovider \
  tests/gpu/test_lora_gpu.py -k "ipc or merged" -rA)
bounded $(( 30 * SCALE )) $PY benchmarks/lora_gpu.py "${COMMON[@]}" --ranks 16 64 --parts sync --reps 3 \
  --out "$OUT_DIR/lora-sync.json" > "$OUT_DIR/sync.log" 2>&1
rc=$?
say "b) sync rc=$rc $($PY - "$OUT_DIR/lora-sync.json" <<'PYEOF' 2>&1 | tail -1
import json, sys
r = json.load(open(sys.argv[1])).get("sync", {})
print(" | ".join(f"{k} median {v['median_s']} s first {v['first_s']} s {v['bytes']} B" for k, v in r.items()
                 if isinstance(v, dict)))
PYEOF
)"
R=64; [ "$DRY_RUN" = 1 ] && R=16
bounded $(( 24 * SCALE )) $PY benchmarks/lora_gpu.py "${COMMON[@]}" --ranks $R --cases base one --parts decode \
  --reps 2 --out "$OUT_DIR/lora-decode.json" > "$OUT_DIR/decode.log" 2>&1
rc=$?
say "c) decode rc=$rc $($PY - "$OUT_DIR/lora-decode.json" <<'PYEOF' 2>&1 | tail -1
import json, sys
for d in json.load(open(sys.argv[1])).get("decode", []):
    print(f"r{d['rank']} tok/s {d['decode_tok_s']} merged {d.get('one_merged_tok_s')} "
          f"on by default {d.get('merge_on_by_default')} merge {d.get('merge_s')} s restore {d.get('restore_s')} s")
PYEOF
)"
if [ -n "$TPID" ]; then  # a) ends by its own timeout at the latest
  while kill -0 "$TPID" 2>/dev/null && [ "$(left)" -gt 3 ]; do sleep 1; done
  stop_bg "$TPID"
  say "a) tests: $(tail -n 1 "$OUT_DIR/tests-gpu-lora.log" | cut -c1-200)"
fi
gpu_cleanup
rm -rf "$WORK"
say "done"
exit 0
