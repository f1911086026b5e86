"""Small host-to-device copies that never wait for the GPU (engine and layers use it).

A ``non_blocking`` copy from *pageable* host memory is not asynchronous: the CUDA driver
may synchronise with the stream before staging it ("API synchronization behavior" in the
CUDA runtime documentation; PyTorch's pin_memory guide says the same). On the engine's
overlapped decode path that means the host waits for the step in flight before it can even
launch the next one. Copies from *pinned* memory are queued and return at once; PyTorch's
caching host allocator keeps a pinned block alive until the copy that reads it has run, so
a fresh pinned staging tensor per copy is safe to let go right away.
"""

from __future__ import annotations

import numpy as np
import torch


#: flat int lists at least this long go through numpy (``np.array`` of a list of Python ints converts
#: ~3x faster than ``torch.tensor``: a prefill's token ids, positions and KV slots, thousands a step)
_NUMPY_MIN = 64
_NP_INT = {torch.int64: np.int64, torch.int32: np.int32}


def _host_tensor(data, dtype: torch.dtype) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype)`` on the host (same values, same errors for ints out of range)."""
    if type(data) is list and len(data) >= _NUMPY_MIN and dtype in _NP_INT and type(data[0]) is int:
        return torch.from_numpy(np.array(data, dtype=_NP_INT[dtype]))
    return torch.tensor(data, dtype=dtype)


def to_device(data, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.tensor(data, dtype)`` on ``device`` without a host sync.

    Args:
        data: a (nested) list of Python numbers, or a CPU tensor.
        dtype: the result's dtype.
        device: where the result lives; for a CUDA device the values are staged in pinned
            memory and copied with ``non_blocking=True`` (stream-ordered, no wait).
    Returns:
        a tensor on ``device``.
    """
    device = torch.device(device)
    if device.type != "cuda":
        if isinstance(data, torch.Tensor):
            return data.to(device=device, dtype=dtype)
        return _host_tensor(data, dtype).to(device)
    host = data.to(dtype=dtype) if isinstance(data, torch.Tensor) else _host_tensor(data, dtype)
    if not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def gather_rows(tokens: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``tokens[rows]`` (int64) without a host sync (the row indices are staged with
    :func:`to_device`); a slice when ``rows`` is ``0..n-1``."""
    n = len(rows)
    if rows == list(range(n)):
        return tokens[:n].long()
    idx = to_device(rows, torch.long, tokens.device)
    return tokens.index_select(0, idx).long()


def fill_rows(dst: torch.Tensor, tokens: torch.Tensor, rows: list[int], where: list[int]) -> torch.Tensor:
    """``dst[where] = tokens[rows]`` in place without a host sync (``dst`` 1-D on ``tokens``' device;
    ``where`` and ``rows`` staged with :func:`to_device`); returns ``dst``. The input ids of a step
    whose rows ``where`` come from an earlier step's sampled tokens, the others from the host."""
    idx = to_device(where, torch.long, dst.device)
    return dst.index_copy_(0, idx, gather_rows(tokens, rows).to(dst.dtype))
