#!/usr/bin/env bash
# Issue 39 (batch-invariant mode), device window of session 13 (budget 240 s, no vLLM): the GPU bitwise
# tests, then the mode's cost, on vs off in the same run, offline workload with dummy bf16 weights.
#
#   OUT_DIR=/tmp/x bash benchmarks/device/s13_bi.sh
#   DRY_RUN=1 OUT_DIR=/tmp/x bash benchmarks/device/s13_bi.sh   # CPU: every step once, tiny shapes
#
# Steps (each under `timeout`, bounded by what is left of ~225 s; results written as they come):
#   1. tests/gpu/test_batch_invariant_gpu.py (GEMM rows M = 1 vs 2..2048 for cuBLASLt / cuBLAS without split-K
#      and Triton on Qwen3-0.6B/8B shapes; a request alone vs among 1..255 random neighbours, greedy and seeded,
#      with GEMM auto and triton; prefix hit; graphs vs eager; reference = server; the Qwen3-0.6B shape alone vs
#      among 15 / 127 neighbours) -> pytest.log, reports/*.json
#   2. cost, Qwen3-0.6B: 128 prompts x 256 in (+-50%) / 128 out, off and on, then a profiled pass of each
#      (torch profiler, top kernels) -> cost-0.6b.jsonl, profiles/
#   3. cost, Qwen3-8B: 64 prompts x 256 / 128, off and on -> cost-8b.jsonl
#   4. cost, Qwen3-0.6B, the mode's variants (GEMM triton, prefill attention per_query; baseline: step 2's off
#      run) -> cost-0.6b-variants.jsonl
#   5. the GEMM probe with vLLM's cuBLAS workspace variables (CUBLASLT_WORKSPACE_SIZE=1) -> probe-ws.log
# Every cost run reports whether its first prompt run alone gives bitwise its tokens/logprobs in the batch.
set -u
cd "$(dirname "$0")/../.."
: "${OUT_DIR:=/tmp/s13_bi}"
mkdir -p "$OUT_DIR/reports" "$OUT_DIR/profiles"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
T0=$(date +%s)
END=$(( T0 + ${BI_BUDGET:-228} ))
say() { echo "[s13_bi +$(( $(date +%s) - T0 ))s] $*"; }
left() { local l=$(( END - $(date +%s) )); [ "$l" -lt 1 ] && l=1; [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
summ() { grep -h '^COST' "$1" | sed 's/^/    /'; }
gpu_clean() { for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do kill -9 "$p" 2>/dev/null; done; }

if [ "${DRY_RUN:-0}" = 1 ]; then
  DEV=cpu; DT=float32; S06=tiny-llama; S8=tiny-llama
  N06="--num-prompts 6 --input-len 24 --output-len 4 --max-num-seqs 8"; N8=$N06; KW06='{}'; KW8='{}'
  echo "cpu (dry run)" > "$OUT_DIR/gpu.txt"
else
  DEV=cuda; DT=bfloat16; S06=qwen3-0.6b; S8=qwen3-8b
  N06="--num-prompts 128 --input-len 256 --output-len 128 --max-num-seqs 128"
  N8="--num-prompts 64 --input-len 256 --output-len 128 --max-num-seqs 64"
  KW06='{"extra": {"cuda_graph_sizes": [1, 32, 128]}}'; KW8='{"extra": {"cuda_graph_sizes": [1, 32, 64]}}'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT_DIR/gpu.txt" 2>&1
fi
git log -1 --format="tree %h %cd" >> "$OUT_DIR/gpu.txt" 2>/dev/null
say "device: $(head -1 "$OUT_DIR/gpu.txt"); torch $($PY -c 'import torch; print(torch.__version__, torch.version.cuda)' 2>&1)"

# 1. bitwise tests (on CPU they skip: the dry run runs the interpreter's forms instead)
if [ "$DEV" = cuda ]; then
  RLSERVE_GPU_REPORT="$OUT_DIR/reports" timeout -k 5 "$(left 80)" $PY -m pytest -q -p no:cacheprovider -rA \
      tests/gpu/test_batch_invariant_gpu.py > "$OUT_DIR/pytest.log" 2>&1
else
  timeout -k 5 "$(left 200)" $PY -m pytest -q -p no:cacheprovider tests/test_batch_invariant_triton.py \
      > "$OUT_DIR/pytest.log" 2>&1
fi
say "tests rc=$?: $(tail -n 1 "$OUT_DIR/pytest.log")"
grep -E "^(PASSED|FAILED|ERROR)|GEMM .* rows differ" "$OUT_DIR/pytest.log" | sed 's/^/    /' | head -60
gpu_clean

# 2. cost, 0.6B, off and on + a profiled pass of each
timeout -k 5 "$(left 80)" $PY benchmarks/batch_invariant.py cost --shape $S06 --device $DEV --dtype $DT $N06 \
    --reps 1 --modes off,on --engine-kw "$KW06" --run-timeout 55 --profile-dir "$OUT_DIR/profiles" \
    --json "$OUT_DIR/cost-0.6b.jsonl" > "$OUT_DIR/cost-0.6b.log" 2>&1
say "cost $S06 rc=$?"; summ "$OUT_DIR/cost-0.6b.log"
for m in off on; do
  f="$OUT_DIR/profiles/profile-$S06-$m.json"
  [ -f "$f" ] && $PY -c "
import json; d = json.load(open('$f')); t = d['kernels_total_us']
print('    profile $m: total %.1f ms;' % (t / 1e3), '; '.join('%s %.1f ms' % (r['name'][:48], r['self_us'] / 1e3) for r in d['top'][:6]))"
done
gpu_clean

# 3. cost, 8B, off and on
timeout -k 5 "$(left 80)" $PY benchmarks/batch_invariant.py cost --shape $S8 --device $DEV --dtype $DT $N8 \
    --reps 1 --modes off,on --engine-kw "$KW8" --run-timeout 45 --json "$OUT_DIR/cost-8b.jsonl" \
    > "$OUT_DIR/cost-8b.log" 2>&1
say "cost $S8 rc=$?"; summ "$OUT_DIR/cost-8b.log"
gpu_clean

# 4. the mode's variants on 0.6B (baseline: step 2's off run, same machine a minute earlier)
timeout -k 5 "$(left 70)" $PY benchmarks/batch_invariant.py cost --shape $S06 --device $DEV --dtype $DT $N06 \
    --reps 1 --modes on:gemm=triton,on:attn=per_query --engine-kw "$KW06" --run-timeout 35 \
    --json "$OUT_DIR/cost-0.6b-variants.jsonl" > "$OUT_DIR/cost-0.6b-variants.log" 2>&1
say "variants rc=$?"; grep -h '^{' "$OUT_DIR/cost-0.6b-variants.log" | cut -c1-220 | sed 's/^/    /'
gpu_clean

# 5. GEMM probe with vLLM's workspace variables (a fresh process: cuBLAS reads them at its start)
if [ "$(left 30)" -gt 8 ]; then
  CUBLASLT_WORKSPACE_SIZE=1 CUBLAS_WORKSPACE_CONFIG=:16:8 timeout -k 5 "$(left 30)" $PY benchmarks/batch_invariant.py \
      probe --device $DEV > "$OUT_DIR/probe-ws.log" 2>&1
  say "probe (workspace 1 KiB) rc=$?"; grep -v "rows differ from M=1 at M in \[\]" "$OUT_DIR/probe-ws.log" | tail -n 20
fi
gpu_clean
say "done"
exit 0
