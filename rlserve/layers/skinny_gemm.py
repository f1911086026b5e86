"""Decode-sized linears ``x [M, K] @ W[N, K]^T`` (few rows) as Triton kernels.

At decode batch sizes a linear layer is a read of its weight: cuBLAS's kernels for
``M = 1`` on Qwen3-0.6B's layers ran at 0.5-1.2 TB/s on an H200 (29.5 us of GEMMs per
layer against ~7 us to read its 30 MB once; ``benchmarks/decode_step.py --profile``,
2026-12-02). Two kernels, both one pass over the weight, float32 accumulation, no split-K
(every output element is summed by one program in a fixed order: deterministic):

- ``M == 1``: a GEMV, each program ``BLOCK_N`` output columns over the whole ``K``,
  ``w * x`` summed along ``K`` on CUDA cores;
- ``2 <= M <= max_rows``: ``tl.dot`` of an ``[BLOCK_M, BLOCK_K]`` tile of ``x`` (rows past
  ``M`` masked) with ``BLOCK_N`` weight rows.

Used by :class:`rlserve.layers.linear.UnquantizedLinearMethod` on CUDA for bf16 / fp16
inputs of at most ``RLSERVE_SKINNY_GEMM_MAX_M`` rows (read at import; ``0`` turns the
kernels off and every linear runs ``F.linear``). Results differ from cuBLAS's only in the
order of the float32 sums.
"""

from __future__ import annotations

import importlib.util
import os

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
_MAX_M = [int(os.environ.get("RLSERVE_SKINNY_GEMM_MAX_M", "0"))]
_ON_CPU = [False]  # tests: run on CPU tensors through Triton's interpreter
_K: list = []


def set_max_rows(n: int, on_cpu: bool = False) -> tuple[int, bool]:
    """Use the kernels for inputs of at most ``n`` rows (0: never); ``on_cpu`` also takes
    CPU tensors (Triton's interpreter, tests). Returns the previous ``(n, on_cpu)``. CUDA
    graphs captured before keep what they captured."""
    prev = (_MAX_M[0], _ON_CPU[0])
    _MAX_M[0], _ON_CPU[0] = int(n), bool(on_cpu)
    return prev


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` runs ``x @ weight.T``: a bf16/fp16 CUDA input (or CPU under the
    interpreter) of at most the configured rows, the weight of the same dtype with a unit
    last stride."""
    if _MAX_M[0] <= 0 or not HAS_TRITON or not (x.is_cuda or _ON_CPU[0]):
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype or weight.dim() != 2:
        return False
    rows = x.numel() // max(1, x.shape[-1])
    return 1 <= rows <= _MAX_M[0] and weight.stride(1) == 1 and x.shape[-1] == weight.shape[1]


def _kernels():
    if not _K:
        import triton
        import triton.language as tl

        @triton.jit
        def gemv(X, W, B, OUT, N, K, stride_wn, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
            offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < N
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                k_mask = kk < K
                x = tl.load(X + kk, mask=k_mask, other=0.0).to(tl.float32)
                w = tl.load(W + offs_n[:, None].to(tl.int64) * stride_wn + kk[None, :],
                            mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
                acc += w * x[None, :]
            out = tl.sum(acc, axis=1)
            if HAS_BIAS:
                out += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            tl.store(OUT + offs_n, out.to(OUT.dtype.element_ty), mask=n_mask)

        @triton.jit(do_not_specialize=["M"])
        def skinny(X, W, B, OUT, M, N, K, stride_xm, stride_wn, stride_om, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
            offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
            offs_m = tl.arange(0, BLOCK_M)
            n_mask = offs_n < N
            m_mask = offs_m < M
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                k_mask = kk < K
                x = tl.load(X + offs_m[:, None] * stride_xm + kk[None, :], mask=m_mask[:, None] & k_mask[None, :],
                            other=0.0)
                w = tl.load(W + offs_n[:, None].to(tl.int64) * stride_wn + kk[None, :],
                            mask=n_mask[:, None] & k_mask[None, :], other=0.0)
                acc += tl.dot(x, tl.trans(w))
            if HAS_BIAS:
                acc += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(OUT + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(OUT.dtype.element_ty),
                     mask=m_mask[:, None] & n_mask[None, :])

        _K.extend([gemv, skinny])
    return _K


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ weight[N, K]^T (+ bias [N])`` -> ``[..., N]`` in ``x.dtype`` (callers check
    :func:`takes` first)."""
    shape = x.shape
    K = shape[-1]
    N = weight.shape[0]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    gemv, skinny = _kernels()
    b = bias if bias is not None else weight
    if M == 1:
        block_n = 8
        gemv[(-(-N // block_n),)](x2, weight, b, out, N, K, weight.stride(0), HAS_BIAS=bias is not None,
                                  BLOCK_N=block_n, BLOCK_K=512, num_warps=4)
    else:
        block_m = max(16, 1 << (M - 1).bit_length())
        block_n = 32 if N // 32 >= 264 else 16
        skinny[(-(-N // block_n),)](x2, weight, b, out, M, N, K, x2.stride(0), weight.stride(0), out.stride(0),
                                    HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128,
                                    num_warps=4, num_stages=4)
    return out.view(*shape[:-1], N)
