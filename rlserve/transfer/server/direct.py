"""Direct receive: lay a CPU model's parameters out like the update's buckets, then receive
packed gloo buckets straight into them.

A packed update normally lands in a receive buffer and is then copied into the parameters (the
replayed load of :mod:`rlserve.transfer.server.copy_plan`). On a CPU server that copy shares the cores
and the memory bandwidth with gloo's own socket copies. SmolLM2-135M in float32 (538 MB, 64 MiB
buckets) on the 2-core CI machine: the load copy and its checksum cost the server ~50 ms of CPU
per sync while the broadcast alone keeps both cores ~70% busy.

When the same update arrives again (same names, dtypes, shapes, bucket size), the copies it
needs are known from the plans recorded at the first update. If every copy is a plain byte copy
(same dtype, contiguous, whole parameter storages covered exactly once, no constant fills) and
the copies of each parameter storage keep the same distance between stream byte and storage
byte, the storages can live inside one flat ``uint8`` buffer of the stream's size, each at its
stream offset. :func:`build_direct_layout` moves the parameters there (one copy, once: each
``Parameter`` keeps its identity, only its ``.data`` moves). From then on bucket ``i`` is
received straight into ``flat[bases[i] : bases[i] + nbytes]``. Bytes of the stream that no
parameter takes (alignment padding, a tied ``lm_head`` the model does not load) land in
memory that belongs to no parameter.

Only for CPU workers: a CUDA model's parameter addresses are baked into its CUDA graphs.
The receive then writes into the live parameters before any checksum is compared, so it is
used only when checksums come after the data (``checksums_after_data``) or not at all; with
announced checksums (verify before load) the normal path runs. A failed in-place update is
failed either way (the server answers 503 until a full update lands).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlserve.transfer.host_ops import host_copy_many
from rlserve.transfer.wire.packing import Bucket


@dataclass
class DirectLayout:
    """Where each bucket of one update lands when received directly.

    Attributes:
        key: :func:`update_key` of the update the layout was built for.
        params_sig: the parameters' addresses right after the move (the layout is void once they
            change).
        flat: ``uint8 [sum of the buckets' nbytes]`` on the CPU; the moved parameters are views
            into it.
        bases: byte offset of each bucket in ``flat``.
        sizes: each bucket's ``nbytes``.
        storages: ``(offset, nbytes)`` in ``flat`` of each moved parameter storage.
    """

    key: tuple
    params_sig: tuple
    flat: torch.Tensor
    bases: list[int]
    sizes: list[int]
    storages: list[tuple[int, int]]

    def target(self, i: int) -> torch.Tensor:
        """The ``uint8 [sizes[i]]`` view bucket ``i`` is received into."""
        return self.flat[self.bases[i]: self.bases[i] + self.sizes[i]]

    def move_out(self, params: Sequence[torch.nn.Parameter]) -> int:
        """Move every parameter that lives in ``flat`` back into memory of its own: one fresh
        storage per moved storage (parameters that shared a storage before still share one),
        values unchanged. ``flat`` is not touched afterwards by the model (whoever still holds
        it, e.g. a pending receive, may keep writing there). Returns the number of storages."""
        lo = self.flat.data_ptr()
        moved = 0
        for off, n in self.storages:
            inside = [p for p in params if lo + off <= p.data_ptr() < lo + off + n]
            if not inside:
                continue
            fresh = torch.empty(n, dtype=torch.uint8)
            host_copy_many([(fresh, self.flat[off: off + n])])
            for p in inside:
                typed = fresh.view(p.dtype)
                p.data = typed.as_strided(p.shape, p.stride(), (p.data_ptr() - lo - off) // p.element_size())
            moved += 1
        return moved


def update_key(names: Sequence[str], dtype_names: Sequence[str], shapes: Sequence[Sequence[int]],
               bucket_bytes: int) -> tuple:
    """What a layout depends on: the update's names, dtypes, shapes and bucket size."""
    return (tuple(names), tuple(dtype_names), tuple(tuple(int(x) for x in s) for s in shapes), int(bucket_bytes))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storage_moves(buckets: Sequence[Bucket], loads: Sequence[tuple[Sequence[tuple[str, torch.Tensor]], Sequence]],
                   bases: Sequence[int]) -> tuple[dict[int, tuple[int, torch.UntypedStorage]] | None, str | None]:
    """For every parameter storage the loads write: ``storage address -> (stream offset of its
    byte 0, storage)``; ``(None, reason)`` when some copy does not fit the rules of the module
    docstring."""
    shift: dict[int, tuple[int, torch.UntypedStorage]] = {}
    spans: dict[int, list[tuple[int, int]]] = {}
    for b, (pairs, copies), base in zip(buckets, loads, bases, strict=True):
        if copies is None:
            return None, "a load that is more than byte copies (e.g. it fills vocabulary padding)"
        slots = [(t.data_ptr(), _nbytes(t), base + s.offset) for s, (_n, t) in zip(b.slots, pairs, strict=True)]
        for dst, src in copies:
            if dst.device.type != "cpu" or dst.dtype != src.dtype or dst.numel() != src.numel() \
                    or not (dst.is_contiguous() and src.is_contiguous()):
                return None, "a copy that converts or is strided"
            n = _nbytes(dst)
            p = src.data_ptr()
            at = next((off + p - a for a, nb, off in slots if a <= p and p + n <= a + nb), None)
            if at is None:
                return None, "a copy whose source is not one of the bucket's tensors"
            st = dst.untyped_storage()
            d_off = dst.data_ptr() - st.data_ptr()
            prev = shift.setdefault(st.data_ptr(), (at - d_off, st))
            if prev[0] != at - d_off:
                return None, "a parameter whose pieces are not in stream order"
            spans.setdefault(st.data_ptr(), []).append((d_off, d_off + n))
    total = bases[-1] + buckets[-1].nbytes if buckets else 0
    ranges = sorted((off, off + st.nbytes()) for off, st in shift.values())
    if ranges and (ranges[0][0] < 0 or max(e for _a, e in ranges) > total):
        return None, "a parameter that reaches outside the update's bytes"
    if any(e > a for (_s, e), (a, _e) in zip(ranges, ranges[1:])):
        return None, "stream bytes copied into two parameters"
    for ptr, (_off, st) in shift.items():
        end = 0
        for a, e in sorted(spans[ptr]):
            if a != end:
                return None, "a parameter the update does not cover exactly once (e.g. vocabulary padding)"
            end = e
        if end != st.nbytes():
            return None, "a parameter the update does not cover exactly once (e.g. vocabulary padding)"
    return shift, None


def build_direct_layout(params: Sequence[torch.nn.Parameter], buckets: Sequence[Bucket],
                        loads: Sequence[tuple[Sequence[tuple[str, torch.Tensor]], Sequence]],
                        key: tuple, flat: torch.Tensor | None = None) -> tuple[DirectLayout | None, str | None]:
    """Move the parameters the loads write into one flat buffer laid out like the stream.

    Args:
        params: the model's parameters (``model.parameters()``; all on the CPU).
        buckets: the update's bucket plan.
        loads: per bucket, ``(pairs, copies)``: the ``(name, tensor)`` views of the receive
            buffer the sink was given, and every ``(dst, src)`` copy its load made (a recorded
            :class:`~rlserve.transfer.server.copy_plan.CopyPlan`'s :meth:`~CopyPlan.copies`; a plan with
            constant fills gives none).
        key: :func:`update_key` of the update.
        flat: the ``uint8 [sum of the buckets' nbytes]`` host buffer the update was received
            into, bucket ``i`` at the sum of the earlier buckets' sizes (the receiver's
            ``targets``), still holding what arrived: it becomes the layout's buffer and the
            parameters are re-pointed into it with no copy (their bytes are those the loads
            copied out of it: every copy is a plain byte copy and covers each storage exactly
            once, as checked above). ``None``: a fresh buffer, the parameters copied in (one
            copy of the model: 538 MB to fresh pages for SmolLM2 in float32, on one thread).
    Returns:
        ``(layout, None)`` after moving the parameters (their values unchanged), or
        ``(None, reason)`` with nothing moved.
    """
    if not buckets or len(loads) != len(buckets):
        return None, "not every bucket was loaded"
    sizes = [b.nbytes for b in buckets]
    bases = [0] * len(sizes)
    for i in range(1, len(sizes)):
        bases[i] = bases[i - 1] + sizes[i - 1]
    moves, why = _storage_moves(buckets, loads, bases)
    if moves is None:
        return None, why
    by_storage: dict[int, list[torch.nn.Parameter]] = {}
    for p in params:
        by_storage.setdefault(p.untyped_storage().data_ptr(), []).append(p)
    if any(ptr not in by_storage for ptr in moves):
        return None, "a copy into memory that is not a parameter"
    for ptr, (off, _st) in moves.items():
        if any(p.device.type != "cpu" or off % p.element_size() for p in by_storage[ptr]):
            return None, "a parameter not on the CPU or misaligned in the stream"
    if flat is None:
        flat = torch.empty(sum(sizes), dtype=torch.uint8)
        copies = []
        for off, st in moves.values():
            src = torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),))
            copies.append((flat[off: off + st.nbytes()], src))
        host_copy_many(copies)
    elif flat.dtype != torch.uint8 or flat.device.type != "cpu" or flat.numel() != sum(sizes) \
            or not flat.is_contiguous() or any(
                t.numel() and t.data_ptr() != flat.data_ptr() + base + slot.offset
                for b, (pairs, _c), base in zip(buckets, loads, bases) for slot, (_n, t) in zip(b.slots, pairs)):
        return None, "the received buffer is not laid out like the update"
    for ptr, (off, _st) in moves.items():
        for p in by_storage[ptr]:
            typed = flat.view(p.dtype)
            p.data = typed.as_strided(p.shape, p.stride(), off // p.element_size() + p.storage_offset())
    return DirectLayout(key=key, params_sig=(), flat=flat, bases=bases, sizes=sizes,
                        storages=sorted((off, st.nbytes()) for off, st in moves.values())), None
