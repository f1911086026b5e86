"""Copy plans of packed buckets that arrive at a new address every update (CUDA IPC packed).

A packed CUDA IPC update is one ``update_weights`` call per bucket; the server maps that
bucket's trainer buffer anew each time, so the bucket's tensors are new views at new addresses
at every sync. :mod:`rlserve.transfer.server.copy_plan` keys its recorded plans on the sources'
addresses, so such a bucket was recorded again (``load_weights`` under a dispatch mode) at every
sync: ~0.12 ms per tensor on the H100's host for the Qwen3-30B-A3B shape (11,007 per-expert
names: 1,546 ms for 36.1 GB against a 23.9 ms copy floor; BENCHMARKS.md, MoE), and ~0.5 ms per
tensor on a loaded 2-core CPU (``benchmarks/moe_sync_cpu.py``).

A :class:`BucketPlan` is a recorded plan with every source stored as a byte offset into the
bucket, keyed on the bucket's layout (names, dtypes, shapes, offsets) instead of addresses:
the next bucket of that layout replays it at its own address. On CUDA, the same-dtype
contiguous copies are one :class:`~rlserve.transfer.multi_tensor.MultiTensorSum` launch whose
source table is moved by one device add (:meth:`~rlserve.transfer.multi_tensor.MultiTensorSum.relocated`);
elsewhere (and for strided or casting copies) each source view is rebuilt at its offset. The
plan holds no reference to the bucket it was recorded from (that memory is the trainer's).

A plan's first replay is checked (:meth:`BucketPlan.mismatch`, called by the worker): every
destination must then hold its source's bytes in the new bucket. One that does not (a
relocation or ordering bug, or a load whose copies overlap) is never replayed again, and that
bucket is loaded with ``load_weights`` right away, so a wrong replay cannot reach the served
weights unnoticed (it is logged as an error).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from rlserve.transfer.host_ops import host_copy_many, host_copyable
from rlserve.transfer.server.copy_plan import CopyPlan, _byte_span
from rlserve.transfer.wire.packing import unpack


#: Tests only: build the one-launch copy for CPU tensors too (Triton's interpreter), to run the
#: CUDA branch of :meth:`BucketPlan.replay` on a CPU machine.
_ONE_LAUNCH_ON_CPU = False


class BucketPairs(Sequence):
    """The ``(name, view)`` pairs of one packed bucket in ``buf`` (1-D uint8), unpacked on first
    use only: a replayed :class:`BucketPlan` never needs the per-tensor views."""

    def __init__(self, buf: torch.Tensor, bucket):
        self.buf, self.bucket = buf, bucket
        self._pairs: list | None = None

    def _get(self) -> list:
        if self._pairs is None:
            self._pairs = list(unpack(self.buf, self.bucket))
        return self._pairs

    def __len__(self) -> int:
        return len(self.bucket.slots)

    def __getitem__(self, i):
        return self._get()[i]

    def __iter__(self):
        return iter(self._get())

    @functools.cached_property
    def layout_key(self) -> tuple:
        """What a plan of this bucket depends on besides the parameters: each slot's name,
        dtype, shape and offset, and the bucket's size."""
        return (self.bucket.nbytes,) + tuple((s.name, s.dtype, s.shape, s.offset) for s in self.bucket.slots)


def _view_at(buf: torch.Tensor, off: int, dtype: torch.dtype, size, stride) -> torch.Tensor:
    """A ``dtype`` view of ``buf``'s bytes from byte ``off`` with ``size`` / ``stride``.

    Raises:
        ValueError: the bytes are not aligned to ``dtype``'s size."""
    st = buf.untyped_storage()
    byte = buf.data_ptr() - st.data_ptr() + off
    if byte % dtype.itemsize:
        raise ValueError(f"bucket offset {off} is not aligned to {dtype}")
    return torch.empty(0, dtype=dtype, device=buf.device).set_(st, byte // dtype.itemsize, size, stride)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one dtype and shape hold the same bytes (NaN payloads included)."""
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


class BucketPlan:
    """A :class:`~rlserve.transfer.server.copy_plan.CopyPlan` with its sources as byte offsets
    into the bucket (see the module docstring). Build with :meth:`from_plan`."""

    def __init__(self, fills, fast_d, fast_src, slow, op, nbytes: int):
        self._fills = fills
        self._fast_d = fast_d  # destinations of the same-dtype contiguous copies
        self._fast_src = fast_src  # (byte offset, dtype, shape, stride) of their sources
        self._slow = slow  # (dst, (byte offset, dtype, size, stride)): strided / casting copies
        self._op = op  # CUDA: the fast copies as one launch, sources at offsets from address 0
        self.nbytes = nbytes
        #: whether a replay was checked (:meth:`mismatch`); the worker checks the first one
        self.verified = False

    @classmethod
    def from_plan(cls, plan: CopyPlan, buf: torch.Tensor) -> "BucketPlan | None":
        """The plan recorded from a load of ``buf``'s unpacked views, relative to ``buf``; ``None``
        when a source is not a view inside ``buf`` (e.g. a misaligned slot that :func:`unpack`
        copied) or the plan reads outside it."""
        base, end, sptr = buf.data_ptr(), buf.data_ptr() + buf.numel(), buf.untyped_storage().data_ptr()

        def rel(s: torch.Tensor):
            a, b = _byte_span(s)
            if s.untyped_storage().data_ptr() != sptr or a < base or b > end:
                return None
            return (a - base, s.dtype, tuple(s.shape), tuple(s.stride()))

        fast_d, fast_s = plan._fast
        fast_src = [rel(s) for s in fast_s]
        slow = [(d, rel(s)) for d, s in plan._slow]
        if any(r is None for r in fast_src) or any(r is None for _, r in slow):
            return None
        op = None
        if fast_d and (fast_d[0].is_cuda or _ONE_LAUNCH_ON_CPU):
            from rlserve.transfer.multi_tensor import MultiTensorSum

            built = MultiTensorSum.build(list(fast_s), list(fast_d), _allow_cpu=_ONE_LAUNCH_ON_CPU)
            op = built.relocated(-base) if built is not None else None
        return cls(list(plan._fills), list(fast_d), fast_src, slow, op, buf.numel())

    def replay(self, buf: torch.Tensor) -> None:
        """Every fill, then every copy, from ``buf`` (a bucket of the recorded layout, at any
        address), on the current stream (asynchronous on CUDA).

        Raises:
            ValueError: ``buf`` is smaller than the recorded bucket."""
        if buf.numel() < self.nbytes:
            raise ValueError(f"bucket of {buf.numel()} bytes, the plan reads {self.nbytes}")
        for func, args, kwargs in self._fills:
            func(*args, **kwargs)
        if self._op is not None:
            self._op.relocated(buf.data_ptr(), keep=buf).run()
        elif self._fast_d:
            srcs = [_view_at(buf, *r) for r in self._fast_src]
            pairs = list(zip(self._fast_d, srcs))
            if all(host_copyable(d, s) for d, s in pairs):
                host_copy_many(pairs)
            else:
                torch._foreach_copy_(self._fast_d, srcs)
        for dst, r in self._slow:
            dst.copy_(_view_at(buf, *r))

    def mismatch(self, buf: torch.Tensor) -> str | None:
        """After :meth:`replay` from ``buf`` (queued on the current stream): ``None`` when every
        destination holds exactly its source's bytes in ``buf`` (a cast copy: the source cast to
        the destination's dtype, as ``copy_`` does), else a description of the first that does
        not. One host sync. On CUDA the same-dtype copies are compared as per-tensor ``s64sum``
        checksums of destination and source (two one-launch passes,
        :class:`~rlserve.transfer.multi_tensor.MultiTensorSum`); elsewhere with ``torch.equal``.
        A destination written by two copies (overlapping) reads as a mismatch: the caller then
        loads without the plan, which is correct, only slower."""
        srcs = [_view_at(buf, *r) for r in self._fast_src]
        sums = None
        if self._fast_d and self._fast_d[0].is_cuda:
            from rlserve.transfer.multi_tensor import MultiTensorSum

            a, b = MultiTensorSum.build(self._fast_d), MultiTensorSum.build(srcs)
            if a is not None and b is not None:
                sums = (a.run(), b.run())
        if sums is not None:
            bad = (sums[0] != sums[1]).nonzero()
            if bad.numel():
                i = int(bad[0, 0])
                return f"copy {i + 1}/{len(srcs)} of {list(srcs[i].shape)} {srcs[i].dtype} (checksums differ)"
        else:
            for i, (d, s) in enumerate(zip(self._fast_d, srcs)):
                if not _same_bytes(d, s):
                    return f"copy {i + 1}/{len(srcs)} of {list(s.shape)} {s.dtype}"
        for j, (dst, r) in enumerate(self._slow):
            src = _view_at(buf, *r)
            if not _same_bytes(dst, src.to(dst.dtype)):
                return f"strided / cast copy {j + 1}/{len(self._slow)} of {list(src.shape)} {src.dtype}"
        return None

    def __len__(self) -> int:
        return len(self._fast_d) + len(self._slow)
