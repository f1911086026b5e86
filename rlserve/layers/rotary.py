"""Rotary position embeddings (neox / ``rotate_half`` style, as in HF Llama, Qwen, Mistral).

Supported ``rope_type``: ``default``, ``linear`` and ``llama3``; the frequencies are
computed exactly as ``transformers.modeling_rope_utils`` does, in float32, and kept in a
``[max_position, rotary_dim]`` cos/sin cache (float32, a non-persistent buffer, so it is
never part of a checkpoint; HF's ``rotary_emb.inv_freq`` tensors are skipped by the models).
Every layer built with the same settings on the same device shares ONE cache (as vLLM's
``get_rope`` cache): per layer, a 40,960-position cache of head dim 128 is 40 MiB, x 48 layers
of Qwen3-30B-A3B = 1.875 GiB that the KV cache did not get (BENCHMARKS.md, MoE).
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import nn

from rlserve.errors import UnsupportedArchitectureError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(config) -> dict[str, Any]:
    """Read the RoPE settings of a HF config as one dict with at least ``rope_type`` and
    ``rope_theta``.

    Transformers 5 stores them in ``config.rope_parameters`` (possibly per layer type, e.g.
    ``{"full_attention": {...}}``); older configs use ``rope_theta`` + ``rope_scaling``.
    """
    rp = getattr(config, "rope_parameters", None)
    params: dict[str, Any] = {}
    if isinstance(rp, dict) and rp:
        if "rope_theta" not in rp and "rope_type" not in rp and "full_attention" in rp:
            rp = rp["full_attention"]
        params.update(rp)
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict) and not params:
        params.update(scaling)
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    if "partial_rotary_factor" not in params and getattr(config, "partial_rotary_factor", None):
        params["partial_rotary_factor"] = config.partial_rotary_factor
    return params


def compute_inv_freq(rotary_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """``[rotary_dim // 2]`` float32 inverse frequencies for ``params`` (see :func:`rope_parameters`).

    Raises:
        UnsupportedArchitectureError: for a rope type other than default, linear, llama3.
    """
    rope_type = params["rope_type"]
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(dtype=torch.float) / rotary_dim))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        factor = params["factor"]
        low_freq_factor = params["low_freq_factor"]
        high_freq_factor = params["high_freq_factor"]
        old_context_len = params["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama)
    raise UnsupportedArchitectureError(
        f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


#: (rotary_dim, max_position, settings, device) -> weak references to the shared (cos, sin)
_CACHES: dict[tuple, tuple[weakref.ref, weakref.ref]] = {}


def _cos_sin_cache(rotary_dim: int, max_position: int, params: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``[max_position, rotary_dim]`` float32 cos and sin tables on the current default
    device (``build_model``'s ``with torch.device(...)``), shared by every caller with the same
    arguments while any module still holds them (weak references: a freed model frees them).
    Read-only by contract: nothing writes into a rotary cache."""
    device = torch.empty(0).device
    key = (rotary_dim, max_position, repr(sorted(params.items())), str(device))
    refs = _CACHES.get(key)
    if refs is not None:
        cos, sin = refs[0](), refs[1]()
        if cos is not None and sin is not None:
            return cos, sin
    inv_freq = compute_inv_freq(rotary_dim, params)
    t = torch.arange(max_position, dtype=torch.int64).to(torch.float32)
    freqs = torch.outer(t, inv_freq.to(t.device))
    emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, rotary_dim]
    cos, sin = emb.cos(), emb.sin()
    for k in [k for k, (c, s) in _CACHES.items() if c() is None or s() is None]:
        del _CACHES[k]  # tables of freed models
    _CACHES[key] = (weakref.ref(cos), weakref.ref(sin))
    return cos, sin


class RotaryEmbedding(nn.Module):
    """Applies RoPE to flat query/key tensors.

    Args:
        head_dim: per-head size.
        rotary_dim: leading dims of each head that rotate (``head_dim`` unless partial).
        max_position: positions ``[0, max_position)`` are cached.
        params: rope settings (:func:`rope_parameters`).

    ``forward(positions [T] int64, q [T, Hq*head_dim], k [T, Hk*head_dim]) -> (q, k)`` rotated,
    same shapes and dtypes (cos/sin are cast to ``q.dtype`` before use, as in HF). Build the
    module directly on its device (the loader does); casting the whole model with
    ``.to(bfloat16)`` would round the float32 cache too.
    """

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, params: dict[str, Any]):
        super().__init__()
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"rotary_dim={rotary_dim} must be even and <= head_dim={head_dim}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.rope_type = params["rope_type"]
        self.params = dict(params)
        cos, sin = _cos_sin_cache(rotary_dim, max_position, params)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def cover(self, positions: int) -> None:
        """Grow the table to ``positions`` rows when it has fewer (on its own device; shared as
        :func:`_cos_sin_cache` shares). RoPE is defined at every position (cos / sin of position x
        frequency, the same formula for rows past the config's length), so a ``max_model_len``
        past the model's (``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``) reads computed rows, where the
        kernels (CPU C, Triton) would read past the end of the table."""
        if positions <= self.max_position:
            return
        with torch.device(self.cos_cache.device):
            self.cos_cache, self.sin_cache = _cos_sin_cache(self.rotary_dim, positions, self.params)
        self.max_position = positions

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        x = x.view(T, -1, self.head_dim)
        if self.rotary_dim == self.head_dim:
            return ((x * cos) + (_rotate_half(x) * sin)).reshape(T, -1)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        rot = (rot * cos) + (_rotate_half(rot) * sin)
        return torch.cat((rot, rest), dim=-1).reshape(T, -1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos_cache.index_select(0, positions).to(q.dtype).unsqueeze(1)  # [T, 1, rot]
        sin = self.sin_cache.index_select(0, positions).to(q.dtype).unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)


def get_rope(head_dim: int, max_position: int, config) -> RotaryEmbedding:
    """Build the :class:`RotaryEmbedding` described by a HF ``config``; its table covers
    ``max_position`` positions, times the ``factor`` of ``linear`` scaling (the context length
    :func:`rlserve.model_len.derived_max_model_len` allows).

    Raises:
        UnsupportedArchitectureError: unsupported rope type.
    """
    params = rope_parameters(config)
    rotary_dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0) or 1.0))
    if params["rope_type"] == "linear":  # positions up to factor x max_position (vLLM's linear scaling table)
        max_position = int(max_position * float(params["factor"]))
    return RotaryEmbedding(head_dim, rotary_dim, max_position, params)


def cover_positions(model: nn.Module, positions: int) -> None:
    """Make ``model``'s position tables cover positions ``[0, positions)`` (``max_model_len``):
    every :class:`RotaryEmbedding` grows (:meth:`RotaryEmbedding.cover`); a module with a table
    that cannot grow (learned absolute positions, OPT's: its ``position_limit``) refuses.

    Raises:
        ValueError: a learned position table shorter than ``positions`` (the message names both)."""
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m.cover(positions)
        limit = getattr(m, "position_limit", None)
        if limit is not None and limit < positions:
            raise ValueError(f"max_model_len {positions} is past the model's learned position table ({limit} "
                             f"positions: {type(m).__name__}); a learned table cannot be extended, so "
                             f"VLLM_ALLOW_LONG_MAX_MODEL_LEN cannot raise it: use --max-model-len {limit} or less")
