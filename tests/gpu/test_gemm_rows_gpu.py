"""The small-batch decode GEMM (``rlserve.layers.gemm_rows_kernels`` through ``rlserve.layers.gemv`` at
2..64 rows) compiled on a CUDA GPU.

- bf16 at the Qwen3-0.6B and Qwen3-8B linear shapes at 5, 16 and 64 rows (every row tile; K split where
  the shape asks for it), plain, with SiLU-and-mul folded in (down_proj) and with the add + RMSNorm folded
  in (qkv / gate_up: the residual equal, each input element within one bf16 rounding of the unfused
  norm's, 2 eps of the absolute sum more), against ``F.linear`` (cuBLAS) on the same
  GPU within ``tol = 2 ulp(dtype) x |ref| + 1e-5 x (|x| @ |W|.T)`` (the output rounded once on each side;
  float32 sums of K <= 12,288 products in another order: 1e-5 of the absolute sum is ~100x the
  reordering error at these sizes).
- a chain of split-K launches captured in one CUDA graph (programmatic dependent launch where the card
  has it) and replayed: bitwise the eager launches (the split's partials are summed in a fixed order by
  whichever program comes last), the tile counters zero after every replay.
- a tiny Qwen3 engine, float32, four prompts decoding together: greedy tokens with the GEMM equal those
  without it, logprobs within 1e-3 nats (float32 sums in another order over 24 steps); CUDA graphs
  (steps padded to the capture size) equal eager within 1e-4 (the attention's split plan may differ).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from rlserve.layers import fused_ops, gemv, pdl  # noqa: E402
from rlserve.layers.norm import RMSNorm  # noqa: E402

DEV = torch.device("cuda")
EPS_OF = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}
# (K, N) of qkv_proj, o_proj, gate_up_proj, down_proj: Qwen3-0.6B, then Qwen3-8B
SHAPES = [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024),
          (4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096)]


@pytest.fixture
def rows_switch():
    prev = fused_ops.set_fused_kernels(True)
    prev_g, prev_r = gemv.set_enabled(True), gemv.set_rows(64)
    yield gemv.set_rows
    gemv.set_rows(prev_r)
    gemv.set_enabled(prev_g)
    fused_ops.set_fused_kernels(*prev)


def assert_close(got, ref, x, w, dtype, extra=0.0):
    assert got.shape == ref.shape and got.dtype == ref.dtype
    tol = 2 * EPS_OF[dtype] * ref.float().abs() + (1e-5 + extra) * (x.float().abs() @ w.float().abs().T)
    err = (got.float() - ref.float()).abs()
    bad = err > tol
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} beyond tolerance; max excess {(err - tol).max()}"


def _zero():
    return all(int(c.abs().sum()) == 0 for c in gemv._CNT.values())


# the graph and engine tests first: a cut device window keeps them


def test_split_k_chain_in_a_cuda_graph_equals_eager(rows_switch):
    """Four Qwen3-8B o_proj / down_proj-shaped launches (K split) at 16 rows in one CUDA graph, replayed
    20 times on fresh inputs: bitwise the eager launches, counters zero."""
    g = torch.Generator(device=DEV).manual_seed(1)
    dt = torch.bfloat16
    ws = [(torch.randn(4096, 4096, generator=g, device=DEV) / 64).to(dt),
          (torch.randn(4096, 12288, generator=g, device=DEV) / 110).to(dt)]
    assert gemv.rows_tile(16, 4096, 12288, DEV)[3] > 1  # split
    x_in = torch.empty(16, 4096, dtype=dt, device=DEV)

    def chain(x):
        for _ in range(2):
            h = gemv._launch_rows(0, x, 4096, ws[0], None)[0]
            x = gemv._launch_rows(2, torch.cat([h, h, h, h, h, h], dim=1), 12288, ws[1], None)[0]
        return x

    prev = gemv.set_pdl(pdl.unavailable(DEV) is None)
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            chain(x_in)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(x_in)
        for i in range(20):
            x_in.copy_(torch.randn(16, 4096, generator=g, device=DEV))
            graph.replay()
            ref = chain(x_in)
            torch.cuda.synchronize()
            assert torch.equal(out, ref), f"replay {i}"
            assert _zero()
    finally:
        gemv.set_pdl(prev)


def test_engine_batch_four_rows_equals_without_and_graphs_equal_eager(tiny_model, rows_switch, monkeypatch):
    from rlserve import LLM, SamplingParams

    from tests.gpu.test_gpu_engine import KW, PROMPTS

    seen = []
    real = gemv._launch_rows
    monkeypatch.setattr(gemv, "_launch_rows", lambda *a, **kw: seen.append(a[1].shape[0]) or real(*a, **kw))
    runs = {}
    for rows, eager in ((0, False), (64, False), (64, True)):
        rows_switch(rows)
        llm = LLM(tiny_model("qwen3"), dtype="float32", enforce_eager=eager, **KW)
        runs[rows, eager] = [o.outputs[0] for o in llm.generate(
            PROMPTS[:4], SamplingParams(temperature=0, max_tokens=24, min_tokens=24, logprobs=3))]
        del llm
        torch.cuda.empty_cache()
    assert 4 in seen  # the eager decode steps of four rows took the GEMM
    pairs = ((runs[64, False], runs[0, False], 1e-3), (runs[64, True], runs[64, False], 1e-4))
    for got, base, tol in pairs:  # GEMM on vs off; eager vs graphs
        for a, b in zip(got, base):
            assert a.token_ids == b.token_ids
            assert all(abs(da[t] - db[t]) < tol for da, db in zip(a.logprobs, b.logprobs) for t in db)


@pytest.mark.parametrize("K,N", SHAPES)
def test_rows_bf16_against_cublas(K, N, rows_switch):
    g = torch.Generator(device=DEV).manual_seed(K + N)
    dt = torch.bfloat16
    w = (torch.randn(N, K, generator=g, device=DEV) / K ** 0.5).to(dt)
    for M in (5, 16, 64):
        x = torch.randn(M, K, generator=g, device=DEV).to(dt)
        assert_close(gemv._launch_rows(0, x, K, w, None)[0], F.linear(x, w), x, w, dt)
        if (K, N) in ((1024, 4096), (4096, 6144), (4096, 24576)):  # qkv / gate_up: add + RMSNorm folded in
            norm = RMSNorm(K, eps=1e-6, params_dtype=dt).to(DEV)
            norm.weight.data.copy_(1 + 0.1 * torch.randn(K, generator=g, device=DEV))
            h = (3 * torch.randn(M, K, generator=g, device=DEV)).to(dt)
            r = torch.randn(M, K, generator=g, device=DEV).to(dt)
            normed, ref_res = norm(h, r)
            out, res = gemv._launch_rows(1, h, K, w, None, residual=r, norm_weight=norm.weight, eps=norm.eps)
            assert torch.equal(res, ref_res)
            # each input element may be one bf16 rounding away from the unfused norm's (test_gemm_rows.py)
            assert_close(out, F.linear(normed, w), normed, w, dt, extra=2 * EPS_OF[dt])
        if (K, N) in ((3072, 1024), (12288, 4096)):  # down_proj: SiLU-and-mul folded in
            gu = (3 * torch.randn(M, 2 * K, generator=g, device=DEV)).to(dt)
            act = F.silu(gu[:, :K]) * gu[:, K:]  # bf16 ops: rounded as SiluAndMul's reference
            assert_close(gemv._launch_rows(2, gu, K, w, None)[0], F.linear(act, w), act, w, dt)
        torch.cuda.synchronize()
        assert _zero()
