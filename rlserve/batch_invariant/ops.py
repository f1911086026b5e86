"""The batch-invariant forms the layers call when the mode is on, by device."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlserve.batch_invariant import cpu


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None = None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``x [..., K]``, ``weight [N, K]`` -> ``[..., N]``) whose
    rows do not depend on the other rows: CPU :func:`rlserve.batch_invariant.cpu.linear`
    (``packed``: the layer's oneDNN packed copy or None); other devices ``F.linear`` (not
    covered yet)."""
    if x.device.type == "cpu":
        return cpu.linear(x, weight, packed, bias)
    return F.linear(x, weight, bias)
