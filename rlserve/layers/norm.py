"""Normalization layers: RMSNorm (with an optional fused residual add) and LayerNorm."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import Parameter

from rlserve.layers import fused_ops
from rlserve.loader.weight_utils import default_weight_loader, set_weight_attrs


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 as Hugging Face Llama does:
    ``weight * (x / sqrt(mean(x^2) + eps)).to(x.dtype)``.

    Args:
        hidden_size: size of the normalized (last) dim.
        eps: variance epsilon.

    ``forward(x)`` -> normalized ``x`` (same shape and dtype).
    ``forward(x, residual)`` -> ``(norm(x + residual), x + residual)``: the residual stream
    is updated and returned alongside (the sum is done in the input dtype, like HF).

    On CUDA either form is one Triton kernel (:func:`rlserve.layers.fused_ops.rms_norm`, the
    same rounding); on CPU it is the PyTorch code below.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = Parameter(torch.ones(hidden_size, dtype=params_dtype or torch.get_default_dtype()),
                                requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": default_weight_loader})

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        return self.weight * h.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if fused_ops.fused_enabled(x):
            return fused_ops.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class LayerNorm(nn.LayerNorm):
    """``torch.nn.LayerNorm`` (replicated; weight/bias load with the default loader).

    Args: as ``nn.LayerNorm``. ``forward(x [..., D]) -> [..., D]``.
    """

    def __init__(self, normalized_shape: int, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, params_dtype: torch.dtype | None = None):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, bias=bias,
                         dtype=params_dtype)
        for p in self.parameters():
            p.requires_grad_(False)
            set_weight_attrs(p, {"weight_loader": default_weight_loader})
