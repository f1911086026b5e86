"""Packing a bucket of a trainer's CUDA tensors in one launch (the CUDA IPC packed sender).

:func:`rlserve.transfer.wire.packing.pack` copies slot by slot: per tensor a slice, a byte view,
a ``copy_`` launch and a ``zero_`` of the padding after it, ~15 us of Python and launches each;
the 11,007 per-expert tensors of 28 Qwen3-30B-A3B layers are ~0.17 s of a sync whose copy floor
is 24 ms (BENCHMARKS.md, MoE). Then the bucket's checksum read every byte once more.

:class:`DevicePacker` builds, once per (bucket layout, source addresses), a
:class:`~rlserve.transfer.multi_tensor.MultiTensorSum` that copies every slot and zero-fills
every padding gap (from a zero block) in ONE launch and sums the bytes it wrote in the same pass;
the buffer is a fresh allocation per sync, so the op's destination table is moved to it with one
device add (:meth:`~rlserve.transfer.multi_tensor.MultiTensorSum.relocated`). The key holds every
source's address, so a cached op always reads the tensors the caller holds now (a tensor made for
this sync, a cast or an FSDP gather, at a new address is a new key: built once more, like
:func:`pack`); the op keeps no reference to them. Only where the op can run (contiguous, 8-byte
aligned, slot sizes a multiple of 8 bytes); otherwise the caller packs as before.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

from rlserve.transfer.wire.packing import ALIGN, Bucket

#: Pack ops kept (least recently used go): one per bucket layout of the trainer's tensors.
MAX_OPS = 4096


class DevicePacker:
    """One-launch packs of CUDA tensors into fresh bucket buffers (module docstring)."""

    def __init__(self, _allow_cpu: bool = False):
        self._allow_cpu = _allow_cpu  # tests: CPU tensors through Triton's interpreter
        self._ops: OrderedDict[tuple, object] = OrderedDict()
        self._zeros: dict[torch.device, torch.Tensor] = {}

    def pack(self, buf: torch.Tensor, bucket: Bucket, tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """Queue the copy of ``tensors`` (one per slot) into ``buf[:bucket.nbytes]``, padding
        zeroed, on the current stream; returns the bucket's ``s64sum`` checksum as a 0-dim int64
        device tensor (equal to ``checksum_tensor(buf[:bucket.nbytes])``), or ``None`` when this
        bucket cannot take the one-launch path (then nothing was written).

        Args:
            buf: 1-D uint8 CUDA buffer of at least ``bucket.nbytes`` bytes, 8-byte aligned.
            tensors: the slots' tensors (dtypes and shapes checked by the caller), alive until
                the copy has run (it is queued on the current stream).
        """
        if not (buf.is_cuda or self._allow_cpu) or buf.data_ptr() % 8 or buf.numel() < bucket.nbytes:
            return None
        for t in tensors:
            if t.device != buf.device or not t.is_contiguous():
                return None
        key = (buf.device, bucket.nbytes, tuple((s.offset, s.nbytes) for s in bucket.slots),
               tuple(t.data_ptr() for t in tensors))
        tmpl = self._ops.get(key)
        if tmpl is None:
            tmpl = self._build(buf, bucket, tensors)
            self._ops[key] = tmpl
            while len(self._ops) > MAX_OPS:
                self._ops.popitem(last=False)
        else:
            self._ops.move_to_end(key)
        if tmpl is False:
            return None
        return tmpl.relocated(0, keep=buf, dst_delta=buf.data_ptr()).run().sum()

    def _build(self, buf: torch.Tensor, bucket: Bucket, tensors: Sequence[torch.Tensor]):
        """The op for ``buf`` with its destinations moved to offsets from address 0, or False."""
        from rlserve.transfer.multi_tensor import MultiTensorSum

        zeros = self._zeros.get(buf.device)
        if zeros is None:
            zeros = self._zeros[buf.device] = torch.zeros(ALIGN, dtype=torch.uint8, device=buf.device)
        out = buf[: bucket.nbytes]
        srcs, dsts = [], []
        end = 0
        for slot, t in zip(bucket.slots, tensors, strict=True):
            gaps = [(end, slot.offset)] if slot.offset > end else []
            for a, b in gaps:
                if b - a > zeros.numel():
                    return False
                srcs.append(zeros[: b - a])
                dsts.append(out[a:b])
            if slot.nbytes:
                srcs.append(t.reshape(-1).view(torch.uint8))
                dsts.append(out[slot.offset: slot.offset + slot.nbytes])
            end = slot.offset + slot.nbytes
        if bucket.nbytes > end:
            if bucket.nbytes - end > zeros.numel():
                return False
            srcs.append(zeros[: bucket.nbytes - end])
            dsts.append(out[end:])
        op = MultiTensorSum.build(srcs, dsts, _allow_cpu=self._allow_cpu)
        if op is None:
            return False
        # (the zero block is read at its own address; only destinations move)
        return op.relocated(0, keep=zeros, dst_delta=-buf.data_ptr()) or False
