"""Fused elementwise kernels for CPU, float32: the C code in ``csrc/cpu_fused.c``.

The CPU counterparts of :mod:`rlserve.layers.fused_ops`' Triton kernels, with the same
signatures; :mod:`rlserve.layers.fused_ops` sends CPU float32 tensors here, so the models
and layers call one API on every device. Op by op, a Llama decoder layer on CPU makes ~25
passes over its activations outside the matmuls (residual add and RMSNorm 5-6 each, rotary
~8 per tensor, SiLU-and-mul 3, the KV-cache write); each kernel here is one pass, reading
its inputs once. Rounding as the PyTorch code they replace (see the C file): rotary and the
residual sum bit-equal, RMSNorm up to the order of its mean, SiLU within 2 ulp.

Built at first use and cached (:mod:`rlserve.layers.cpu_build`), with ``-ffp-contract=off``
so that no multiply-add is fused where PyTorch rounds twice. :func:`available` is False
without a C compiler (the callers then keep PyTorch) or with ``RLSERVE_CPU_FUSED=0``.
"""

from __future__ import annotations

import ctypes

import torch

from rlserve import envs
from rlserve.layers.cpu_build import load_library

_FLAGS = ("-ffp-contract=off",)
_state: dict = {}

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGS = {
    "rlserve_rms_norm_f32": [_P] * 5 + [_I] * 4 + [_F, ctypes.c_int],
    "rlserve_silu_mul_f32": [_P, _P, _I, _I, _I, ctypes.c_int],
    "rlserve_qkv_rope_write_f32": [_P] * 10 + [_I] * 6 + [_F, ctypes.c_int],
}


def _lib():
    if "lib" not in _state:
        lib = load_library("cpu_fused.c", _FLAGS)
        if lib is not None:
            for name, argtypes in _SIGS.items():
                fn = getattr(lib, name)
                fn.restype = ctypes.c_int
                fn.argtypes = argtypes
        _state["lib"] = lib
    return _state["lib"]


def kernel_table() -> int:
    """The address of a C array of this library's three entry points (RMSNorm, SiLU-and-mul,
    q/k-norm + rotary + KV write, in that order) for C callers (``csrc/cpu_stack.c``); the
    array lives as long as the process. Only where :func:`available`."""
    if "table" not in _state:
        lib = _lib()
        table = (ctypes.c_void_p * 3)(*(ctypes.cast(getattr(lib, n), ctypes.c_void_p).value for n in _SIGS))
        _state["table"] = (table, ctypes.addressof(table))
    return _state["table"][1]


def available() -> bool:
    """True when the kernels are enabled (``RLSERVE_CPU_FUSED`` is not ``0``) and load."""
    return envs.RLSERVE_CPU_FUSED and _lib() is not None


def takes(t: torch.Tensor) -> bool:
    """Whether these kernels run on ``t``: a float32 CPU tensor, kernels available."""
    return t.device.type == "cpu" and t.dtype == torch.float32 and available()


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm_rows(lib, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor,
                  res_out: torch.Tensor | None, eps: float, nthreads: int) -> None:
    """The one call of the C RMSNorm kernel (its argument order lives here only): ``out =
    norm(x [+ residual])``, and ``res_out = x + residual`` when ``residual`` is given.

    ``x``, ``residual``: ``[T, N]`` float32 CPU with unit column stride (any row stride);
    ``weight``: ``[N]`` contiguous float32; ``out``, ``res_out``: ``[T, N]`` contiguous float32
    written by the kernel; ``lib``: :func:`_lib`'s library; ``nthreads``: OpenMP threads.
    Nothing is checked (callers have): wrong shapes or strides read/write out of bounds."""
    T, N = x.shape
    has_res = residual is not None
    lib.rlserve_rms_norm_f32(x.data_ptr(), residual.data_ptr() if has_res else None, weight.data_ptr(),
                             out.data_ptr(), res_out.data_ptr() if has_res else None, T, N, x.stride(0),
                             residual.stride(0) if has_res else 0, float(eps), nthreads)


def silu_mul_rows(lib, x: torch.Tensor, out: torch.Tensor, nthreads: int) -> None:
    """The one call of the C SiLU-and-mul kernel: ``out = silu(x[:, :d]) * x[:, d:]``; ``x``
    ``[T, 2d]`` float32 CPU with unit column stride, ``out`` ``[T, d]`` contiguous float32.
    Unchecked, as :func:`rms_norm_rows`."""
    lib.rlserve_silu_mul_f32(x.data_ptr(), out.data_ptr(), x.shape[0], out.shape[1], x.stride(0), nthreads)


def qkv_rope_write_rows(lib, qkv: torch.Tensor, pos: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                        q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, q: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int,
                        num_kv_heads: int, head_dim: int, eps: float, nthreads: int) -> None:
    """The one call of the C q/k-norm + rotary + KV-write kernel. ``qkv`` ``[T, (H + 2 Hkv) D]``
    float32 with unit column stride; ``pos``, ``slots`` ``[T]`` contiguous int64; caches,
    cos/sin caches and norm weights (``None``: no q/k norm) contiguous float32; ``q`` ``[T, H
    D]`` contiguous float32, written. Unchecked, as :func:`rms_norm_rows` (see
    :func:`qkv_norm_rope_write` for the checks)."""
    lib.rlserve_qkv_rope_write_f32(
        qkv.data_ptr(), pos.data_ptr(), cos_cache.data_ptr(), sin_cache.data_ptr(),
        q_weight.data_ptr() if q_weight is not None else None, k_weight.data_ptr() if k_weight is not None else None,
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
        qkv.shape[0], num_heads, num_kv_heads, head_dim, cos_cache.shape[-1], qkv.stride(0), float(eps), nthreads)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """As :func:`rlserve.layers.fused_ops.rms_norm` (``x``, ``residual`` ``[..., N]`` float32 on
    CPU, ``weight`` ``[N]``): ``norm(x)``, or ``(norm(x + residual), x + residual)``."""
    shape = x.shape
    N = shape[-1]
    x2 = _rows(x)
    T = x2.shape[0]
    out = torch.empty((T, N), dtype=x.dtype)
    r2 = _rows(residual) if residual is not None else None
    res_out = torch.empty_like(out) if residual is not None else None
    w = weight.to(torch.float32).contiguous()
    if T:
        rms_norm_rows(_lib(), x2, r2, w, out, res_out, eps, torch.get_num_threads())
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """As :func:`rlserve.layers.fused_ops.silu_and_mul`: ``x [..., 2d]`` float32 on CPU ->
    ``silu(x[..., :d]) * x[..., d:]`` ``[..., d]``."""
    shape = x.shape
    d = shape[-1] // 2
    x2 = _rows(x)
    T = x2.shape[0]
    out = torch.empty((T, d), dtype=x.dtype)
    if T:
        silu_mul_rows(_lib(), x2, out, torch.get_num_threads())
    return out.view(*shape[:-1], d)


def qkv_norm_rope_write(qkv, positions, cos_cache, sin_cache, num_heads, num_kv_heads, head_dim, k_cache, v_cache,
                        slot_mapping, q_weight=None, k_weight=None, eps=1e-6) -> torch.Tensor:
    """As :func:`rlserve.layers.fused_ops.qkv_norm_rope_write` on CPU float32 (q/k RMSNorm
    when weights are given, rotary, the K/V write; returns the queries ``[T, num_heads *
    head_dim]``).

    Raises:
        ValueError: a KV cache, cos/sin cache or norm weight that is not contiguous float32,
            or ``head_dim`` above 1024 (the model runner's caches are contiguous and in the
            model dtype, so a float32 model never meets this).
    """
    tensors = [k_cache, v_cache, cos_cache, sin_cache] + [w for w in (q_weight, k_weight) if w is not None]
    if not all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors) or head_dim > 1024:
        raise ValueError("CPU qkv_norm_rope_write takes contiguous float32 caches and weights, head_dim <= 1024")
    T = qkv.shape[0]
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    q = torch.empty((T, num_heads * head_dim), dtype=qkv.dtype)
    if T == 0:
        return q
    pos = positions.to(torch.int64).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    qkv_rope_write_rows(_lib(), qkv, pos, cos_cache, sin_cache, q_weight, k_weight, q, k_cache, v_cache, slots,
                        num_heads, num_kv_heads, head_dim, eps, torch.get_num_threads())
    return q
