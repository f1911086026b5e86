"""Non-finite values in synced weights: the bit tests the checksum passes fold in.

A weight update whose tensor holds one NaN or one infinity is refused before it is committed
(:class:`rlserve.transfer.errors.NonFiniteWeightsError`, HTTP 400 ``non_finite_weights``,
naming the tensor). The test runs inside the pass that already reads every byte for the
``s64sum`` checksum, so no byte is read a second time from memory:

- host bytes (:mod:`rlserve.transfer.host_ops`): each 1 MiB piece, right after its copy / sum
  while it is in the cache, gets two ``max`` reductions over its integer views
  (:func:`np_nonfinite`);
- device bytes (:mod:`rlserve.transfer.multi_tensor`): the Triton kernel tests every int64 word
  it sums with the lane masks of :func:`lane_masks`.

What counts as non-finite is read from the bits, per dtype: the exponent field all ones. For
float32 / float16 / bfloat16 / float64 and ``float8_e5m2`` that is +-inf and every NaN;
``float8_e4m3fn`` has no infinity, so only its NaN (``S.1111.111``) is found. Integer and bool
tensors, and the fp8 ``fnuz`` formats, are not tested. A server started with
``--no-weight-check-finite`` skips the test (the update then commits whatever arrives).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

#: dtype -> (bits of the exponent field, element bytes). A value is non-finite when all of the
#: field's bits are set (``x & field == field``).
_FIELD: dict[torch.dtype, tuple[int, int]] = {
    torch.float64: (0x7FF0000000000000, 8),
    torch.float32: (0x7F800000, 4),
    torch.float16: (0x7C00, 2),
    torch.bfloat16: (0x7F80, 2),
    torch.float8_e5m2: (0x7C, 1),
    torch.float8_e4m3fn: (0x7F, 1),  # the NaN pattern: e4m3fn has no infinity
}
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
_NP_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def checked(dtype: torch.dtype | None) -> bool:
    """Whether tensors of ``dtype`` are tested (the float dtypes of the module docstring)."""
    return dtype in _FIELD


def _wrap(v: int) -> int:
    return ((v + (1 << 63)) % (1 << 64)) - (1 << 63)


def lane_masks(dtype: torch.dtype | None) -> tuple[int, int, int]:
    """``(M, L, H)``: int64 constants (signed) that test the elements packed in one
    little-endian int64 word ``x`` of a ``dtype`` tensor: with ``v = (x & M) ^ M``, an element
    is non-finite exactly when its lane of ``v`` is zero, and ``(v - L) & ~v & H`` is non-zero
    exactly when some lane is zero (the classic has-zero-lane test; ``L`` holds 1 and ``H`` the
    top bit of every lane). ``(0, 0, 0)`` for a dtype that is not tested (the expression is
    then always 0)."""
    if dtype not in _FIELD:
        return 0, 0, 0
    field, size = _FIELD[dtype]
    lanes = 8 // size
    bits = 8 * size
    m = l_ = h = 0
    for k in range(lanes):
        m |= field << (bits * k)
        l_ |= 1 << (bits * k)
        h |= 1 << (bits * k + bits - 1)
    return _wrap(m), _wrap(l_), _wrap(h)


def np_nonfinite(u8: np.ndarray, dtype: torch.dtype | None) -> bool:
    """Whether the bytes ``u8`` (a 1-D uint8 array holding whole ``dtype`` elements) hold a
    non-finite value. Two reductions, no temporary array: the signed view's maximum reaches the
    field for a positive one (``0x7F80 <= x <= 0x7FFF`` for bfloat16), the unsigned view's for
    a negative one (``x >= 0xFF80``). ``False`` for dtypes that are not tested."""
    if dtype not in _FIELD or not u8.size:
        return False
    field, size = _FIELD[dtype]
    if u8.size % size:
        raise ValueError(f"{u8.size} bytes are not whole {dtype} elements")
    top = 1 << (8 * size - 1)
    return bool(u8.view(_NP_SIGNED[size]).max() >= field or int(u8.view(_NP_UNSIGNED[size]).max()) >= top | field)


#: elements per slice of :func:`torch_nonfinite`'s bit test: its temporaries (the masked integers
#: and the comparison's bools) are ``(size + 1) x 2^24`` bytes at most -- 48 MiB for bfloat16 --
#: whatever the tensor's size (the whole-tensor test took another 1.16 GiB + 0.58 GiB for Qwen3-8B's
#: bfloat16 embedding: a full IPC sync then ran out of memory on a nearly full card, s15)
SCAN_CHUNK = 1 << 24


def torch_nonfinite(t: torch.Tensor) -> torch.Tensor:
    """0-dim bool tensor on ``t``'s device: ``t`` holds a non-finite value (the same bit test,
    on any device; one read of ``t`` -- the fallback where no checksum pass runs over it), in
    slices of :data:`SCAN_CHUNK` elements (no host sync; a non-contiguous ``t`` is copied first)."""
    if t.dtype not in _FIELD or not t.numel():
        return torch.zeros((), dtype=torch.bool, device=t.device)
    field, size = _FIELD[t.dtype]
    iv = t.detach().contiguous().view(_INT[size]).reshape(-1)
    m = _wrap(field) if size == 8 else field
    if iv.numel() <= SCAN_CHUNK:
        return ((iv & m) == m).any()
    return torch.stack([((c & m) == m).any() for c in iv.split(SCAN_CHUNK)]).any()


class Scan(NamedTuple):
    """What a fused copy + checksum pass saw, per tensor of its ``n`` sources.

    Attributes:
        sums: int64 ``[n]`` ``s64sum`` checksums (on the sources' device), or ``None``.
        bad: bool / int ``[n]`` (non-zero: the tensor holds a non-finite value), or ``None``
            when the pass did not test.
    """

    sums: torch.Tensor | None
    bad: torch.Tensor | None


def refusal(names: list[str], where: str = "") -> str:
    """The message of a refused update: the tensors named (at most 8), where they were found."""
    shown = ", ".join(repr(n) for n in names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return (f"non-finite values (NaN or +-inf) in {shown}{' (' + where + ')' if where else ''}: the update is refused "
            "and not committed (start the server with --no-weight-check-finite to accept such weights)")
