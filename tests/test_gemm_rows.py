"""The small-batch decode GEMM (``rlserve.layers.gemm_rows_kernels`` through ``rlserve.layers.gemv`` at
2..64 rows) on CPU, through Triton's interpreter, against float64 references and the unfused ops, and
whole tiny Qwen3 / Llama models at batch 3 with and without it.

Tolerances (the float64 reference of the same rounded inputs): float32 (``input_precision="ieee"``):
|diff| <= 1e-5 x sum_k |w_k x_k| (K <= 1100 float32 additions in another order: K x 2^-24 ~ 7e-5 is
the worst case; 1e-5 is 10x above what is seen); float16 weights (the interpreter has no bfloat16):
the output is rounded once to float16, so one unit of 2^-10 relative of |ref| plus the float32 bound.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tests.triton_interp  # noqa: F401  (skips this module, or sets TRITON_INTERPRET=1 first)
from rlserve.layers import fused_ops, gemv  # noqa: E402
from rlserve.layers.activation import SiluAndMul  # noqa: E402
from rlserve.layers.linear import RowParallelLinear  # noqa: E402
from rlserve.layers.norm import RMSNorm  # noqa: E402


@pytest.fixture
def rows_on_cpu():
    prev = fused_ops.set_fused_kernels(True, on_cpu=True)
    prev_g, prev_r = gemv.set_enabled(True), gemv.set_rows(64)
    prev_f = gemv.set_rows_fold(True)  # the kernel's folded prologues (the default runs them as their own kernels)
    yield
    gemv.set_rows_fold(prev_f)
    gemv.set_rows(prev_r)
    gemv.set_enabled(prev_g)
    fused_ops.set_fused_kernels(*prev)


def _lin(K, N, dtype, g, bias=False):
    lin = RowParallelLinear(K, N, bias=bias, params_dtype=dtype)
    lin.weight.data.copy_(torch.randn(N, K, generator=g) / K ** 0.5)
    if bias:
        lin.bias.data.copy_(torch.randn(N, generator=g))
    return lin


def assert_close64(got, x, w, b, dtype):
    """``got`` against ``x @ w.T + b`` in float64 (module docstring's tolerance)."""
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    scale = x.double().abs() @ w.double().abs().T
    tol = 1e-5 * scale + (2.0 ** -10 * ref.abs() if dtype == torch.float16 else 0)
    assert got.shape == ref.shape and got.dtype == dtype
    err = (got.double() - ref).abs()
    assert (err <= tol).all(), (err - tol).max().item()


def _counters_zero():
    return all(int(c.abs().sum()) == 0 for c in gemv._CNT.values())


# (M, K, N): one row tile of 16 / 32 / 64, K split (K = 1100: 9 chunks of 128, split over programs;
# N = 37: a masked column tile) or not
CASES = [(2, 96, 200), (5, 1100, 40), (16, 512, 64), (17, 300, 37), (64, 80, 37)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,K,N", CASES)
def test_linear_and_silu_mul(dtype, M, K, N, rows_on_cpu):
    g = torch.Generator().manual_seed(M * K + N)
    lin = _lin(K, N, dtype, g, bias=M % 2 == 1)
    x = torch.randn(M, K, generator=g).to(dtype)
    assert gemv.takes(x, lin)
    assert_close64(gemv.linear(x, lin), x, lin.weight, lin.bias, dtype)
    gu = (3 * torch.randn(M, 2 * K, generator=g)).to(dtype)
    act = SiluAndMul()(gu)  # the unfused op: its rounding is the kernel's prologue's
    assert_close64(gemv.silu_mul_linear(gu, lin), act, lin.weight, lin.bias, dtype)
    assert _counters_zero()


def test_split_k_is_used_and_leaves_counters_zero(rows_on_cpu):
    """K = 1100 over 40 columns: one column tile, K split into 5 ranges (the interpreter counts 4 SMs:
    8 programs wanted); the one-pass reduction gives the float64 result and resets its counters."""
    assert gemv.rows_tile(5, 40, 1100, torch.device("cpu")) == (16, 64, 128, 5, 256)
    assert gemv.rows_tile(20, 4096, 1024, torch.device("cpu")) == (32, 64, 128, 1, 1024)
    assert gemv.rows_tile(64, 16, 16, torch.device("cpu")) == (64, 16, 16, 1, 16)
    with pytest.raises(ValueError, match="65 rows"):
        gemv.rows_tile(65, 40, 64, torch.device("cpu"))
    g = torch.Generator().manual_seed(11)
    lin = _lin(1100, 40, torch.float32, g, bias=True)
    for M in (2, 9):
        x = torch.randn(M, 1100, generator=g)
        assert_close64(gemv.linear(x, lin), x, lin.weight, lin.bias, torch.float32)
        assert _counters_zero()


def test_a_row_does_not_depend_on_the_rows_beside_it(rows_on_cpu):
    """Within one row tile a row's output is bitwise the same whatever the other rows hold and however
    many there are (a CUDA graph padded from 5 to 8 or 16 rows computes the eager step's rows)."""
    g = torch.Generator().manual_seed(5)
    lin = _lin(1100, 40, torch.float32, g)
    x = torch.randn(16, 1100, generator=g)
    full = gemv.linear(x, lin)
    assert torch.equal(gemv.linear(x[:5].clone(), lin), full[:5])
    y = x.clone()
    y[5:] = torch.randn(11, 1100, generator=g)
    assert torch.equal(gemv.linear(y, lin)[:5], full[:5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,K,N,with_res", [(4, 96, 50, True), (4, 96, 50, False), (5, 1100, 40, True),
                                            (17, 300, 150, True)])
def test_norm_linear_rows(dtype, M, K, N, with_res, rows_on_cpu):
    """More than one row: the add + RMSNorm folded into the GEMM (K = 1100: split over 5 programs, the
    h^2 partials reduced with the output's; N = 150: three column tiles, the first writes the residual).
    The residual is exactly the unfused add's. The output against F.linear on the unfused norm's output
    in float64: the kernel multiplies ``w_norm * h`` rounded and scales by ``rstd`` after the dot
    products, where the unfused norm rounds ``h * rstd`` and its product with ``w_norm``: each input
    element may differ by one unit of the dtype (2^-10 relative in float16, 2^-23 in float32), so
    |diff| <= 2 eps x sum_k |w_k x_k| (+ one rounding of the output, 2^-10 |ref| in float16) on top of
    the module's float32 bound."""
    g = torch.Generator().manual_seed(M * K)
    norm = RMSNorm(K, eps=1e-6, params_dtype=dtype)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(K, generator=g))
    lin = _lin(K, N, dtype, g, bias=M == 5)
    x = (3 * torch.randn(M, K, generator=g)).to(dtype)
    r = torch.randn(M, K, generator=g).to(dtype) if with_res else None
    assert gemv.takes(x, lin) and gemv.norm_ok(norm, x)
    normed, ref_res = norm(x, r) if with_res else (norm(x), x)
    out, res = gemv.norm_linear(x, r, norm, lin)
    assert torch.equal(res, ref_res)
    ref = F.linear(normed.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
    eps = 2.0 ** -10 if dtype == torch.float16 else 2.0 ** -23
    scale = normed.double().abs() @ lin.weight.double().abs().T
    tol = (1e-5 + 2 * eps) * scale + (2.0 ** -10 * ref.abs() if dtype == torch.float16 else 0)
    err = (out.double() - ref).abs()
    assert out.dtype == dtype and (err <= tol).all(), (err - tol).max().item()
    assert _counters_zero()


def test_unfolded_default_is_the_fused_kernel_then_the_plain_gemm(rows_on_cpu, monkeypatch):
    """``RLSERVE_DECODE_GEMM_ROWS_FOLD`` off (the default): the add + RMSNorm and SiLU-and-mul run as their
    own fused kernels and the GEMM without a prologue: bitwise ``linear`` of the unfused op's output, the
    residual the unfused add's, one GEMM launch each, with prologue 0."""
    from rlserve.layers import fused_ops

    launched = []
    launch = gemv._launch_rows
    monkeypatch.setattr(gemv, "_launch_rows", lambda p, *a, **kw: launched.append(p) or launch(p, *a, **kw))
    assert gemv.set_rows_fold(False) is True
    g = torch.Generator().manual_seed(3)
    K, N, M = 300, 150, 5
    dtype = torch.float16
    norm = RMSNorm(K, eps=1e-6, params_dtype=dtype)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(K, generator=g))
    lin = _lin(K, N, dtype, g)
    x, r = (3 * torch.randn(M, K, generator=g)).to(dtype), torch.randn(M, K, generator=g).to(dtype)
    h, ref_res = fused_ops.rms_norm(x, norm.weight, norm.eps, r)
    out, res = gemv.norm_linear(x, r, norm, lin)
    assert torch.equal(res, ref_res) and torch.equal(out, gemv.linear(h, lin))
    out, res = gemv.norm_linear(x, None, norm, lin)
    assert res is x and torch.equal(out, gemv.linear(fused_ops.rms_norm(x, norm.weight, norm.eps), lin))
    gu = (3 * torch.randn(M, 2 * K, generator=g)).to(dtype)
    assert torch.equal(gemv.silu_mul_linear(gu, lin), gemv.linear(fused_ops.silu_and_mul(gu), lin))
    assert launched == [0] * 6  # each call once, its reference once: no folded prologue
    gemv.set_rows_fold(True)
    gemv.norm_linear(x, r, norm, lin)
    gemv.silu_mul_linear(gu, lin)
    assert launched[6:] == [1, 2]


def test_takes_rows_only_when_switched_on(rows_on_cpu, monkeypatch):
    g = torch.Generator().manual_seed(0)
    lin = _lin(32, 16, torch.float32, g)
    monkeypatch.setattr(gemv, "_AUTO_MAX_ELEMENTS", 1)  # "auto" would refuse this size at one row
    prev = gemv.set_enabled("auto")
    try:
        assert not gemv.takes(torch.randn(1, 32), lin)
        assert gemv.takes(torch.randn(2, 32), lin) and gemv.takes(torch.randn(64, 32), lin)  # every size
        assert not gemv.takes(torch.randn(65, 32), lin)
        assert gemv.set_rows(8) == 64
        assert gemv.takes(torch.randn(8, 32), lin) and not gemv.takes(torch.randn(9, 32), lin)
        gemv.set_rows(0)
        assert not gemv.takes(torch.randn(2, 32), lin)
        gemv.set_rows(64)
        gemv.set_enabled(False)  # RLSERVE_DECODE_GEMV=0: nothing
        assert not gemv.takes(torch.randn(2, 32), lin)
    finally:
        gemv.set_enabled(prev)
    with pytest.raises(ValueError, match="0..64"):
        gemv.set_rows(65)


def test_env_values(monkeypatch):
    from rlserve import envs

    monkeypatch.delenv("RLSERVE_DECODE_GEMM_ROWS", raising=False)
    assert envs.read("RLSERVE_DECODE_GEMM_ROWS") == 0
    monkeypatch.setenv("RLSERVE_DECODE_GEMM_ROWS", "64")
    assert envs.read("RLSERVE_DECODE_GEMM_ROWS") == 64
    for bad in ("65", "-1", "x"):
        monkeypatch.setenv("RLSERVE_DECODE_GEMM_ROWS", bad)
        with pytest.raises(ValueError, match="RLSERVE_DECODE_GEMM_ROWS"):
            envs.read("RLSERVE_DECODE_GEMM_ROWS")
    monkeypatch.delenv("RLSERVE_DECODE_GEMM_ROWS_FOLD", raising=False)
    assert envs.read("RLSERVE_DECODE_GEMM_ROWS_FOLD") is False
    monkeypatch.setenv("RLSERVE_DECODE_GEMM_ROWS_FOLD", "1")
    assert envs.read("RLSERVE_DECODE_GEMM_ROWS_FOLD") is True


def test_whole_model_batch_three_equals_unfused(tiny_model, rows_on_cpu, monkeypatch):
    """Tiny Qwen3 (q/k norm, tied embeddings) and Llama, float32, three prompts decoding together
    (decode steps of 3 rows): greedy tokens equal and logprobs within 1e-4 nats (float32 sums in
    another order over 4 steps) with the small-batch GEMM against cuBLAS-path F.linear; the GEMM ran
    3 times a layer per decode step (qkv_proj, o_proj, down_proj with SiLU-and-mul; gate_up_proj too:
    4 launches). Qwen3 with the folded prologues, Llama with the default (norm and SiLU-and-mul their own
    kernels before the plain GEMM)."""
    from rlserve import LLM, SamplingParams

    calls = {"n": 0}
    launch = gemv._launch_rows
    monkeypatch.setattr(gemv, "_launch_rows",
                        lambda *a, **kw: calls.__setitem__("n", calls["n"] + 1) or launch(*a, **kw))
    prompts = ["The capital of France is", "One two three", "Hello"]
    params = SamplingParams(temperature=0, max_tokens=4, min_tokens=4, logprobs=3)
    for arch, fold in (("qwen3", True), ("llama", False)):
        gemv.set_rows_fold(fold)
        path = tiny_model(arch)
        gemv.set_rows(0)
        ref = LLM(path, dtype="float32", device="cpu", block_size=4).generate(prompts, params)
        assert calls["n"] == 0
        gemv.set_rows(64)
        got = LLM(path, dtype="float32", device="cpu", block_size=4).generate(prompts, params)
        for a, b in zip(got, ref):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for da, db in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert da.keys() == db.keys()
                for t in db:
                    assert abs(da[t] - db[t]) < 1e-4
        assert calls["n"] > 0 and calls["n"] % 4 == 0
        calls["n"] = 0
