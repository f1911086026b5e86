"""The fp8 KV cache (vLLM's ``--kv-cache-dtype``): names, dtypes, scales, and the torch
quantize / dequantize used by the reference backend and the CPU.

``--kv-cache-dtype`` takes vLLM's values: ``auto`` (the model's dtype), ``fp8`` (= ``fp8_e4m3``
on CUDA, as in vLLM), ``fp8_e4m3`` (``torch.float8_e4m3fn``: 4 exponent, 3 mantissa bits, largest
finite 448) and ``fp8_e5m2`` (``torch.float8_e5m2``: 5 / 2 bits, largest finite 57344). One byte
per element: a KV block takes half the bytes of a bf16 one, so the same memory holds twice the
blocks.

Scales, as vLLM's ``Attention`` layer keeps them: one float32 ``k_scale`` and one ``v_scale`` per
layer (per tensor, shape ``[1]``, on the cache's device), 1.0 by default. A cache write stores
``saturate(x / scale)`` rounded to the fp8 type (saturating: values past the largest finite one
are clamped to it, as vLLM's ``__NV_SATFINITE`` conversion does); a read dequantizes
``fp8 * scale``. With ``--calculate-kv-scales`` each layer sets its scales from the first real
batch it sees (a prefill): ``k_scale = max|k| / 200`` and ``v_scale = max|v| / 100``, vLLM's
``K_SCALE_CONSTANT`` / ``V_SCALE_CONSTANT`` (``vllm/envs.py``), once, and keeps them.

Error (where the tests' tolerances come from): rounding to e4m3 keeps 3 mantissa bits, a
relative error of at most 2^-4 per element (half an ulp of 2^-3); e5m2's 2 bits give 2^-3.
"""

from __future__ import annotations

import torch

#: ``--kv-cache-dtype`` values -> the cache's torch dtype (None: the model's dtype)
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
#: vLLM's K_SCALE_CONSTANT / V_SCALE_CONSTANT (``--calculate-kv-scales``: scale = max|x| / constant)
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def check_kv_cache_dtype(name: str) -> str:
    """Returns ``name`` when it is one of :data:`KV_CACHE_DTYPES`.

    Raises:
        ValueError: any other value, naming the accepted ones.
    """
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} (vLLM's values), got {name!r}")
    return name


def cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the KV cache for ``--kv-cache-dtype name`` and a model in
    ``model_dtype``.

    Raises:
        ValueError: an unknown name (:func:`check_kv_cache_dtype`).
    """
    return KV_CACHE_DTYPES[check_kv_cache_dtype(name)] or model_dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def new_scales(device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's ``(k_scale, v_scale)``: float32 ``[1]`` tensors holding 1.0 (vLLM's default)."""
    return (torch.ones(1, dtype=torch.float32, device=device), torch.ones(1, dtype=torch.float32, device=device))


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``saturate(x / scale)`` in ``dtype`` (an fp8 type): ``x`` any float tensor, ``scale`` a
    float32 ``[1]`` tensor; computed in float32."""
    fmax = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-fmax, fmax).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` in ``dtype``: ``x`` an fp8 tensor, ``scale`` a float32 ``[1]`` tensor."""
    return (x.float() * scale).to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor viewed as uint8 (CPU torch has no ``index_copy_`` / ``index_select`` for
    the float8 types; the bytes move unchanged); other tensors as they are."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def set_scales_from(k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """``--calculate-kv-scales``: ``k_scale = max|k| / 200``, ``v_scale = max|v| / 100`` (vLLM's
    constants), in place, on the device (no host sync). An all-zero tensor keeps scale 1.0
    (a zero scale would divide by zero)."""
    for x, s, c in ((k, k_scale, K_SCALE_CONSTANT), (v, v_scale, V_SCALE_CONSTANT)):
        if x.numel() == 0:
            continue
        amax = x.detach().abs().amax().float() / c
        s.copy_(torch.where(amax > 0, amax, torch.ones_like(amax)).reshape(1))


def fp8_max(cache: torch.Tensor) -> float:
    """The Triton kernels' ``FP8_MAX``: the largest finite value of an fp8 cache's dtype (448
    for e4m3, 57344 for e5m2), 0.0 for a cache in the model dtype (a plain cast)."""
    return float(torch.finfo(cache.dtype).max) if is_fp8(cache.dtype) else 0.0


def kernel_scales(cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                  like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(K_SCALE, V_SCALE)`` pointers for a Triton kernel: the scales of an fp8 cache (1.0
    tensors for one not given), else ``like`` twice (a tensor on the device, never read)."""
    if not is_fp8(cache.dtype):
        return like, like
    if k_scale is None or v_scale is None:
        ones = new_scales(cache.device)
        k_scale = ones[0] if k_scale is None else k_scale
        v_scale = ones[1] if v_scale is None else v_scale
    return k_scale, v_scale
