"""benchmarks/workload_floor.py's step summary (issue 37, session 16): per step class the time, the padded
rows and the serial floor (weights-or-GEMMs, then attention, each at its own bound), from a synthetic trace
whose every figure is worked out by hand below."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from workload_floor import summarize_steps, write_trace  # noqa: E402

BW = 1e12  # bytes/s
PEAK = 1e15  # FLOP/s


def _step(t, kind, tokens, seqs, rows, wb, kvb, lin, attn):
    return dict(t=t, kind=kind, tokens=tokens, seqs=seqs, rows=rows, weight_bytes=wb, kv_bytes=kvb,
                linear_flops=lin, attn_flops=attn)


TRACE = [
    # prefill: GEMM-bound (2e12 FLOPs = 2 ms > 1e9 bytes = 1 ms), attention FLOP-bound (1e12 = 1 ms > 1e8 B = 0.1 ms)
    _step(0.000, "P", 4096, 4, 4096, 1e9, 1e8, 2e12, 1e12),
    # decode 200 sequences in a 208-row graph: weights 1 ms > GEMM 0.5 ms; KV 3 ms > attention 0.01 ms
    _step(0.010, "D", 200, 200, 208, 1e9, 3e9, 5e11, 1e10),
    # decode 3 sequences in a 4-row graph: weights 1 ms; KV 0.2 ms
    _step(0.015, "D", 3, 3, 4, 1e9, 2e8, 1e9, 1e6),
    {"t": 0.022, "kind": "end"},
]


def test_summary_splits_time_padding_and_serial_floor_by_class():
    s = summarize_steps(TRACE, BW, PEAK)
    p = s["P"]
    assert (p["steps"], p["tokens"], p["rows"], p["padded_rows"]) == (1, 4096, 4096, 0)
    assert p["seconds"] == pytest.approx(0.010)  # launch to the next launch
    assert p["serial_floor_s"] == pytest.approx(0.002 + 0.001)
    assert p["x_serial_floor"] == pytest.approx(0.010 / 0.003)
    assert list(s["D"]) == ["<=8", "<=256"]  # buckets in BATCH_BUCKETS order, not insertion order
    big, small = s["D"]["<=256"], s["D"]["<=8"]
    assert (big["steps"], big["tokens"], big["rows"], big["padded_rows"]) == (1, 200, 208, 8)
    assert big["seconds"] == pytest.approx(0.005)
    assert big["serial_floor_s"] == pytest.approx(0.001 + 0.003)
    assert (small["padded_rows"], small["seconds"]) == (1, pytest.approx(0.007))
    assert small["serial_floor_s"] == pytest.approx(0.001 + 0.0002)
    assert s["serial_floor_s"] == pytest.approx(0.003 + 0.004 + 0.0012)


def test_trace_file_is_one_json_line_a_step_relative_to_the_first_launch(tmp_path):
    path = tmp_path / "steps.jsonl"
    write_trace([dict(st, t=st["t"] + 100.0) for st in TRACE], str(path))
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["kind"] for x in lines] == ["P", "D", "D", "end"]
    assert [x["t"] for x in lines] == pytest.approx([0.0, 0.010, 0.015, 0.022])
    assert lines[1]["rows"] - lines[1]["tokens"] == 8


def test_estimate_counts_every_linear_and_the_lm_head():
    """The estimate's weight bytes = the HF model's parameters (meta build) less the input embedding and the
    RMSNorm weights (2 a layer + the final one), 2 bytes each."""
    from model_shapes import num_params, shape_config
    from workload_floor import estimate_serial_floor

    c = shape_config("tiny-llama")
    est = estimate_serial_floor("tiny-llama", 1e12, 1e15, num_seqs=2, min_len=4, max_len=8)
    norms = (2 * c.num_hidden_layers + 1) * c.hidden_size
    assert est["weight_bytes"] == 2 * (num_params("tiny-llama") - c.vocab_size * c.hidden_size - norms)
    assert est["kv_bytes_per_token"] == c.num_hidden_layers * 2 * c.num_key_value_heads * 16 * 2  # head_dim 16
    assert est["total_s"] == pytest.approx(est["prefill_s"] + est["decode_weights_bound_s"]
                                           + est["decode_gemm_bound_s"] + est["decode_kv_s"])
    with pytest.raises(ValueError, match="dense shapes only"):
        estimate_serial_floor("small-qwen3-moe", 1e12, 1e15)
