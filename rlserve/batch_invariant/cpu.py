"""Batch-invariant CPU kernels (float32): a row's result never depends on the other rows.

Where a CPU step's results depended on the batch (checked by experiment on the 2-core AMD EPYC
machine, Zen 5, AVX-512, torch 2.13 / oneDNN, 2026-12-06; ``x[i:i+1] @ W`` against
``(X @ W)[i]``, 1 and 2 threads, ``benchmarks/batch_invariant.py probe``):

- GEMMs, first choice (session 14): the CPU team's kernel (:mod:`rlserve.layers.cpu_gemm`,
  ``csrc/cpu_team.c``): every output element is one sequential float32 FMA chain over K, bias
  last, so its bits depend on nothing but its own row and the weight, whatever M, the chunking
  or the thread (batch-invariant by construction, whatever the row count: the mode runs it for
  every M, also above ``cpu_gemm.MAX_ROWS``). It runs on the engine's team when one runs (2
  cores share a decode step's weight reads; before, the mode ran without the team, one core
  per micro-batch) and on the calling thread alone otherwise (the trainer-side reference): the
  same bits. Its packed copy: :func:`fma_weight`. The forms below serve where that C kernel
  does not build.
- GEMMs without it. MKL's ``F.linear`` and oneDNN on a plain weight give a row different bits for every
  row count M >= 2 than for M = 1. oneDNN on the pre-packed weight
  (:func:`rlserve.layers.cpu_linear.pack_weight`) gives every row the same bits for every
  M >= 2 tried (2..2,100; K, N from 100 x 37 to 4,096 x 1,024 and 576 x 49,152), with 1 or 2
  threads and inside a micro-batch thread; M = 1 differs from M >= 2 once K >= ~1,536 (a
  GEMV path). So :func:`linear` runs a single row as two (the row twice, the second dropped)
  on the packed weight, at the cost of one more row (the decode of one sequence is bound by
  reading the weight, not by its rows). Without a packed copy (packing off:
  ``RLSERVE_CPU_PACKED_LINEAR=0``) rows run in fixed tiles of :data:`TILE_ROWS` rows through
  ``F.linear``, the last tile padded with zeros: every tile is the same GEMM shape, and a
  row's bits did not depend on its place in the tile.
- Attention. A prefill ran SDPA's flash kernel over the sequence (its blocking follows the
  query length), a decode step the paged decode C kernel: the same token's attention differed
  between a whole prompt, a chunked or prefix-cached one and a decode step. In this mode
  every query token runs the decode kernel (:func:`prefill_attention`): one task per query,
  its context read block by block in table order with an online softmax, the same whichever
  step it is in and whatever else the step holds.
- Not batch-dependent (checked, kept): the fused C kernels of RMSNorm, q/k norm + rotary + KV
  write and SiLU-mul (one row per loop iteration, same code for every row count), torch's
  ``log_softmax`` / ``softmax`` / ``argmax`` / ``topk`` over the last dim (1 and 2 threads,
  vocabularies 77 to 151,936), the paged decode kernel (one task per sequence).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlserve.batch_invariant.per_query import per_query_tables
from rlserve.layers import cpu_attention, cpu_gemm

#: rows per tile of the unpacked fallback GEMM (:func:`tiled_linear`)
TILE_ROWS = 16

#: which GEMM the mode runs on CPU: "fma" (the CPU team's FMA-chain kernel where it builds,
#: :func:`fma_weight`) or "onednn" (session 13's: oneDNN's packed copy, one row as two, else
#: :func:`tiled_linear`; A/B runs: ``benchmarks/batch_invariant.py cost --modes on:gemm=onednn``)
GEMM = ["fma"]

_linear_pointwise = (torch.ops.mkldnn._linear_pointwise.default
                     if hasattr(torch.ops.mkldnn, "_linear_pointwise") else None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K] @ W.T + bias -> [M, N]`` float32 on oneDNN's pre-packed ``W`` (``packed``, from
    :func:`rlserve.layers.cpu_linear.pack_weight`), each row's bits independent of M: one row
    runs as two (see the module docstring)."""
    M = x.shape[0]
    if M == 1:
        return _linear_pointwise(torch.cat([x, x]), packed, bias, "none", [], "")[:1]
    return _linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T + bias -> [M, N]`` as ``F.linear`` over fixed tiles of
    :data:`TILE_ROWS` rows (the last one zero-padded): the same GEMM shape for every tile, so a
    row's bits do not depend on M (any dtype; checked for float32 MKL)."""
    M, K = x.shape
    pad = (-M) % TILE_ROWS
    if pad:
        x = torch.cat([x, x.new_zeros(pad, K)])
    outs = [F.linear(x[i:i + TILE_ROWS], weight, bias) for i in range(0, M + pad, TILE_ROWS)]
    return torch.cat(outs)[:M]


def fma_weight(layer) -> torch.Tensor | None:
    """The FMA-chain kernel's packed copy (:func:`rlserve.layers.cpu_gemm.pack`) of
    ``layer.weight`` ``[N, K]``: the CPU team's copy when one runs in this process, else one
    packed here at the first call and kept in ``layer.__dict__["_bi_fma_weight"]`` (float32
    ``[ceil(N / 32), K, 32]``, one more copy of the weight; ``process_weights_after_loading``
    drops it, so a weight load repacks). ``None`` where the kernel does not apply (not float32
    CPU, no C compiler) or :data:`GEMM` is not ``"fma"``."""
    if GEMM[0] != "fma":
        return None
    w = cpu_gemm.team_weight(layer)
    if w is not None:
        return w
    w = layer.__dict__.get("_bi_fma_weight")
    if w is None:
        w = cpu_gemm.pack(layer.weight.data)
        if w is not None:
            layer.__dict__["_bi_fma_weight"] = w
    return w


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None, fma: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-invariant ``F.linear(x, weight, bias)`` on CPU: ``x [..., K]`` -> ``[..., N]``;
    the FMA-chain kernel on ``fma`` (:func:`fma_weight`) for float32, else
    :func:`packed_linear` on a float32 oneDNN packed copy, else :func:`tiled_linear`."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] == 0:
        return F.linear(x, weight, bias)
    if (fma is not None and x2.dtype == torch.float32
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))):
        out = cpu_gemm.linear(x2, fma, weight.shape[0], bias)
    elif (packed is not None and _linear_pointwise is not None and x2.dtype == torch.float32
            and (bias is None or bias.dtype == torch.float32)):
        out = packed_linear(x2, packed, bias)
    else:
        out = tiled_linear(x2, weight, bias)
    return out.reshape(*lead, out.shape[-1])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta,
                      scale: float) -> torch.Tensor:
    """Causal paged attention of a step with prefills, each query token through the paged
    decode kernel (:func:`rlserve.layers.cpu_attention.paged_decode`) over its own context:
    bit-equal to that token's attention in any other step (decode, chunk, prefix hit).

    Args: ``q [T, H, D]`` float32; caches ``[num_blocks, block_size, Hkv, D]`` float32 holding
    this step's K/V; ``meta`` the step's :class:`rlserve.layers.attention.AttentionMetadata`.
    Returns ``[T, H, D]`` float32.

    Raises:
        RuntimeError: the kernel cannot take these inputs (not float32, head_dim not a multiple
            of 8 or above 256, more than 32 query heads per KV head, blocks above 128 tokens,
            the C kernel off or not built): this mode has no other attention on CPU.
    """
    bt, ctx = per_query_tables(meta)
    out = cpu_attention.paged_decode(q, k_cache, v_cache, bt, ctx, scale)
    if out is None:
        raise RuntimeError(
            "batch-invariant mode: the CPU paged attention kernel cannot take q "
            f"{tuple(q.shape)} {q.dtype} with a {tuple(k_cache.shape)} {k_cache.dtype} cache "
            "(needs float32, head_dim % 8 == 0 and <= 256, <= 32 query heads per KV head, block_size <= 128, "
            "RLSERVE_CPU_ATTENTION unset and a C compiler)")
    return out


def check_engine_supported(dtype: torch.dtype) -> None:
    """Raise ``ValueError`` when a CPU engine of ``dtype`` cannot run batch-invariant: the mode
    needs float32 and the paged attention C kernel (:func:`prefill_attention`)."""
    if dtype != torch.float32:
        raise ValueError(f"--batch-invariant on CPU needs --dtype float32, got {dtype}")
    if not cpu_attention.available():
        raise ValueError("--batch-invariant on CPU needs the paged attention C kernel "
                         "(a C compiler, RLSERVE_CPU_ATTENTION unset)")
