"""Activation functions, including the fused gated ``SiluAndMul`` of Llama-style MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rlserve.errors import UnsupportedArchitectureError
from rlserve.layers import fused_ops


class SiluAndMul(nn.Module):
    """``x [..., 2d] -> silu(x[..., :d]) * x[..., d:]`` (gate first, then up); one Triton
    kernel on CUDA (:func:`rlserve.layers.fused_ops.silu_and_mul`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_ops.fused_enabled(x):
            return fused_ops.silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


_ACTS = {
    "relu": nn.ReLU,
    "silu": nn.SiLU,
    "swish": nn.SiLU,
    "gelu": nn.GELU,
    "gelu_new": lambda: nn.GELU(approximate="tanh"),
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
}


def get_act_fn(name: str) -> nn.Module:
    """Activation module for a Hugging Face ``hidden_act`` / ``activation_function`` name.

    Raises:
        UnsupportedArchitectureError: for a name not in relu, silu, swish, gelu, gelu_new, gelu_pytorch_tanh.
    """
    if name not in _ACTS:
        raise UnsupportedArchitectureError(f"activation {name!r} is not supported; supported: {sorted(_ACTS)}")
    return _ACTS[name]()
