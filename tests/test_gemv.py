"""The batch-1 decode GEMV of ``rlserve.layers.gemv`` on CPU, through Triton's interpreter, against
the unfused ops it replaces (fused add + RMSNorm then ``F.linear``; SiLU-and-mul then ``F.linear``;
``F.linear``), and whole tiny Qwen3 / Llama models at batch 1 with and without it.

Tolerances: the folded op rounds where the unfused op rounds, so the GEMV's input vector equals
the reference's up to the order of the norm's float32 mean (one unit in the last place of that
vector at most); the dot product then sums ``K`` float32 products in another order than PyTorch's
GEMM. float32: |diff| <= 1e-5 x sum_k |w_k x_k| (a few float32 roundings of every partial sum,
K <= 1024 terms: K x 2^-24 ~ 6e-5 is the worst-case bound; 1e-5 leaves room for typical
cancellation only, and is 100x above the differences seen); float16 (the interpreter has no
bfloat16): the output is rounded once to float16, so 2 units of 2^-10 relative (one rounding
each side) plus the float32 bound.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tests.triton_interp  # noqa: F401  (skips this module, or sets TRITON_INTERPRET=1 first)
from rlserve.layers import fused_ops, gemv, pdl  # noqa: E402
from rlserve.layers.activation import SiluAndMul  # noqa: E402
from rlserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear  # noqa: E402
from rlserve.layers.norm import RMSNorm  # noqa: E402


@pytest.fixture
def gemv_on_cpu():
    prev = fused_ops.set_fused_kernels(True, on_cpu=True)
    prev_g = gemv.set_enabled(True)
    yield
    gemv.set_enabled(prev_g)
    fused_ops.set_fused_kernels(*prev)


def _lin(cls, K, N, dtype, g, bias=False):
    lin = (MergedColumnParallelLinear(K, [N], bias=bias, params_dtype=dtype) if cls == "col"
           else RowParallelLinear(K, N, bias=bias, params_dtype=dtype))
    lin.weight.data.copy_(torch.randn(N, K, generator=g) / K ** 0.5)
    if bias:
        lin.bias.data.copy_(torch.randn(N, generator=g))
    return lin


def assert_gemv_close(got, ref, w, x, dtype):
    """|got - ref| <= 1e-5 x (|W| @ |x|) (+ 2 float16 units of |ref| in float16), see the module docstring."""
    assert got.shape == ref.shape and got.dtype == ref.dtype
    scale = (w.float().abs() @ x.float().abs().reshape(-1, 1)).reshape(ref.shape)
    tol = 1e-5 * scale + (2 * 2.0 ** -10 * ref.float().abs() if dtype == torch.float16 else 0)
    err = (got.float() - ref.float()).abs()
    assert (err <= tol).all(), (err - tol).max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("K,N,bias", [(64, 200, False), (96, 37, True), (1536, 24, False), (64, 5, True)])  # N=5: 1 row a program
def test_linear(dtype, K, N, bias, gemv_on_cpu):
    g = torch.Generator().manual_seed(K + N)
    lin = _lin("row", K, N, dtype, g, bias)
    x = torch.randn(1, K, generator=g).to(dtype)
    assert gemv.takes(x, lin)
    ref = F.linear(x, lin.weight, lin.bias)
    assert_gemv_close(gemv.linear(x, lin), ref, lin.weight, x, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("K,N,with_res", [(64, 96, True), (96, 50, False), (1280, 40, True)])
def test_norm_linear(dtype, K, N, with_res, gemv_on_cpu):
    g = torch.Generator().manual_seed(K * N)
    norm = RMSNorm(K, eps=1e-6, params_dtype=dtype)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(K, generator=g))
    lin = _lin("col", K, N, dtype, g)
    x = (3 * torch.randn(1, K, generator=g)).to(dtype)
    r = torch.randn(1, K, generator=g).to(dtype) if with_res else None
    assert gemv.takes(x, lin) and gemv.norm_ok(norm, x)
    if with_res:
        normed, ref_res = norm(x, r)  # the fused add + RMSNorm kernel the GEMV replaces
    else:
        normed, ref_res = norm(x), x
    out, res = gemv.norm_linear(x, r, norm, lin)
    assert torch.equal(res, ref_res)  # x + r rounded exactly as the unfused add
    assert_gemv_close(out, F.linear(normed, lin.weight), lin.weight, normed, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("d,N", [(80, 64), (1100, 30)])
def test_silu_mul_linear(dtype, d, N, gemv_on_cpu):
    g = torch.Generator().manual_seed(d)
    lin = _lin("row", d, N, dtype, g)
    gu = (3 * torch.randn(1, 2 * d, generator=g)).to(dtype)
    act = SiluAndMul()(gu)
    assert_gemv_close(gemv.silu_mul_linear(gu, lin), F.linear(act, lin.weight), lin.weight, act, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("K", [96, 80])
def test_several_chunks(dtype, K, gemv_on_cpu, monkeypatch):
    """32-column chunks (K = 96: three whole chunks; K = 80: the third one masked), as K > 4096
    runs on a GPU (Qwen3-8B's down_proj: three chunks of 4096): all three forms."""
    monkeypatch.setattr(gemv, "_MAX_BLOCK_K", 32)
    assert gemv.tile(40, K, torch.device("cpu"))[1] == 32
    g = torch.Generator().manual_seed(K)
    lin = _lin("row", K, 40, dtype, g, bias=True)
    x = (3 * torch.randn(1, K, generator=g)).to(dtype)
    assert_gemv_close(gemv.linear(x, lin), F.linear(x, lin.weight, lin.bias), lin.weight, x, dtype)
    norm = RMSNorm(K, eps=1e-6, params_dtype=dtype)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(K, generator=g))
    r = torch.randn(1, K, generator=g).to(dtype)
    normed, ref_res = norm(x, r)
    out, res = gemv.norm_linear(x, r, norm, lin)
    assert torch.equal(res, ref_res)
    assert_gemv_close(out, F.linear(normed, lin.weight, lin.bias), lin.weight, normed, dtype)
    gu = torch.cat([x, (2 * torch.randn(1, K, generator=g)).to(dtype)], dim=1)
    act = SiluAndMul()(gu)
    assert_gemv_close(gemv.silu_mul_linear(gu, lin), F.linear(act, lin.weight, lin.bias), lin.weight, act, dtype)


def test_takes_only_batch_one_unhooked_unquantized(gemv_on_cpu):
    g = torch.Generator().manual_seed(0)
    lin = _lin("row", 32, 16, torch.float32, g)
    x = torch.randn(1, 32)
    assert gemv.takes(x, lin)
    assert not gemv.takes(torch.randn(2, 32), lin)  # batch 2: the GEMM
    assert not gemv.takes(x.half(), lin)  # dtype mismatch
    h = lin.register_forward_hook(lambda *a: None)  # LoRA's hooks: the module path
    assert not gemv.takes(x, lin)
    h.remove()
    gemv.set_enabled(False)
    assert not gemv.takes(x, lin)
    gemv.set_enabled(True)
    fused_ops.set_fused_kernels(True, on_cpu=False)  # a CPU tensor without the interpreter asked for
    assert not gemv.takes(x, lin)
    # the interpreter counts 4 SMs: >= 8 programs; tiles of <= 16384 elements
    assert gemv.tile(4096, 1024, x.device) == (16, 1024, 8)
    assert gemv.tile(20, 64, x.device) == (2, 64, 4)
    assert gemv.tile(4096, 12288, x.device) == (4, 4096, 8)
    assert gemv.tile(1024, 3072, x.device) == (4, 4096, 8)


def test_whole_model_batch_one_equals_unfused(tiny_model, gemv_on_cpu, monkeypatch):
    """Tiny Qwen3 (q/k norm, tied embeddings) and Llama, float32, one prompt (every decode step
    at batch 1): greedy tokens equal and logprobs within 1e-4 nats with the GEMV against the
    fused-kernel path without it; the GEMV ran (3 kernels a layer per decode step)."""
    from rlserve import LLM, SamplingParams

    calls = {"n": 0}
    launch = gemv._launch
    monkeypatch.setattr(gemv, "_launch", lambda *a, **kw: calls.__setitem__("n", calls["n"] + 1) or launch(*a, **kw))
    params = SamplingParams(temperature=0, max_tokens=4, min_tokens=4, logprobs=3)
    for arch in ("qwen3", "llama"):
        path = tiny_model(arch)
        gemv.set_enabled(False)
        ref = LLM(path, dtype="float32", device="cpu", block_size=4).generate(["The capital of France is"], params)
        assert calls["n"] == 0
        gemv.set_enabled(True)
        got = LLM(path, dtype="float32", device="cpu", block_size=4).generate(["The capital of France is"], params)
        assert got[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
        for da, db in zip(got[0].outputs[0].logprobs, ref[0].outputs[0].logprobs):
            assert da.keys() == db.keys()
            for t in db:
                assert abs(da[t] - db[t]) < 1e-4
        assert calls["n"] > 0
        calls["n"] = 0


def test_env_switch_values(monkeypatch):
    """RLSERVE_DECODE_GEMV: auto (default), pdl, 1, 0; anything else raises naming the variable."""
    from rlserve import envs

    monkeypatch.delenv("RLSERVE_DECODE_GEMV", raising=False)
    assert envs.read("RLSERVE_DECODE_GEMV") == "auto"
    for raw in ("0", "1", "pdl", "auto"):
        monkeypatch.setenv("RLSERVE_DECODE_GEMV", raw)
        assert envs.read("RLSERVE_DECODE_GEMV") == raw
    monkeypatch.setenv("RLSERVE_DECODE_GEMV", "on")
    with pytest.raises(ValueError, match="RLSERVE_DECODE_GEMV"):
        envs.read("RLSERVE_DECODE_GEMV")


def test_pdl_is_not_claimed_off_cuda():
    """PDL needs a CUDA device: on CPU the reason says so, and nothing launches with it."""
    dev = torch.device("cpu")
    assert pdl.unavailable(dev) == "not a CUDA device (cpu)"
    assert pdl.set_neighbours(False) is False  # the attention kernels' PDL is off by default (not run on a GPU)
    prev = pdl.set_requested(True)
    try:
        assert not pdl.on(dev)
        assert not pdl.neighbours(torch.zeros(1, 4), 1)
    finally:
        pdl.set_requested(prev)


def test_mode_names_the_switches():
    prev_e, prev_p = gemv.set_enabled("auto"), gemv.set_pdl(True)
    try:
        assert gemv.mode() == "auto" and gemv.enabled()
        assert gemv.set_enabled(True) == "auto"  # the previous setting, to restore
        assert gemv.mode() == "pdl"
        gemv.set_pdl(False)
        assert gemv.mode() == "1"
        gemv.set_enabled(False)
        assert gemv.mode() == "0"
    finally:
        gemv.set_enabled(prev_e)
        gemv.set_pdl(prev_p)


def test_a_failing_pdl_launch_falls_back_to_plain_launches(monkeypatch, gemv_on_cpu):
    """Where the first PDL launch raises (an old driver or Triton), the GEMV launches plainly -- the
    same result as without PDL -- and never tries PDL on that device again."""
    real = gemv._kernels()
    tries = {"pdl": 0, "plain": 0}

    class Launch:
        def __init__(self, grid):
            self.grid = grid

        def __call__(self, *a, PDL, **kw):
            if PDL:
                tries["pdl"] += 1
                raise RuntimeError("launch_pdl is not supported")
            tries["plain"] += 1
            return real._gemv_kernel[self.grid](*a, PDL=False, **kw)

    class Kernels:
        class _gemv_kernel:
            def __class_getitem__(cls, grid):
                return Launch(grid)

    monkeypatch.setattr(gemv, "_kernels", lambda: Kernels)
    monkeypatch.setitem(pdl._WHY, ("cpu", None), None)  # as if this device had PDL
    prev = gemv.set_pdl(True)
    try:
        g = torch.Generator().manual_seed(7)
        lin = _lin("row", 64, 40, torch.float32, g)
        x = torch.randn(1, 64, generator=g)
        for _ in range(2):
            assert_gemv_close(gemv.linear(x, lin), F.linear(x, lin.weight), lin.weight, x, torch.float32)
        assert tries == {"pdl": 1, "plain": 2}
        assert pdl.unavailable(torch.device("cpu")).startswith(
            "the first PDL launch failed: RuntimeError: launch_pdl is not supported")
    finally:
        gemv.set_pdl(prev)


def test_auto_takes_only_the_measured_sizes(monkeypatch, gemv_on_cpu):
    """RLSERVE_DECODE_GEMV=auto (the default) runs the GEMV only where every linear of the call has
    at most _AUTO_MAX_ELEMENTS weights (the sizes measured faster than cuBLAS); 1 / pdl: every size."""
    g = torch.Generator().manual_seed(3)
    small, big = _lin("row", 64, 40, torch.float32, g), _lin("row", 64, 41, torch.float32, g)
    x = torch.randn(1, 64, generator=g)
    monkeypatch.setattr(gemv, "_AUTO_MAX_ELEMENTS", 64 * 40)
    prev = gemv.set_enabled("auto")
    try:
        assert gemv.takes(x, small) and not gemv.takes(x, big) and not gemv.takes(x, small, big)
        gemv.set_enabled(True)
        assert gemv.takes(x, small, big)
    finally:
        gemv.set_enabled(prev)
