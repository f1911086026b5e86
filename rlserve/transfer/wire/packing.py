"""Bucket plan, packing and the per-bucket checksum.

Bucket plan (identical on trainer and server, computed from names / dtypes / shapes alone):
tensors are laid in update order into a bucket; each tensor starts at an offset aligned up to
:data:`ALIGN` bytes (so every slice can be viewed as its dtype and copies stay vectorised); the
bucket's size is the end of its last tensor aligned up to ``ALIGN``. A bucket **closes once its
bytes exceed** ``packed_buffer_size_bytes`` (vLLM's rule): the tensor that crosses the limit stays
in the bucket, so a bucket may be larger than the nominal size (by at most its last tensor plus
padding) and a tensor larger than the size gets a bucket of its own (plus whatever preceded it).
Receive buffers are therefore sized ``max(bucket.nbytes)``, not the nominal size.

Buckets are raw bytes (``torch.uint8``): each tensor is copied in as its contiguous byte view,
so one bucket mixes dtypes freely. Padding bytes are zero.

Checksum ``"s64sum"``: the sum, as a wrapping (two's-complement) int64, of the bytes read as
little-endian int64 words (zero-padded to a multiple of 8 bytes). Why this one:

- cheap: one memory-bound read pass on the device the bytes live on (``Tensor.sum()`` over an
  int64 view: no copy, no widening, ~13 GB/s on one CPU core, HBM speed on a GPU; an int32 view
  summed into int64 runs at a thirtieth of that on CPU), one scalar transferred to the host;
- exact and order-independent: integer addition modulo 2^64 is associative and commutative, so a
  CUDA trainer, a CPU server and a different GPU kernel all get the same number whatever their
  reduction order (a float sum would not);
- additive: a bucket's checksum is the sum of its tensors' checksums (offsets are multiples of 8
  and padding is zero), so the trainer computes them per tensor, before packing, and announces
  them in ``update_info`` ahead of the data.

It detects any change of a single word, truncation, zeroed or wrong buckets, and dtype/shape
mix-ups; it does not detect two words swapping places (not a failure mode of a broadcast).

On the CPU the packing copies and the checksums are numpy calls on a few threads of ours
(:mod:`rlserve.transfer.host_ops`: torch's OpenMP pool competes with gloo's threads for the cores).

Layout header (:func:`layout_header`): the first message of every gloo / NCCL update sent from
rank 0 (:func:`uses_layout_header`), an int64 ``[8]`` (64 bytes) describing the messages that
follow, so that a receiver whose metadata differs from the trainer's notices before it posts any
receive of a bucket or tensor (see :mod:`rlserve.transfer.server.receiver`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import torch

from rlserve.transfer.host_ops import host_copy_many, host_s64sum, wrap64

#: Alignment of each tensor inside a bucket, in bytes.
ALIGN = 256


def _align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Slot:
    """One tensor's place in a bucket. ``offset`` and ``nbytes`` are in bytes."""

    index: int  # position in the update's names list
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    """A group of tensors sent as one byte buffer of ``nbytes`` bytes (a multiple of ALIGN)."""

    index: int
    slots: tuple[Slot, ...]
    nbytes: int


def tensor_nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    """Bytes of a contiguous tensor of this dtype and shape."""
    n = 1
    for s in shape:
        n *= int(s)
    return n * dtype.itemsize


def plan_buckets(
    names: Sequence[str],
    dtypes: Sequence[torch.dtype],
    shapes: Sequence[Sequence[int]],
    bucket_size_bytes: int,
    align: int = ALIGN,
) -> list[Bucket]:
    """Lay tensors in order into buckets; a bucket closes once its bytes exceed the size.

    Args:
        names / dtypes / shapes: the update's tensors, in send order.
        bucket_size_bytes: ``packed_buffer_size_bytes``.
        align: each tensor starts at a multiple of this many bytes (rlserve's layout: 256; 1 is
            vLLM's, tensors back to back with no padding:
            :func:`rlserve.transfer.backends.vllm_group.plan_vllm_buckets`).
    Returns:
        Buckets in send order; every tensor is in exactly one. Deterministic: trainer and server
        compute the same plan from the same metadata.
    """
    if bucket_size_bytes < 1:
        raise ValueError("bucket_size_bytes must be >= 1")
    buckets: list[Bucket] = []
    slots: list[Slot] = []
    cur = 0
    for i, (name, dt, shape) in enumerate(zip(names, dtypes, shapes)):
        nb = tensor_nbytes(dt, shape)
        off = cur  # cur is already aligned
        slots.append(Slot(i, name, dt, tuple(int(s) for s in shape), off, nb))
        cur = _align_up(off + nb, align)
        if cur > bucket_size_bytes:
            buckets.append(Bucket(len(buckets), tuple(slots), cur))
            slots, cur = [], 0
    if slots:
        buckets.append(Bucket(len(buckets), tuple(slots), cur))
    return buckets


def max_bucket_bytes(plan: Sequence[Bucket]) -> int:
    """The receive / send buffer size this plan needs, in bytes."""
    return max((b.nbytes for b in plan), default=0)


class BucketBuffers:
    """``n`` reusable 1-D ``uint8`` bucket buffers of at least ``nbytes`` bytes on one device.

    Kept across updates on purpose: a fresh host buffer of a GiB is fresh pages, and the first
    write to each page faults (the kernel zeroes it). Measured on the 2-core CI machine
    (SmolLM2-135M fp32, 0.54 GB, 64 MiB buckets, gloo): allocating the trainer's two send buffers
    per sync made a sync 0.49 s, reusing them 0.30 s. Memory: ``n x nbytes`` stays allocated
    until :meth:`release`.
    """

    def __init__(self):
        self._bufs: list[torch.Tensor] = []

    def get(self, n: int, nbytes: int, device: torch.device) -> list[torch.Tensor]:
        """``n`` buffers of >= ``nbytes`` bytes on ``device`` (the kept ones when they fit)."""
        device = torch.device(device)
        if len(self._bufs) != n or any(b.numel() < nbytes or b.device != device for b in self._bufs):
            self._bufs = []  # free the old ones before allocating
            self._bufs = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(n)]
        return self._bufs

    def release(self) -> None:
        """Free the buffers."""
        self._bufs = []


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D ``uint8`` view of ``t``'s contiguous bytes (a copy only if ``t`` is not contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def checksum(u8: torch.Tensor) -> int:
    """The ``s64sum`` checksum of a 1-D uint8 tensor (see module docstring). Computed on the
    tensor's device; returns a Python int in the int64 range (one host sync)."""
    if u8.device.type == "cpu":
        return host_s64sum(u8)
    return wrap64(int(checksum_tensor(u8).item()))


def checksum_tensor(u8: torch.Tensor) -> torch.Tensor:
    """Like :func:`checksum` but returns the 0-dim int64 tensor on ``u8``'s device (no sync)."""
    if u8.device.type == "cpu":
        return torch.tensor(host_s64sum(u8), dtype=torch.int64)
    n = u8.numel()
    n8 = n - n % 8
    if n8 and (u8.storage_offset() % 8):
        u8 = u8.clone()  # an int64 view needs an 8-byte-aligned start
    if n8:
        total = u8[:n8].view(torch.int64).sum()
    else:
        total = torch.zeros((), dtype=torch.int64, device=u8.device)
    if n != n8:
        tail = torch.zeros(8, dtype=torch.uint8, device=u8.device)
        tail[: n - n8] = u8[n8:]
        total = total + tail.view(torch.int64)[0]
    return total


def checksum_values(sums: Sequence[torch.Tensor]) -> list[int]:
    """Python ints of 0-dim int64 :func:`checksum_tensor` results, with one host sync per
    device (not per tensor)."""
    by_dev: dict = {}
    for i, c in enumerate(sums):
        by_dev.setdefault(c.device, []).append(i)
    vals: dict[int, int] = {}
    for idx in by_dev.values():
        for i, v in zip(idx, torch.stack([sums[i] for i in idx]).tolist()):
            vals[i] = wrap64(int(v))
    return [vals[i] for i in range(len(sums))]


def tensor_checksum(t: torch.Tensor) -> int:
    """``s64sum`` of a tensor's contiguous bytes (equal to its share of a bucket checksum)."""
    return checksum(as_bytes(t))


def combine(checksums: Iterable[int]) -> int:
    """Sum checksums with int64 wrap-around (a bucket's checksum from its tensors')."""
    return wrap64(sum(checksums))


def bucket_checksums_from_tensors(plan: Sequence[Bucket], per_tensor: Sequence[int]) -> list[int]:
    """Per-bucket checksums from per-tensor checksums (indexed like the update's names)."""
    return [combine(per_tensor[s.index] for s in b.slots) for b in plan]


def pack(buf: torch.Tensor, bucket: Bucket, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Copy ``tensors`` (one per slot, in slot order) into ``buf[:bucket.nbytes]``; zero padding.

    Args:
        buf: 1-D uint8 buffer of at least ``bucket.nbytes`` bytes (any device; copies cross devices).
        tensors: tensors of the slots' dtypes and shapes.
    Returns:
        ``buf[:bucket.nbytes]``.
    Raises:
        ValueError: a tensor's dtype / shape differs from its slot.
    """
    return _pack(buf, bucket, tensors, False)[0]


def pack_checksummed(buf: torch.Tensor, bucket: Bucket,
                     tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, int | torch.Tensor]:
    """:func:`pack`, and the packed bucket's :func:`checksum`: an int for a CPU buffer filled
    from CPU tensors (each piece summed right after its copy, :func:`host_copy_many`), else the
    0-dim int64 :func:`checksum_tensor` queued on ``buf``'s device. Raises what :func:`pack` raises."""
    return _pack(buf, bucket, tensors, True)


def _pack(buf, bucket, tensors, want_sum: bool):
    out = buf[: bucket.nbytes]
    end_prev = 0
    host, other = [], []  # CPU -> CPU: one multi-threaded numpy call (rlserve.transfer.host_ops)
    for slot, t in zip(bucket.slots, tensors, strict=True):
        if t.dtype != slot.dtype or tuple(t.shape) != slot.shape:
            raise ValueError(f"{slot.name}: got {t.dtype} {tuple(t.shape)}, plan says {slot.dtype} {slot.shape}")
        if slot.offset > end_prev:
            out[end_prev: slot.offset].zero_()
        if slot.nbytes:
            dst, src = out[slot.offset: slot.offset + slot.nbytes], as_bytes(t)
            (host if dst.device.type == "cpu" and src.device.type == "cpu" else other).append((dst, src))
        end_prev = slot.offset + slot.nbytes
    if bucket.nbytes > end_prev:
        out[end_prev:].zero_()
    for dst, src in other:
        dst.copy_(src)
    fused = host_copy_many(host, s64sums=want_sum and not other) if host else None
    if not want_sum:
        return out, None
    if not other:  # every byte came through the host copies (the rest is zero padding)
        return out, combine(fused or ())
    return out, checksum_tensor(out) if out.is_cuda else checksum(out)


def in_place_bucket(bucket: Bucket, tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor | None:
    """The bucket's bytes without packing: a ``uint8 [bucket.nbytes]`` view over ``tensors``
    when they already lie in memory exactly as :func:`pack` would lay them out (contiguous, on
    ``device``, in one storage, one right after the other with no padding before, between or
    after them: e.g. a tensor of a multiple of ``ALIGN`` bytes alone in its bucket, like a large
    embedding table, or parameters a trainer keeps in one flat buffer); else ``None``. The view
    reads the tensors' own memory: they must not change until it has been sent."""
    if not tensors or len(tensors) != len(bucket.slots):
        return None
    first = tensors[0]
    st = first.untyped_storage()
    base = first.data_ptr()
    end = 0
    for slot, t in zip(bucket.slots, tensors):
        if slot.offset != end or not slot.nbytes or t.device != device or not t.is_contiguous() \
                or t.data_ptr() != base + slot.offset or t.untyped_storage().data_ptr() != st.data_ptr():
            return None
        end = slot.offset + slot.nbytes
    start = base - st.data_ptr()
    if end != bucket.nbytes or start + end > st.nbytes():
        return None
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(st, start, (end,))


def unpack(buf: torch.Tensor, bucket: Bucket) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, view)`` for each slot: views into ``buf`` (no copy) of the slot's dtype
    and shape. The caller must copy them out before ``buf`` is reused. A slot at an offset that
    is not a multiple of its element size (vLLM's back-to-back layout after an odd-sized fp8
    tensor) is yielded as a copy: torch cannot view misaligned bytes as a wider dtype."""
    for slot in bucket.slots:
        raw = buf[slot.offset: slot.offset + slot.nbytes]
        if raw.storage_offset() % slot.dtype.itemsize:
            raw = raw.clone()
        yield slot.name, raw.view(slot.dtype).view(slot.shape)


# --------------------------------------------------------------------------- layout header
#: ``HEADER_MAGIC | HEADER_VERSION`` is word 0 of a layout header: "RLSVLH" in the top 48 bits,
#: the version in the low 16.
HEADER_MAGIC = int.from_bytes(b"RLSVLH", "big") << 16
#: Layout version; a receiver refuses a header of another version.
HEADER_VERSION = 1
#: int64 words of a layout header (64 bytes).
HEADER_WORDS = 8
HEADER_BYTES = HEADER_WORDS * 8
#: Flag bits of word 1.
FLAG_PACKED = 1
FLAG_CHECKSUMS_AFTER = 2


def uses_layout_header(src_rank: int) -> bool:
    """Whether an update sent from ``src_rank`` starts with a layout header: when the trainer is
    rank 0 (``init_info.rank_offset == 1``: the rlserve SDK's and vLLM's layout). TRL's protocol
    puts the trainer on the last rank and broadcasts one tensor per ``update_named_param`` call
    without a header (:class:`rlserve.transfer.sdk.trl.TRLWeightSyncClient`, and TRL's own client),
    so those receives go without one. Both ends decide from the sending rank alone."""
    return src_rank == 0


def _digest64(data: bytes) -> int:
    """blake2b-64 of ``data`` as a signed int64."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def layout_message_sizes(info, plan: Sequence[Bucket] | None = None) -> list[int]:
    """Bytes of each broadcast that follows the header of ``info``'s update, in order.

    Packed: every non-empty bucket of the plan, then -- with ``checksums_after_data`` and at least
    one bucket -- the int64 ``[n_buckets]`` checksum message (``8 * n_buckets`` bytes). Unpacked:
    every non-empty tensor. Empty buckets / tensors are not broadcast, so they have no entry.

    Args:
        info: a resolved :class:`~rlserve.transfer.wire.protocol.UpdateInfo` (``packed`` and
            ``packed_buffer_size_bytes`` set).
        plan: ``info``'s bucket plan when the caller has it (packed only; computed otherwise).
    """
    if info.packed:
        if plan is None:
            plan = plan_buckets(info.names, info.dtypes(), info.shapes, info.packed_buffer_size_bytes)
        sizes = [b.nbytes for b in plan if b.nbytes]
        if info.checksums_after_data and plan:
            sizes.append(8 * len(plan))
        return sizes
    return [n for n in (tensor_nbytes(dt, s) for dt, s in zip(info.dtypes(), info.shapes)) if n]


def layout_header(info, plan: Sequence[Bucket] | None = None) -> list[int]:
    """The layout header of ``info``'s update: ``HEADER_WORDS`` int64 values (Python ints).

    ======  ==============================================================================
    word    value
    ======  ==============================================================================
    0       ``HEADER_MAGIC | HEADER_VERSION``
    1       flags: ``FLAG_PACKED``, ``FLAG_CHECKSUMS_AFTER`` (a checksum message follows the data)
    2       units: buckets (packed) or tensors (unpacked), empty ones included
    3       messages: broadcasts after the header (non-empty units + the checksum message)
    4       data bytes: the sum of the buckets' / tensors' bytes (checksum message excluded)
    5       ``packed_buffer_size_bytes`` (0 when unpacked)
    6       blake2b-64 of the message sizes in order (:func:`layout_message_sizes`, int64 LE)
    7       blake2b-64 of the tensors' names, dtypes and shapes in order (JSON)
    ======  ==============================================================================

    Computed from the metadata alone (trainer and server get the same words from the same
    ``update_info``). Cost: one pass over the names (the plan is the caller's when given).

    Args:
        info: a resolved :class:`~rlserve.transfer.wire.protocol.UpdateInfo`.
        plan: ``info``'s bucket plan when the caller has it (packed only).
    """
    dtypes = info.dtypes()
    if info.packed and plan is None:
        plan = plan_buckets(info.names, dtypes, info.shapes, info.packed_buffer_size_bytes)
    sizes = layout_message_sizes(info, plan)
    after = bool(info.packed and info.checksums_after_data and plan)
    units = len(plan) if info.packed else len(info.names)
    data = sum(sizes) - (8 * units if after else 0)
    flags = (FLAG_PACKED if info.packed else 0) | (FLAG_CHECKSUMS_AFTER if after else 0)
    sizes_digest = _digest64(b"".join(int(n).to_bytes(8, "little") for n in sizes))
    meta = json.dumps([list(info.names), [str(d) for d in dtypes], [[int(x) for x in s] for s in info.shapes]],
                      separators=(",", ":"))
    return [HEADER_MAGIC | HEADER_VERSION, flags, units, len(sizes), data,
            int(info.packed_buffer_size_bytes or 0) if info.packed else 0, sizes_digest,
            _digest64(meta.encode("utf-8", "surrogatepass"))]


def describe_layout(words: Sequence[int]) -> str:
    """A layout header in words, e.g. ``"packed, 21 buckets (bucket size 1 B) / 468224 bytes,
    checksums after the data"``."""
    flags, units, _msgs, data, size = (int(w) for w in words[1:6])
    if flags & FLAG_PACKED:
        s = f"packed, {units} bucket{'s' if units != 1 else ''} (bucket size {size} B) / {data} bytes"
    else:
        s = f"unpacked, {units} tensor{'s' if units != 1 else ''} / {data} bytes"
    return s + (", checksums after the data" if flags & FLAG_CHECKSUMS_AFTER else "")
