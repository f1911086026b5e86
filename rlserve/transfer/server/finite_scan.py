"""The receiver's checksum pass with the non-finite test folded in (:mod:`rlserve.transfer.finite`).

A received bucket (or tensor) is read once: its ``s64sum`` and, per tensor in it, whether it
holds a NaN or an infinity. Host bytes: :func:`rlserve.transfer.host_ops.host_scan_spans`
(numpy pieces on our threads). Device bytes: one :class:`~rlserve.transfer.multi_tensor.MultiTensorSum`
launch over the slots' byte ranges, each tested as the dtype it holds; where that launch cannot
run (slots not 8-byte aligned: vLLM's back-to-back layout, which carries no checksums), the
bucket's sum and each slot's test are separate reductions.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Sequence

import torch

from rlserve.transfer.errors import NonFiniteWeightsError
from rlserve.transfer.finite import Scan, checked, refusal, torch_nonfinite
from rlserve.transfer.host_ops import host_scan_spans
from rlserve.transfer.wire.packing import checksum, checksum_tensor

#: Chunk tables of device scans kept, by bucket layout (least recently used go); each is a few
#: small device tensors
MAX_SCAN_OPS = 1024
_scan_ops: OrderedDict = OrderedDict()
_scan_ops_lock = threading.Lock()

#: ``(name, byte offset, bytes, dtype)`` of one tensor inside a received byte buffer
Unit = tuple[str, int, int, torch.dtype]
#: non-finite tensors found: names (known now) or ``(int / bool flags [k] on a device, k names)``
Bad = "list[str] | tuple[torch.Tensor, list[str]]"


def bucket_units(bucket) -> list[Unit]:
    """The :data:`Unit` of every slot of a :class:`~rlserve.transfer.wire.packing.Bucket`."""
    return [(s.name, s.offset, s.nbytes, s.dtype) for s in bucket.slots]


def scan(u8: torch.Tensor, units: Sequence[Unit], want_sum: bool, check: bool):
    """The checksum of ``u8`` (1-D uint8, contiguous) and the non-finite tensors among ``units``.

    Returns:
        ``(sum, bad)``: ``sum`` an int (host bytes), a 0-dim int64 tensor queued on the device
        (device bytes) or ``None`` (not ``want_sum``); ``bad`` a :data:`Bad` (``[]`` when not
        ``check``). Device results are queued on the current stream: read them with
        :func:`bad_names` / ``checksum_values`` (one host sync).
    """
    tested = [u for u in units if u[2] and checked(u[3])] if check else []
    if not tested:
        if not want_sum:
            return None, []
        return (checksum_tensor(u8) if u8.is_cuda else checksum(u8)), []
    if not u8.is_cuda:
        total, flags = host_scan_spans(u8, [(o, n, d) for _, o, n, d in tested], s64sum=want_sum)
        return total, [u[0] for u, f in zip(tested, flags) if f]
    return _device_scan(u8, list(units), want_sum)


def _device_scan(u8: torch.Tensor, units: list[Unit], want_sum: bool):
    """One launch over ``u8`` cut at the slots' offsets (each piece runs to the next slot, its
    zero padding included, so the pieces' sums add up to ``u8``'s), each piece tested as its
    slot's dtype. Needs every offset 8-byte aligned (rlserve's layout); else (vLLM's raw
    layout) the sum and each slot's test are separate reductions."""
    from rlserve.transfer.multi_tensor import MultiTensorSum

    names = [u[0] for u in units]
    starts = [u[1] for u in units]
    ends = starts[1:] + [u8.numel()]
    op = None
    if starts and starts[0] == 0 and all(a % 8 == 0 for a in starts):
        # the chunk table of this layout, built once and moved to u8's address (a packed CUDA
        # IPC bucket is mapped at a new address at every update: building it per bucket cost
        # Python per slot)
        key = (u8.numel(), str(u8.device), tuple((o, d) for _, o, _, d in units))
        with _scan_ops_lock:
            tmpl = _scan_ops.get(key)
            if tmpl is not None:
                _scan_ops.move_to_end(key)
        if tmpl is None:
            built = MultiTensorSum.build([u8[a:b] for a, b in zip(starts, ends)], check_finite=True,
                                         check_dtypes=[d if checked(d) else None for *_, d in units])
            tmpl = (built.relocated(-u8.data_ptr()) if built is not None else None) or False
            with _scan_ops_lock:
                _scan_ops[key] = tmpl
                while len(_scan_ops) > MAX_SCAN_OPS:
                    _scan_ops.popitem(last=False)
        op = tmpl.relocated(u8.data_ptr(), keep=u8) if tmpl is not False else None
    if op is not None:
        sums = op.run()
        return (sums.sum() if want_sum else None), (op.bad, names)
    total = checksum_tensor(u8) if want_sum else None
    flags = torch.stack([torch_nonfinite(_typed(u8[o:o + n], d)) for _, o, n, d in units])
    return total, (flags, names)


def _typed(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``raw`` (uint8) viewed as ``dtype``; copied first when its offset is not a multiple of the
    element size (torch cannot view it in place)."""
    return (raw.clone() if raw.storage_offset() % dtype.itemsize else raw).view(dtype)


def scan_result(ret, names: Sequence[str]):
    """``(sums [n], bad)`` of a sink's :class:`~rlserve.transfer.finite.Scan` over the tensors
    ``names`` (``(None, None)`` when the sink returned none; ``bad`` is ``None`` when it did not
    test)."""
    if not isinstance(ret, Scan) or ret.sums is None or ret.sums.numel() != len(names):
        return None, None
    if ret.bad is None:
        return ret.sums, None
    return ret.sums, ((ret.bad, list(names)) if ret.bad.is_cuda else [n for n, f in zip(names, ret.bad.tolist()) if f])


def bad_names(bad) -> list[str]:
    """The names in a :data:`Bad` (one host sync for device flags)."""
    if isinstance(bad, tuple):
        flags, names = bad
        return [n for n, f in zip(names, flags.tolist()) if f]
    return list(bad or ())


def raise_if_bad(bad, where: str) -> None:
    """Raise :class:`NonFiniteWeightsError` naming the tensors of ``bad`` (a :data:`Bad`), if any."""
    names = bad_names(bad)
    if names:
        raise NonFiniteWeightsError(refusal(names, where))
