"""Trainer-side data plane: broadcast an update's tensors from the trainer rank.

The mirror of :mod:`rlserve.transfer.server.receiver`: the same bucket plan, the same byte layout, the
same order. Tensors come from an iterator (a :class:`~rlserve.transfer.sdk.trainer.ModuleSource`),
are copied into the bucket buffer as they arrive (a gathered FSDP tensor is freed right after),
and each full bucket is broadcast asynchronously; with ``packed_num_buffers`` buffers, packing
bucket ``i+1`` overlaps the broadcast of bucket ``i`` (gloo: the backend's threads; NCCL: the
backend's stream, ordered after the packing copies on the current stream).

Every update from rank 0 (the SDK's layout; TRL's trainer is the last rank and sends none)
starts with a layout header: one int64 ``[8]`` broadcast
(:func:`~rlserve.transfer.wire.packing.layout_header`, 64 bytes, on ``device``: CPU for gloo, the
trainer's GPU for NCCL) before the first bucket / tensor, describing the messages that follow;
the receiver compares it with its own ``update_info`` before it posts any receive, so a
mismatch fails the update cleanly instead of overflowing a gloo receive buffer (which aborts
the server process). It is not waited for before the buckets go out (they follow it on the wire
in collective order); it is waited for, with the group's deadline, at the end with them.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Iterator

import torch

from rlserve.transfer.backends.group import TransferGroup
from rlserve.transfer.wire.packing import (
    BucketBuffers,
    as_bytes,
    checksum,
    checksum_tensor,
    in_place_bucket,
    layout_header,
    max_bucket_bytes,
    pack,
    pack_checksummed,
    plan_buckets,
    uses_layout_header,
)
from rlserve.transfer.wire.protocol import UpdateInfo


class _Done:
    """The work handle of a broadcast that was not needed (no header from a rank other than 0)."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        return True


def send_header(group: TransferGroup, info: UpdateInfo, device: torch.device, plan=None):
    """Broadcast ``info``'s layout header from ``group.rank`` (async); only from rank 0
    (:func:`~rlserve.transfer.wire.packing.uses_layout_header`: TRL's trainer, the last rank, sends
    none and its receiver expects none), else a no-op.

    Args:
        info: the resolved update_info the data that follows is laid out by.
        device: where the header tensor lives (CPU for gloo, the trainer's GPU for NCCL: then
            the copy is queued on the current stream, which the broadcast is ordered after).
        plan: ``info``'s bucket plan when packed (computed when ``None``).
    Returns:
        ``(header, work)``: the int64 ``[HEADER_WORDS]`` tensor (keep it referenced until the
        work completed) and the broadcast's work handle (``(None, completed handle)`` when no
        header is sent).
    """
    if not uses_layout_header(group.rank):
        return None, _Done()
    header = torch.tensor(layout_header(info, plan), dtype=torch.int64)
    dev = torch.device(device)
    if dev.type != "cpu":
        header = header.to(dev)
    return header, group.broadcast(header, group.rank)


def _check_item(name: str, t: torch.Tensor, exp_name: str, exp_dtype: torch.dtype, exp_shape) -> None:
    if name != exp_name:
        raise ValueError(f"source yielded {name!r} where the announced order has {exp_name!r}")
    if t.dtype != exp_dtype or tuple(t.shape) != tuple(exp_shape):
        raise ValueError(f"{name}: source yielded {t.dtype} {tuple(t.shape)}, announced {exp_dtype} {tuple(exp_shape)}")


def take_bucket_tensors(it: Iterator[tuple[str, torch.Tensor]], bucket) -> list[torch.Tensor]:
    """The next ``len(bucket.slots)`` tensors of ``it``, each checked against its slot.

    Raises:
        ValueError: the source ended early or a name / dtype / shape differs from the plan.
    """
    out = []
    for slot in bucket.slots:
        try:
            name, t = next(it)
        except StopIteration:
            raise ValueError(f"source ended before {slot.name!r}") from None
        _check_item(name, t, slot.name, slot.dtype, slot.shape)
        out.append(t)
    return out


def send_packed(group: TransferGroup, info: UpdateInfo, tensors: Iterable[tuple[str, torch.Tensor]],
                device: torch.device, check: Callable[[], None] | None = None,
                buffers: BucketBuffers | None = None) -> dict:
    """Broadcast ``tensors`` (in ``info`` order) as packed buckets from ``group.rank``.

    A bucket whose tensors already lie in memory as the bucket would
    (:func:`~rlserve.transfer.wire.packing.in_place_bucket`: e.g. a large embedding table alone in its
    bucket) is broadcast from that memory, not packed, and uses no buffer: the buffers go
    round-robin over the packed buckets, and at most ``2 x packed_num_buffers`` broadcasts are in
    flight. The layout header (:func:`send_header`) goes out first. Refilling a buffer waits for its
    previous broadcast through :meth:`TransferGroup.order` (NCCL: on the stream, so the host
    packs ahead; gloo: on the host); the last broadcasts are waited for on the host with the
    group's deadline. With ``info.checksums_after_data`` each bucket's checksum is taken as it is
    packed (:func:`~rlserve.transfer.wire.packing.pack_checksummed`; CUDA: queued on the stream) and
    all of them follow the last bucket as one int64 ``[n_buckets]`` broadcast.

    Args:
        group: the transfer group (this rank is the source).
        info: resolved update_info (``packed_buffer_size_bytes``, ``packed_num_buffers`` set).
        tensors: ``(name, tensor)`` in the announced order, announced dtypes and shapes.
        device: where the bucket buffers live (CPU for gloo, the trainer's GPU for NCCL).
        check: polled while waiting; raise from it to give up (the server's HTTP call failed).
        buffers: where the bucket buffers come from; pass the same object every update so they
            are reused (``None``: fresh buffers for this call).
    Returns:
        ``{"bytes", "buckets", "seconds"}``.
    Raises:
        ValueError: the source does not match the announced metadata.
        TransferTimeoutError / WeightTransferFailedError / whatever ``check`` raises.
    """
    t0 = time.perf_counter()
    dtypes = info.dtypes()
    plan = plan_buckets(info.names, dtypes, info.shapes, info.packed_buffer_size_bytes)
    nbuf = max(1, min(info.packed_num_buffers, len(plan)))
    size = max_bucket_bytes(plan)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    pool = buffers or BucketBuffers()
    bufs: list[torch.Tensor] = []  # allocated at the first bucket that needs packing
    works: dict[int, object] = {}
    it = iter(tensors)
    total = 0
    src = group.rank
    after = info.checksums_after_data
    sums: list = []  # checksums_after_data: one per bucket (int, or a 0-dim tensor queued on the GPU)
    keep: dict[int, list] = {}  # unpacked buckets' tensors, alive until their broadcast completed
    users: list[int | None] = [None] * nbuf  # the bucket last packed into each buffer
    n_packed = 0
    header, header_work = send_header(group, info, dev, plan)  # first: before any bucket

    def retire(i: int) -> None:
        group.order(works.pop(i), what=f"bucket {i + 1}/{len(plan)}")
        keep.pop(i, None)

    for bi, b in enumerate(plan):
        items = take_bucket_tensors(it, b)
        if b.nbytes:
            packed = in_place_bucket(b, items, dev)
            if packed is not None:
                keep[bi] = items
                if after:
                    sums.append(checksum_tensor(packed) if packed.is_cuda else checksum(packed))
            else:
                if not bufs:
                    bufs = pool.get(nbuf, size, dev)
                k = n_packed % nbuf  # buffers go round-robin over the packed buckets only
                n_packed += 1
                if users[k] in works:  # buffer k still on the wire: refill after its broadcast
                    retire(users[k])
                users[k] = bi
                if after:
                    packed, bucket_sum = pack_checksummed(bufs[k], b, items)
                    sums.append(bucket_sum)
                else:
                    packed = pack(bufs[k], b, items)
            while len(works) >= 2 * nbuf:  # bounds what in-place buckets keep alive
                retire(min(works))
            works[bi] = group.broadcast(packed, src)
            total += b.nbytes
        elif after:
            sums.append(0)
        del items
        if check is not None:
            check()
    if next(it, None) is not None:
        raise ValueError("source yielded more tensors than announced")
    if after and plan:
        if device.type == "cuda":
            sums_t = torch.stack([s if isinstance(s, torch.Tensor) else torch.tensor(s, dtype=torch.int64, device=device)
                                  for s in sums])
        else:
            sums_t = torch.tensor(sums, dtype=torch.int64)
        works[len(plan)] = group.broadcast(sums_t, src)  # after every bucket, in the same order on all ranks
    group.wait(header_work, what="the layout header", check=check)
    del header
    for bi in sorted(works):
        what = "the bucket checksums" if bi == len(plan) else f"bucket {bi + 1}/{len(plan)}"
        group.wait(works.pop(bi), what=what, check=check)
    return {"bytes": total, "buckets": len(plan), "seconds": time.perf_counter() - t0}


def send_unpacked(group: TransferGroup, info: UpdateInfo, tensors: Iterable[tuple[str, torch.Tensor]],
                  device: torch.device, check: Callable[[], None] | None = None) -> dict:
    """One broadcast per tensor (its bytes), ``packed_num_buffers`` in flight, after the layout
    header (:func:`send_header`). Same contract as :func:`send_packed`."""
    t0 = time.perf_counter()
    dtypes = info.dtypes()
    ahead = max(1, info.packed_num_buffers)
    inflight: dict[int, tuple[torch.Tensor, object]] = {}
    it = iter(tensors)
    total = 0
    src = group.rank
    n = len(info.names)
    header, header_work = send_header(group, info, device)  # first: before any tensor
    for i in range(n):
        if i - ahead in inflight:
            _t, w = inflight.pop(i - ahead)
            group.order(w, what=f"tensor {info.names[i - ahead]!r}")
        try:
            name, t = next(it)
        except StopIteration:
            raise ValueError(f"source ended before {info.names[i]!r}") from None
        _check_item(name, t, info.names[i], dtypes[i], info.shapes[i])
        u8 = as_bytes(t)
        if u8.device != device:
            u8 = u8.to(device)
        if u8.numel():
            inflight[i] = (u8, group.broadcast(u8, src))  # keep u8 alive until sent
            total += u8.numel()
        if check is not None:
            check()
    if next(it, None) is not None:
        raise ValueError("source yielded more tensors than announced")
    group.wait(header_work, what="the layout header", check=check)
    del header
    for i in sorted(inflight):
        _t, w = inflight.pop(i)
        group.wait(w, what=f"tensor {info.names[i]!r}", check=check)
    return {"bytes": total, "buckets": n, "seconds": time.perf_counter() - t0}
