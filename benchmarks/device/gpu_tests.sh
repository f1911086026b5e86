#!/usr/bin/env bash
# Runs tests/gpu file by file under one wall-clock budget, resuming across back-to-back device calls:
#   BUDGET=170 bash benchmarks/device/gpu_tests.sh
# A file is run once per machine (/tmp/gpu_tests.done lists the finished ones; /tmp survives between calls on a
# warm machine); the order puts the tests that never ran on a GPU first. Each file's pytest tail goes to
# $OUT/gpu_tests.log, one summary line per file to stdout. A file that would start with < 25 s left waits for the
# next call.
set -u
cd "$(dirname "$0")/../.."
: "${OUT:=/tmp/win-out}" "${BUDGET:=170}"; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
t_end=$(( $(date +%s) + BUDGET )); done_f=/tmp/gpu_tests.done; touch "$done_f"
order="test_gpu_attention test_jit_misses_gpu test_nonfinite_gpu test_prefill_graphs_gpu test_gpu_engine
test_sleep_gpu test_transfer_gpu test_ipc_packed_gpu test_fp8_gpu test_gpu_kv_fp8 test_moe_gpu test_lora_gpu
test_batch_invariant_gpu test_chunked_prefill_gpu test_mixed_steps_gpu test_overlap_gpu test_fused_ops_gpu
test_gemm_rows_gpu test_gemv_gpu test_vllm_wire_gpu test_trainer_liveness_gpu test_transfer_kill_matrix_gpu
test_multi_server_gpu test_tp_gpu test_transfer_gpu_nccl"
for f in $order; do
  grep -qx "$f" "$done_f" && continue
  left=$(( t_end - $(date +%s) ))
  [ "$left" -lt 25 ] && { echo "stopped before $f: $left s left"; break; }
  t0=$(date +%s)
  timeout -k 5 "$left" python3 -m pytest -q -p no:cacheprovider "tests/gpu/$f.py" > /tmp/gpu_t.log 2>&1
  rc=$?
  { echo "=== $f rc=$rc wall=$(( $(date +%s) - t0 ))s"; tail -n 40 /tmp/gpu_t.log; } >> "$OUT/gpu_tests.log"
  echo "$f rc=$rc wall=$(( $(date +%s) - t0 ))s: $(tail -n 1 /tmp/gpu_t.log)"
  echo "$f" >> "$done_f"  # a file cut by the budget (rc 124/137) is not retried: its log says how far it got
done
