"""Row-wise argmax of float32 CPU rows in one C pass (``csrc/cpu_argmax.c``), with
``torch.argmax(dim=-1)``'s result: the first index of the largest value, a row's first NaN where it
has one, 0 for a row of ``-inf``. torch's CPU argmax costs ~6x this at ``[16, 49152]`` (the C
file's header has the figures); the sampler uses it
(:mod:`rlserve.engine.core.lean_sampling`).

Built at first use and cached (:mod:`rlserve.layers.cpu_build`); without a C compiler,
:func:`argmax_rows` is ``torch.argmax``.
"""

from __future__ import annotations

import ctypes

import torch

from rlserve.layers.cpu_build import load_library

_state: dict = {}


def _lib():
    if "lib" not in _state:
        lib = load_library("cpu_argmax.c")
        if lib is not None:
            lib.rlserve_argmax_rows_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                                    ctypes.c_void_p]
            lib.rlserve_argmax_rows_f32.restype = ctypes.c_int
        _state["lib"] = lib
    return _state["lib"]


def warm_up() -> bool:
    """Build (or load from the cache) the C kernel now (engine start) rather than in the first
    step; returns whether it is there."""
    return _lib() is not None


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a ``[B, V]`` tensor: the C kernel for float32 CPU rows with unit
    column stride and ``V >= 1`` (any row stride), ``torch.argmax`` otherwise (other devices,
    dtypes, layouts; no compiler). Returns ``LongTensor [B]`` on ``x``'s device."""
    lib = _lib() if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 else None
    if lib is None or x.shape[1] < 1 or x.stride(1) != 1:
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.long)
    lib.rlserve_argmax_rows_f32(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
    return out
