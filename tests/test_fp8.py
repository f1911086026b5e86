"""Online fp8 W8A8 (``--quantization fp8``) on CPU, the primitives and layers: the emulated path
computes the same function as the GPU ``torch._scaled_mm`` path (tests/gpu/test_fp8_gpu.py checks
that). Whole models: test_fp8_models.py.

Covered: quantize/dequantize error bounds, the sharded-rows property for fused qkv / gate_up
(TP slicing of quantized rows == quantizing this rank's rows), row-parallel shards, loader
errors, the ``_scaled_mm`` call against the kernel's documented contract.
"""

from __future__ import annotations

import pytest
import torch

from rlserve.distributed.parallel_state import tp_context
from rlserve.layers.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8Config,
    Fp8LinearMethod,
    dequantize_per_row,
    fp8_linear_emulated,
    get_quant_config,
    quantize_per_row,
)
from rlserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)

_FAKE_GROUP = object()  # layers only touch the group in forward; loading needs rank/size only


def u8(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of an fp8 tensor (``torch.equal`` is not defined for fp8 on every backend)."""
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(u8(a), u8(b))


# ---- primitives --------------------------------------------------------------------------------

def _rows_with_outliers(n=64, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-4, 2, n).unsqueeze(1)  # 6 decades of row scales
    w[3, 17] = 500.0  # an outlier
    w[5] = 0.0  # an all-zero row
    w[7, :] = 1e-30  # tiny values
    return w


def test_quantize_round_trip_error_bounds():
    w = _rows_with_outliers()
    q, s = quantize_per_row(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape and q.is_contiguous()
    assert s.dtype == torch.float32 and s.shape == (w.shape[0], 1)
    # scale = amax x float32(1/448) (amax floored at 1e-12), computed as a product so that CPU and
    # CUDA (whose kernel divides by a scalar through its reciprocal) agree bit for bit; the
    # largest magnitude of each row maps onto ±448
    amax = w.abs().amax(1, keepdim=True)
    inv = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)
    torch.testing.assert_close(s, amax.clamp(min=1e-12) * inv, rtol=0, atol=0)
    nz = amax.squeeze(1) > 1e-12
    assert torch.all(q.float().abs().amax(1)[nz] == FP8_MAX)
    assert torch.all(q[5].float() == 0)
    deq = dequantize_per_row(q, s)
    err = (deq - w).abs()
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals; subnormals (|q| < 2^-6) have an
    # absolute error <= half the smallest subnormal, 2^-10, in units of the scale.
    bound = w.abs() * 2.0**-4 + s * 2.0**-10
    assert torch.all(err <= bound * (1 + 1e-6)), float((err - bound).max())
    # overall: ~2-3% RMS relative error per element for Gaussian rows
    normal_rows = [i for i in range(w.shape[0]) if i not in (3, 5, 7)]
    rel = (deq[normal_rows] - w[normal_rows]).norm(dim=1) / w[normal_rows].norm(dim=1)
    assert rel.max() < 0.05, rel.max()
    # the outlier row: the outlier is exact-ish, the rest of the row loses precision (per-row scale)
    assert abs(deq[3, 17].item() - 500.0) <= 500.0 * 2**-4


def test_quantize_is_idempotent_on_fp8_grid_and_scale_equivariant():
    w = _rows_with_outliers(seed=1)
    q, s = quantize_per_row(w)
    q2, s2 = quantize_per_row(w * 4.0)  # exact power-of-two rescaling: same fp8 values, scales x4
    assert bit_equal(q, q2)
    live = w.abs().amax(1) * 4 > 1e-12  # rows 5 (zeros) and 7 (1e-30) sit on the 1e-12 floor
    assert torch.equal(s2[live], s[live] * 4.0) and torch.equal(s2[~live], s[~live])
    for dt in (torch.bfloat16, torch.float16):
        qd, sd = quantize_per_row(w.to(dt))
        assert qd.shape == w.shape and sd.dtype == torch.float32


def test_emulated_linear_is_the_dequantized_product():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=g) * torch.logspace(-2, 1, 7).unsqueeze(1)
    w = torch.randn(48, 96, generator=g) * 0.05
    b = torch.randn(48, generator=g)
    wq, ws = quantize_per_row(w)
    out = fp8_linear_emulated(x, wq, ws.view(-1), b)
    xq, xs = quantize_per_row(x)
    ref = (xq.float() * xs) @ (wq.float() * ws).t() + b
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    exact = x @ w.t() + b
    rel = (out - exact).norm() / exact.norm()
    assert rel < 0.05, rel
    # per-token activation scales: a row's result does not depend on the other rows of the batch
    torch.testing.assert_close(fp8_linear_emulated(x[2:3], wq, ws.view(-1), b), out[2:3], rtol=0, atol=0)
    # bf16 activations come back in bf16
    assert fp8_linear_emulated(x.bfloat16(), wq, ws.view(-1)).dtype == torch.bfloat16
    # empty batch
    assert fp8_linear_emulated(x[:0], wq, ws.view(-1)).shape == (0, 48)


def test_quant_config_selection():
    assert get_quant_config(None) is None
    assert isinstance(get_quant_config("fp8"), Fp8Config)
    with pytest.raises(ValueError):
        get_quant_config("int4")
    cfg = Fp8Config()
    lin = ReplicatedLinear(16, 32, bias=True, quant_config=cfg, prefix="model.layers.0.mlp.x")
    assert isinstance(lin.quant_method, Fp8LinearMethod)
    assert lin.weight.dtype == FP8_DTYPE and lin.weight_scale.dtype == torch.float32
    assert lin.bias.dtype == torch.get_default_dtype()
    assert lin.checkpoint_shapes("weight_scale") == {}  # computed, never in a checkpoint
    ign = ReplicatedLinear(16, 32, quant_config=Fp8Config(ignored_layers=["mlp.x"]), prefix="model.layers.0.mlp.x")
    assert ign.weight.dtype == torch.get_default_dtype()
    with pytest.raises(ValueError):
        Fp8Config(backend="nope")


# ---- sharded rows ------------------------------------------------------------------------------

def _qkv(tp: int, rank: int, quant=True, heads=8, kv_heads=2, head=16, hidden=64, bias=True):
    with tp_context(rank, tp, _FAKE_GROUP if tp > 1 else None):
        return QKVParallelLinear(hidden, head, heads, kv_heads, bias=bias, quant_config=Fp8Config() if quant else None,
                                 prefix="qkv_proj")


def _gate_up(tp: int, rank: int, inter=96, hidden=64):
    with tp_context(rank, tp, _FAKE_GROUP if tp > 1 else None):
        return MergedColumnParallelLinear(hidden, [inter, inter], bias=False, quant_config=Fp8Config(),
                                          prefix="gate_up_proj")


def _load_as_rank(layer, tp, rank, items):
    with tp_context(rank, tp, _FAKE_GROUP if tp > 1 else None):
        for param, tensor, sid in items:
            getattr(layer, param).weight_loader(getattr(layer, param), tensor, sid)


def _qkv_tensors(heads=8, kv_heads=2, head=16, hidden=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(heads * head, hidden, generator=g) * torch.rand(heads * head, 1, generator=g)
    k = torch.randn(kv_heads * head, hidden, generator=g) * 3
    v = torch.randn(kv_heads * head, hidden, generator=g) * 0.01
    bq, bk, bv = (torch.randn(t.shape[0], generator=g) for t in (q, k, v))
    return q, k, v, bq, bk, bv


@pytest.mark.parametrize("tp,kv_heads", [(2, 2), (4, 2), (8, 2), (2, 1)])
def test_qkv_shards_are_slices_of_the_quantized_full_tensor(tp, kv_heads):
    """Each rank's fp8 rows and scales == the TP=1 layer's rows for that rank's heads (including
    KV heads replicated over ranks when tp > kv_heads), whether given full or sharded tensors."""
    heads, head = 8, 16
    q, k, v, bq, bk, bv = _qkv_tensors(kv_heads=kv_heads)
    full = _qkv(1, 0, kv_heads=kv_heads)
    _load_as_rank(full, 1, 0, [("weight", q, "q"), ("weight", k, "k"), ("weight", v, "v"),
                               ("bias", bq, "q"), ("bias", bk, "k"), ("bias", bv, "v")])
    qs = heads * head
    kvs = kv_heads * head
    for rank in range(tp):
        layer = _qkv(tp, rank, kv_heads=kv_heads)
        _load_as_rank(layer, tp, rank, [("weight", q, "q"), ("weight", k, "k"), ("weight", v, "v")])
        nq = qs // tp
        nkv = layer.num_kv_heads * head
        kv_idx = rank // layer.num_kv_head_replicas
        rows = (list(range(rank * nq, (rank + 1) * nq))
                + [qs + i for i in range(kv_idx * nkv, (kv_idx + 1) * nkv)]
                + [qs + kvs + i for i in range(kv_idx * nkv, (kv_idx + 1) * nkv)])
        rows = torch.tensor(rows)
        assert bit_equal(layer.weight.data, full.weight.data[rows])
        assert torch.equal(layer.weight_scale.data, full.weight_scale.data[rows])
        # already-sharded inputs (what a TP-aware sender might give) land identically
        shard = _qkv(tp, rank, kv_heads=kv_heads)
        _load_as_rank(shard, tp, rank, [("weight", q[rank * nq:(rank + 1) * nq], "q"),
                                        ("weight", k[kv_idx * nkv:(kv_idx + 1) * nkv], "k"),
                                        ("weight", v[kv_idx * nkv:(kv_idx + 1) * nkv], "v")])
        assert bit_equal(shard.weight.data, layer.weight.data)
        assert torch.equal(shard.weight_scale.data, layer.weight_scale.data)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gate_up_shards_fused_and_split_loading(tp):
    g = torch.Generator().manual_seed(1)
    inter, hidden = 96, 64
    gate = torch.randn(inter, hidden, generator=g)
    up = torch.randn(inter, hidden, generator=g) * 7
    gq, gs = quantize_per_row(gate)
    uq, us = quantize_per_row(up)
    n = inter // tp
    for rank in range(tp):
        split = _gate_up(tp, rank)
        _load_as_rank(split, tp, rank, [("weight", gate, 0), ("weight", up, 1)])
        fused = _gate_up(tp, rank)
        _load_as_rank(fused, tp, rank, [("weight", torch.cat([gate, up]), None)])
        sl = slice(rank * n, (rank + 1) * n)
        want_q = torch.cat([gq[sl], uq[sl]])
        want_s = torch.cat([gs[sl], us[sl]]).view(-1)
        for layer in (split, fused):
            assert bit_equal(layer.weight.data, want_q)
            assert torch.equal(layer.weight_scale.data, want_s)


@pytest.mark.parametrize("tp", [2, 4])
def test_row_parallel_shards_quantize_this_ranks_columns(tp):
    """Row-parallel (o_proj / down_proj) shards the input dim: a rank quantizes its own columns
    (scales per output channel and rank); full and pre-sliced inputs give identical results."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(48, 128, generator=g)
    w[:, :64] *= 10  # rank 0's half has larger magnitudes: per-rank scales differ
    k = 128 // tp
    for rank in range(tp):
        with tp_context(rank, tp, _FAKE_GROUP):
            a = RowParallelLinear(128, 48, bias=False, quant_config=Fp8Config(), prefix="o_proj")
            b = RowParallelLinear(128, 48, bias=False, quant_config=Fp8Config(), prefix="o_proj")
            a.weight.weight_loader(a.weight, w)
            b.weight.weight_loader(b.weight, w[:, rank * k:(rank + 1) * k].contiguous())
        wq, ws = quantize_per_row(w[:, rank * k:(rank + 1) * k])
        for layer in (a, b):
            assert bit_equal(layer.weight.data, wq)
            assert torch.equal(layer.weight_scale.data, ws.view(-1))
    # TP=1: the full row
    r1 = RowParallelLinear(128, 48, bias=False, quant_config=Fp8Config())
    r1.weight.weight_loader(r1.weight, w)
    wq, ws = quantize_per_row(w)
    assert bit_equal(r1.weight.data, wq) and torch.equal(r1.weight_scale.data, ws.view(-1))


def test_column_parallel_and_replicated_layers():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 32, generator=g)
    b = torch.randn(64, generator=g)
    x = torch.randn(5, 32, generator=g)
    wq, ws = quantize_per_row(w)
    rep = ReplicatedLinear(32, 64, bias=True, quant_config=Fp8Config())
    rep.weight.weight_loader(rep.weight, w)
    rep.bias.weight_loader(rep.bias, b)
    assert bit_equal(rep.weight.data, wq)
    torch.testing.assert_close(rep(x), fp8_linear_emulated(x, wq, ws.view(-1), b), rtol=0, atol=0)
    for rank in range(2):
        with tp_context(rank, 2, _FAKE_GROUP):
            col = ColumnParallelLinear(32, 64, bias=True, quant_config=Fp8Config())
            col.weight.weight_loader(col.weight, w)
            col.bias.weight_loader(col.bias, b)
            sl = slice(rank * 32, (rank + 1) * 32)
            assert bit_equal(col.weight.data, wq[sl]) and torch.equal(col.weight_scale.data, ws.view(-1)[sl])
            torch.testing.assert_close(col(x), fp8_linear_emulated(x, wq[sl], ws.view(-1)[sl], b[sl]), rtol=0, atol=0)


def test_loader_errors_leave_parameters_untouched():
    layer = _qkv(1, 0)
    q, k, v, *_ = _qkv_tensors()
    _load_as_rank(layer, 1, 0, [("weight", q, "q"), ("weight", k, "k"), ("weight", v, "v")])
    before_w, before_s = layer.weight.data.clone(), layer.weight_scale.data.clone()
    bad = [(q[:-1], "q"), (k, "q"), (q.long(), "q"), (q, "x"), (q.view(-1), "q")]
    for t, sid in bad:
        with pytest.raises(ValueError):
            layer.weight.weight_loader(layer.weight, t, sid)
    with tp_context(1, 2, _FAKE_GROUP):
        row = RowParallelLinear(128, 48, bias=False, quant_config=Fp8Config())
    wq0 = row.weight.data.clone()
    with pytest.raises(ValueError):
        row.weight.weight_loader(row.weight, torch.randn(48, 100))
    assert bit_equal(row.weight.data, wq0)
    assert bit_equal(layer.weight.data, before_w) and torch.equal(layer.weight_scale.data, before_s)


# ---- the _scaled_mm call, checked against the kernel's documented contract ----------------------

def _fake_scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    """CPU stand-in for ``torch._scaled_mm`` (row-wise scaling) that enforces the constraints of
    aten/src/ATen/native/cuda/ScaledBlas.cpp: fp8 operands, ``a`` row-major ``[M, K]``, ``b``
    column-major ``[K, N]``, K and N multiples of 16, ``scale_a [M, 1]`` and ``scale_b [1, N]``
    float32 with unit inner stride."""
    assert a.dtype == FP8_DTYPE and b.dtype == FP8_DTYPE
    assert a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0]
    M, K = a.shape
    N = b.shape[1]
    assert K % 16 == 0 and N % 16 == 0, (K, N)
    assert a.stride(1) == 1 and b.stride(0) == 1, "a row-major, b column-major"
    assert scale_a.dtype == torch.float32 and tuple(scale_a.shape) == (M, 1) and scale_a.is_contiguous()
    assert scale_b.dtype == torch.float32 and tuple(scale_b.shape) == (1, N) and scale_b.stride(1) == 1
    assert scale_b.t().is_contiguous()
    out = (a.float() @ b.float()) * scale_a * scale_b
    return out.to(out_dtype or a.dtype)


@pytest.mark.parametrize("T,K,N", [(5, 64, 96), (1, 576, 960), (4, 72, 40), (3, 64, 100), (0, 32, 32)])
def test_scaled_mm_call_contract_and_padding(T, K, N, monkeypatch):
    from rlserve.layers.fp8 import fp8_linear_scaled_mm

    monkeypatch.setattr(torch, "_scaled_mm", _fake_scaled_mm)
    g = torch.Generator().manual_seed(T + K + N)
    x = torch.randn(T, K, generator=g)
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g)
    wq, ws = quantize_per_row(w)
    got = fp8_linear_scaled_mm(x, wq, ws.view(-1), b)
    want = fp8_linear_emulated(x, wq, ws.view(-1), b)
    assert got.shape == (T, N)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # and through a layer forced onto the scaled_mm backend
    lin = ReplicatedLinear(K, N, bias=True, quant_config=Fp8Config(backend="scaled_mm"))
    lin.weight.weight_loader(lin.weight, w)
    lin.bias.weight_loader(lin.bias, b)
    torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5)
