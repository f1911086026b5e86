"""The batch-1 decode GEMV (``rlserve.layers.gemv``) compiled on a CUDA GPU.

- bf16 at the Qwen3-0.6B and Qwen3-8B layer shapes, fp32 at the 0.6B ones, fp16 at qkv_proj's:
  each folded form against the unfused ops it replaces (fused add + RMSNorm then ``F.linear``, SiLU-and-mul then ``F.linear``,
  ``F.linear``) on the same GPU. The residual sum is equal; the GEMV's output is within
  ``tol = 2 ulp(dtype) x |ref| + 1e-5 x (|W| @ |x|)``: the output is rounded once on each side
  (one unit each), the float32 dot products differ in summation order (cuBLAS's split vs one
  program's chunks: K <= 12,288 terms, 1e-5 of the absolute sum is ~100x what float32 reordering
  gives at these sizes), and the folded norm may move one input element by one unit, which the
  absolute-sum term covers.
- programmatic dependent launch (``gemv.set_pdl``, :mod:`rlserve.layers.pdl`): a chain of GEMVs in a
  CUDA graph equals plain launches bitwise; so does a tiny Qwen3 engine at batch 1 (the GEMVs and the
  attention / q-k-norm-rope kernels between them with PDL).
- the engine at batch 1 (one prompt) in float32: greedy tokens with the GEMV equal those without
  it and logprobs within 1e-3 nats (float32 sums in another order, over 24 steps); with the GEMV,
  CUDA graphs equal eager (tokens, logprobs within 1e-4: the same kernels, the attention's split
  plan may differ).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from rlserve.layers import fused_ops, gemv, pdl  # noqa: E402
from rlserve.layers.activation import SiluAndMul  # noqa: E402
from rlserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear  # noqa: E402
from rlserve.layers.norm import RMSNorm  # noqa: E402

DEV = torch.device("cuda")
EPS_OF = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}
# (K, N) of qkv_proj, o_proj, gate_up_proj, down_proj: Qwen3-0.6B, then Qwen3-8B
SHAPES_06B = [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024)]
SHAPES_8B = [(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096)]


@pytest.fixture
def gemv_switch():
    prev = fused_ops.set_fused_kernels(True)
    prev_g = gemv.set_enabled(True)
    yield gemv.set_enabled
    gemv.set_enabled(prev_g)
    fused_ops.set_fused_kernels(*prev)


def _lin(K, N, dtype, g, col=True):
    lin = (MergedColumnParallelLinear(K, [N], bias=False, params_dtype=dtype) if col
           else RowParallelLinear(K, N, bias=False, params_dtype=dtype)).to(DEV)
    lin.weight.data.copy_(torch.randn(N, K, generator=g, device=DEV) / K ** 0.5)
    return lin


def assert_gemv_close(got, ref, w, x, dtype):
    assert got.shape == ref.shape and got.dtype == ref.dtype
    scale = (w.float().abs() @ x.float().abs().reshape(-1, 1)).reshape(ref.shape)
    tol = 2 * EPS_OF[dtype] * ref.float().abs() + 1e-5 * scale
    err = (got.float() - ref.float()).abs()
    bad = err > tol
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} beyond tolerance; max excess {(err - tol).max()}"


# bf16 at the 0.6B and 8B shapes, fp32 at the 0.6B ones, fp16 at qkv_proj's (each (K, dtype,
# prologue) compiles once: a short list keeps the device window's run short)
CASES = ([(torch.bfloat16, K, N) for K, N in SHAPES_06B + SHAPES_8B] + [(torch.float32, K, N) for K, N in SHAPES_06B]
         + [(torch.float16, *SHAPES_06B[0])])


# the PDL chain and the engine test first: the device window's run may cut the list short
def _chain(x, r, layers):
    """A decoder-like chain of the three forms; each kernel reads what the one before wrote."""
    for norm1, qkv, o, norm2, gate_up, down in layers:
        h, r = gemv.norm_linear(x, r, norm1, qkv)
        h = gemv.linear(h, o)
        gu, r = gemv.norm_linear(h, r, norm2, gate_up)
        x = gemv.silu_mul_linear(gu, down)
    return x, r


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs sm_90+")
def test_pdl_chain_in_a_cuda_graph_equals_plain_launches(gemv_switch):
    """8 layers of Qwen3-0.6B-shaped GEMVs (qkv 1024->4096, o 4096->1024, gate_up 1024->6144,
    down 3072->1024), captured in one CUDA graph with programmatic dependent launch and replayed
    50 times on fresh inputs: bitwise the outputs of plain launches of the same kernels (PDL
    changes when a kernel starts, never what it computes; a kernel reading its input before the
    previous one finished would differ)."""
    g = torch.Generator(device=DEV).manual_seed(7)
    dt = torch.bfloat16
    layers = []
    for _ in range(8):
        n1, n2 = (RMSNorm(1024, eps=1e-6, params_dtype=dt).to(DEV) for _ in range(2))
        for n in (n1, n2):
            n.weight.data.copy_(1 + 0.1 * torch.randn(1024, generator=g, device=DEV))
        layers.append((n1, _lin(1024, 4096, dt, g), _lin(4096, 1024, dt, g, col=False), n2,
                       _lin(1024, 6144, dt, g), _lin(3072, 1024, dt, g, col=False)))
    x_in = torch.empty(1, 1024, dtype=dt, device=DEV)
    r_in = torch.empty(1, 1024, dtype=dt, device=DEV)
    prev = gemv.set_pdl(True)
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            _chain(x_in, r_in, layers)  # compile the PDL variants outside the capture
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _chain(x_in, r_in, layers)
    finally:
        gemv.set_pdl(prev)
    for i in range(50):
        x_in.copy_(torch.randn(1, 1024, generator=g, device=DEV))
        r_in.copy_(torch.randn(1, 1024, generator=g, device=DEV))
        graph.replay()
        ref = _chain(x_in, r_in, layers)  # plain launches (PDL off)
        torch.cuda.synchronize()
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1]), f"replay {i}"


@pytest.mark.skipif(torch.cuda.is_available() and pdl.unavailable(DEV) is not None,
                    reason="programmatic dependent launch unavailable here (rlserve.layers.pdl)")
def test_engine_batch_one_pdl_equals_plain_launches_bitwise(tiny_model, gemv_switch):
    """A tiny Qwen3 in bf16 at batch 1, CUDA graphs, the GEMVs on: with programmatic dependent
    launch (the GEMVs and, ``pdl.set_neighbours``, the q/k-norm + rotary + KV-write kernel, decode
    attention and its split reduce) the greedy tokens and logprobs equal those of plain launches bitwise (PDL changes when
    a kernel starts, never what it computes: a kernel reading before the one before it finished
    would differ); every one of those kernels was launched with PDL."""
    from rlserve import LLM, SamplingParams

    from tests.gpu.test_gpu_engine import KW, PROMPTS

    path = tiny_model("qwen3")
    params = SamplingParams(temperature=0, max_tokens=32, min_tokens=32, logprobs=3)
    used = set()
    launch = pdl.launch

    def spy(kernel, grid, args, meta, device, use):
        if use:
            used.add(getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", "?"))
        return launch(kernel, grid, args, meta, device, use)

    pdl.launch = spy
    prev, prev_n = pdl.set_requested(True), pdl.set_neighbours(True)
    try:
        runs = {}
        for on in (False, True):
            pdl.set_requested(on)
            llm = LLM(path, dtype="bfloat16", **KW)
            assert llm.engine.executor.runner.cuda_graphs is not None
            runs[on] = llm.generate(PROMPTS[:1], params)[0].outputs[0]
            del llm
            torch.cuda.empty_cache()
    finally:
        pdl.launch = launch
        pdl.set_requested(prev)
        pdl.set_neighbours(prev_n)
    assert {"_gemv_kernel", "_decode_kernel"} <= used and any(n.startswith("_qkv_norm_rope_write") for n in used), used
    assert runs[True].token_ids == runs[False].token_ids
    assert runs[True].logprobs == runs[False].logprobs


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_engine_batch_one_gemv_equals_without_and_graphs_equal_eager(arch, tiny_model, gemv_switch):
    from rlserve import LLM, SamplingParams

    from tests.gpu.test_gpu_engine import KW, PROMPTS

    path = tiny_model(arch)
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24, logprobs=3)
    calls = {"n": 0}
    launch = gemv._launch

    def counted(*a, **kw):
        calls["n"] += 1
        return launch(*a, **kw)

    gemv._launch = counted
    try:
        runs = {}
        for on, eager in ((False, False), (True, False), (True, True)):
            gemv_switch(on)
            llm = LLM(path, dtype="float32", enforce_eager=eager, **KW)
            assert (llm.engine.executor.runner.cuda_graphs is None) == eager
            runs[on, eager] = llm.generate(PROMPTS[:1], params)[0].outputs[0]
            del llm
            torch.cuda.empty_cache()
        assert calls["n"] > 0
        on, off, on_eager = runs[True, False], runs[False, False], runs[True, True]
        for got, base, tol in ((on, off, 1e-3), (on_eager, on, 1e-4)):  # GEMV on vs off; graphs vs eager
            assert got.token_ids == base.token_ids
            for da, db in zip(got.logprobs, base.logprobs):
                for t in db:
                    assert abs(da[t] - db[t]) < tol
    finally:
        gemv._launch = launch


@pytest.mark.parametrize("dtype,K,N", CASES)
def test_linear(dtype, K, N, gemv_switch):
    g = torch.Generator(device=DEV).manual_seed(K + N)
    lin = _lin(K, N, dtype, g, col=False)
    x = torch.randn(1, K, generator=g, device=DEV).to(dtype)
    assert gemv.takes(x, lin)
    assert_gemv_close(gemv.linear(x, lin), F.linear(x, lin.weight), lin.weight, x, dtype)


@pytest.mark.parametrize("dtype,K,N", [c for c in CASES if c[1:] in (SHAPES_06B[0], SHAPES_06B[2], SHAPES_8B[2])])
@pytest.mark.parametrize("with_res", [True, False])
def test_norm_linear(dtype, K, N, with_res, gemv_switch):
    g = torch.Generator(device=DEV).manual_seed(K * 3 + N)
    norm = RMSNorm(K, eps=1e-6, params_dtype=dtype).to(DEV)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(K, generator=g, device=DEV))
    lin = _lin(K, N, dtype, g)
    x = (3 * torch.randn(1, K, generator=g, device=DEV)).to(dtype)
    r = torch.randn(1, K, generator=g, device=DEV).to(dtype) if with_res else None
    assert gemv.takes(x, lin) and gemv.norm_ok(norm, x)
    normed, ref_res = norm(x, r) if with_res else (norm(x), x)
    out, res = gemv.norm_linear(x, r, norm, lin)
    assert torch.equal(res, ref_res)
    assert_gemv_close(out, F.linear(normed, lin.weight), lin.weight, normed, dtype)


@pytest.mark.parametrize("dtype,K,N", [c for c in CASES if c[1:] in (SHAPES_06B[3], SHAPES_8B[3])])
def test_silu_mul_linear(dtype, K, N, gemv_switch):
    g = torch.Generator(device=DEV).manual_seed(K)
    lin = _lin(K, N, dtype, g, col=False)  # down_proj: K = d
    gu = (3 * torch.randn(1, 2 * K, generator=g, device=DEV)).to(dtype)
    act = SiluAndMul()(gu)
    assert_gemv_close(gemv.silu_mul_linear(gu, lin), F.linear(act, lin.weight), lin.weight, act, dtype)
