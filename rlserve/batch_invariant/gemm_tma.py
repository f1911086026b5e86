"""The batch-invariant GEMM with TMA loads (Hopper's tensor memory accelerator): the kernel of
:mod:`rlserve.batch_invariant.gpu` whose ``a`` / ``w`` tiles come through host-built tensor
descriptors (``triton.tools.tensor_descriptor.TensorDescriptor``; rows past M / N and columns past
K read as zeros by the hardware) instead of per-thread loads. The same tiles, the same
``tl.dot`` over K from 0 upwards in BLOCK_K steps into one float32 accumulator: a configuration
with ``tma`` = 1 (:class:`rlserve.batch_invariant.gemm_table.Cfg`) is one more candidate whose
bits the device checks against the reference (``tests/gpu/test_batch_invariant_gpu.py``,
``benchmarks/bi_gemm_sweep.py``). Needs K x 2 bytes a multiple of 16 (TMA strides) and Triton with
host descriptors (3.4+); :func:`usable` says whether a GEMM qualifies.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - CPU-only installs
    HAS_TRITON = False
try:
    from triton.tools.tensor_descriptor import TensorDescriptor

    HAS_TMA = True
except ImportError:  # pragma: no cover - CPU-only installs, older Triton
    HAS_TMA = False

if HAS_TRITON:

    @triton.jit
    def tile_coords(tile, num_m, num_n, GROUP_M: tl.constexpr):
        """Output tile ``tile`` of a ``num_m`` x ``num_n`` grid -> ``(pid_m, pid_n)``, grouped by
        ``GROUP_M`` rows of tiles (neighbouring programs share weight columns in L2)."""
        in_group = GROUP_M * num_n
        first_m = (tile // in_group) * GROUP_M
        group_m = tl.minimum(num_m - first_m, GROUP_M)
        return first_m + (tile % in_group) % group_m, (tile % in_group) // group_m


def usable(a: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``a [M, K]`` and ``weight [N, K]`` can be read through TMA descriptors: Triton has
    them, both row-major with unit column stride, K x itemsize and the row strides multiples of 16
    bytes, 16-byte aligned bases."""
    if not HAS_TMA:
        return False
    e = a.element_size()
    return all(t.stride(1) == 1 and (t.stride(0) * e) % 16 == 0 and t.data_ptr() % 16 == 0 for t in (a, weight)) \
        and (a.shape[1] * e) % 16 == 0


if HAS_TMA:

    @triton.jit(do_not_specialize=["M", "num_programs"])
    def _bi_matmul_tma_kernel(a_desc, w_desc, c_ptr, bias_ptr, M, N, K, stride_cm, stride_cn, num_programs,
                              HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """``c[M, N] = a[M, K] @ w[N, K].T (+ bias[N])``, persistent over output tiles as
        ``gpu._bi_matmul_kernel``; ``a_desc`` / ``w_desc``: descriptors of blocks [BLOCK_M,
        BLOCK_K] / [BLOCK_N, BLOCK_K] (out-of-range elements read as zero)."""
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        for tile in range(pid, num_m * num_n, num_programs):
            pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                a = a_desc.load([pid_m * BLOCK_M, k0])
                w = w_desc.load([pid_n * BLOCK_N, k0])
                if IEEE:
                    acc = tl.dot(a, w.T, acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, w.T, acc)
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
            tl.store(c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn,
                     acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def launch(a: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None, cfg: dict,
           programs: int) -> None:
    """``out [M, N] = a [M, K] @ weight[N, K].T (+ bias)`` through TMA descriptors, ``programs``
    persistent programs; ``cfg``: BLOCK_M / BLOCK_N / BLOCK_K / GROUP_M / num_warps / num_stages.

    Raises:
        ValueError: ``a`` / ``weight`` not :func:`usable`."""
    if not usable(a, weight):
        raise ValueError("the TMA GEMM needs row-major a / weight with 16-byte aligned rows")
    (M, K), N = a.shape, weight.shape[0]
    a_desc = TensorDescriptor.from_tensor(a, [cfg["BLOCK_M"], cfg["BLOCK_K"]])
    w_desc = TensorDescriptor.from_tensor(weight, [cfg["BLOCK_N"], cfg["BLOCK_K"]])
    _bi_matmul_tma_kernel[(programs,)](
        a_desc, w_desc, out, bias if bias is not None else out, M, N, K, out.stride(0), out.stride(1), programs,
        HAS_BIAS=bias is not None, IEEE=a.dtype == torch.float32, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        GROUP_M=cfg["GROUP_M"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
