"""The batch-invariant forms the layers call when the mode is on, by device: CPU
(:mod:`rlserve.batch_invariant.cpu`) or CUDA (:mod:`rlserve.batch_invariant.gpu`, Triton; imported by the
first CUDA call, so that a CPU engine's start does not import Triton: 86 modules, 0.24 s of CPU on the 2-core
machine, issue 37)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlserve.batch_invariant import cpu


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None = None,
           bias: torch.Tensor | None = None, layer=None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``x [..., K]``, ``weight [N, K]`` -> ``[..., N]``) whose
    rows do not depend on the other rows: CPU :func:`rlserve.batch_invariant.cpu.linear`
    (``packed``: the layer's oneDNN packed copy or None; ``layer``: the module owning
    ``weight``, whose FMA-chain copy :func:`rlserve.batch_invariant.cpu.fma_weight` runs first),
    CUDA :func:`rlserve.batch_invariant.gpu.linear` (Triton, a K order fixed for every M);
    other devices, or CUDA without Triton, ``F.linear`` (not covered)."""
    if x.device.type == "cpu":
        fma = cpu.fma_weight(layer) if layer is not None and x.dtype == torch.float32 else None
        return cpu.linear(x, weight, packed, bias, fma=fma)
    if x.is_cuda:
        from rlserve.batch_invariant import gpu  # (a dict lookup after the first call)

        if gpu.available() and x.dtype == weight.dtype:
            return gpu.linear(x, weight, bias)
    return F.linear(x, weight, bias)
