#!/usr/bin/env bash
# Session 14, first window (lead's probe, budget ~240 s): profiles that direct this session's speed work.
#   a) decode_step.py, Qwen3-0.6B shape, batch 1: graph-replayed step vs the HBM floor + its GPU kernel table
#      (issue 37: batch-1 <= 1.0 ms/token) and the whole engine step's kernel table
#   b) decode_step.py, Qwen3-8B shape, batch 1 and 256: step vs floor + kernel tables (issue 37: 8B >= 1.3x)
#   c) start-up of LLM(...) for the Qwen3-8B shape (dummy bf16) under cProfile: where the 8B start-up goes
#      (issue 37: <= 15 s to ready)
#   d) throughput.py, 48-layer Qwen3-30B-A3B shape, rlserve only, --kernel-profile 30 (issue 35: where the
#      MoE offline time goes; vLLM did 3,747 tok/s on the H100 in session 13)
# DRY_RUN=1: tiny shapes on the CPU.
NAME=s14_probe BUDGET=${BUDGET:-240}; source "$(dirname "$0")/lib.sh"
say "card: $CARD"
if [ "$DRY_RUN" = 1 ]; then
  P1=(); P8=(); DEV=(--device cpu); S06=smollm2-135m; S8=smollm2-135m; SMOE=small-qwen3-moe
  TP=(--num-seqs 4 --min-len 8 --max-len 16 --max-num-seqs 4 --device cpu)
else
  P1=(--profile --profile-engine); P8=(--profile --profile-batches 1,256); DEV=(); S06=qwen3-0.6b; S8=qwen3-8b; SMOE=qwen3-30b-a3b; TP=(--device cuda)
fi
bounded 45 $PY benchmarks/decode_step.py "${DEV[@]}" --shape $S06 --batch 1 --iters 50 "${P1[@]}" \
  --engine-steps 50 --json "$OUT_DIR/decode_06b_b1.json" > "$OUT_DIR/decode_06b_b1.log" 2>&1
say "a) rc=$? $(grep -iE 'floor|ms' "$OUT_DIR/decode_06b_b1.log" | head -3 | tr -s ' ' | tr '\n' '|')"
bounded 70 $PY benchmarks/decode_step.py "${DEV[@]}" --shape $S8 --batch 1,256 --iters 20 "${P8[@]}" \
  --json "$OUT_DIR/decode_8b.json" > "$OUT_DIR/decode_8b.log" 2>&1
say "b) rc=$? $(grep -iE 'floor|ms' "$OUT_DIR/decode_8b.log" | head -3 | tr -s ' ' | tr '\n' '|')"
bounded 50 $PY - "$S8" "${DRY_RUN}" "$OUT_DIR" > "$OUT_DIR/startup_8b.log" 2>&1 <<'PYEOF'
import cProfile, pstats, sys, tempfile, time
sys.path.insert(0, "benchmarks")
from model_shapes import save_shape
shape, dry, out = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
t0 = time.perf_counter()
import torch
from rlserve import LLM
t_imp = time.perf_counter() - t0
path = save_shape(shape, tempfile.mkdtemp())
prof = cProfile.Profile()
t1 = time.perf_counter()
prof.enable()
llm = LLM(path, dtype="float32" if dry else "bfloat16", device="cpu" if dry else "cuda", load_format="dummy",
          skip_tokenizer_init=True, max_model_len=4096)
if not dry:
    torch.cuda.synchronize()
prof.disable()
t_llm = time.perf_counter() - t1
print(f"startup: import {t_imp:.2f} s, LLM() {t_llm:.2f} s, total {t_imp + t_llm:.2f} s", flush=True)
prof.dump_stats(f"{out}/startup_8b.prof")
st = pstats.Stats(prof); st.sort_stats("cumulative").print_stats(45); st.sort_stats("tottime").print_stats(25)
PYEOF
say "c) rc=$? $(grep '^startup:' "$OUT_DIR/startup_8b.log")"
bounded 100 $PY benchmarks/throughput.py --engine rlserve --no-hf --shape $SMOE "${TP[@]}" --kernel-profile 30 \
  --json "$OUT_DIR/moe_kprof.json" > "$OUT_DIR/moe_kprof.log" 2>&1
say "d) rc=$? $(grep -E '^  rlserve ' "$OUT_DIR/moe_kprof.log" | tr -s ' ')"
gpu_cleanup
say done
exit 0
