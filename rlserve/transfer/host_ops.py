"""Host (CPU) copies and checksums for the data planes: numpy, on a few threads of our own.

Why not ``torch``: its CPU ``copy_`` and ``sum`` run on the intra-op OpenMP pool, whose worker
threads keep spinning between parallel regions. During a gloo transfer they steal the cores
that gloo's own send / receive threads need, and the packing copies slow down as well.
Measured on a 2-core machine (SmolLM2-135M in float32, 538 MB, 64 MiB buckets): the trainer
used 0.37 core-seconds per sync and the server 0.26. With ``OMP_NUM_THREADS=1`` that fell to
0.18 and 0.19, and the sync went from 0.33 to 0.24 s. A process-wide thread setting is not
ours to change, in the trainer's process or in a server that also generates on the CPU.

numpy's copies and reductions release the GIL, and on one thread they run as fast as torch's
(538 MB on that machine: a copy takes 0.043 s and an int64 sum 0.020 s). Work over
:data:`PARALLEL_MIN_BYTES` is therefore split into byte ranges and run on a small pool of our
own threads, which sleep on a queue when idle and never spin (:func:`host_threads`). This
matters on hosts with slow cores: on the H200 machine's 16-core Xeon, the server's receive
thread spent ~90 ms of every sync in load copies and ~60 ms in bucket checksums, on one
thread, and the trainer ~70 ms in its checksum pass. That was more than the wire time, so the
pipeline stalled on those copies.
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import os
import threading
from collections.abc import Sequence

import numpy as np
import torch

from rlserve import envs
from rlserve.transfer.finite import checked, np_nonfinite

#: Byte ranges handed to one pool task (split at multiples of 8 bytes: s64sum words). 1 MiB: a
#: fused copy + sum then reads the piece back from the cache (538 MB, one thread: 0.048 s at
#: 256 KiB-1 MiB pieces, 0.053 s at 4 MiB).
CHUNK_BYTES = 1 << 20
#: With the non-finite test, each piece is summed (copied) and tested in sub-pieces of this many
#: bytes, so that the test reads them from the cache (2-core machine, 128 MiB of bfloat16: sum +
#: test 0.071 s in 256 KiB steps, 0.145 s in 1 MiB steps, sum alone 0.059-0.066 s).
TEST_BYTES = 1 << 18
#: Below this many bytes in one call, everything runs on the calling thread.
PARALLEL_MIN_BYTES = 8 << 20

_pool: cf.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def host_threads() -> int:
    """Threads for host copies and checksums: ``$RLSERVE_HOST_THREADS`` if set, else a quarter of
    the cores this process may run on, at most 4, at least 1. The rest stay free for gloo's own
    threads and the peer process, and memory bandwidth saturates at a few threads. A 2-core
    machine therefore gets 1 thread, so nothing is handed off there."""
    if envs.RLSERVE_HOST_THREADS is not None:
        return envs.RLSERVE_HOST_THREADS
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores // 4))


def _executor(n: int) -> cf.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = cf.ThreadPoolExecutor(max_workers=n, thread_name_prefix="rlserve-host-copy")
        return _pool


def _u8(t: torch.Tensor) -> np.ndarray:
    """The numpy uint8 view of a contiguous CPU tensor's bytes (no copy)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _ranges(n: int) -> list[tuple[int, int]]:
    """``[a, b)`` pieces of ``n`` bytes, each at most CHUNK_BYTES, starting at multiples of 8."""
    return [(a, min(n, a + CHUNK_BYTES)) for a in range(0, n, CHUNK_BYTES)]


def _run(tasks: list[tuple], total_bytes: int) -> list:
    """Run ``tasks`` -- ``(zero-argument function, bytes it touches)`` -- and return their results
    in order: on the pool, in contiguous groups of about equal bytes (one per thread, the
    calling thread takes the first), or all here when the work is small or one thread is
    configured."""
    n = host_threads()
    if n == 1 or total_bytes < PARALLEL_MIN_BYTES or len(tasks) < 2:
        return [f() for f, _ in tasks]
    groups, cur, acc, share = [], [], 0, total_bytes / n
    for f, nb in tasks:
        cur.append(f)
        acc += nb
        if acc >= share * (len(groups) + 1) and len(groups) < n - 1:
            groups.append(cur)
            cur = []
    groups.append(cur)
    futs = [_executor(n).submit(lambda g=g: [f() for f in g]) for g in groups[1:]]
    out = [f() for f in groups[0]]
    for fut in futs:
        out.extend(fut.result())
    return out


def host_copyable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether :func:`host_copy_many` can copy ``src`` into ``dst``: both on the CPU, contiguous, the same dtype and
    number of elements (a plain byte copy)."""
    return (dst.device.type == "cpu" and src.device.type == "cpu" and dst.dtype == src.dtype
            and dst.numel() == src.numel() and dst.is_contiguous() and src.is_contiguous())


def host_copy_many(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], s64sums: bool = False) -> list[int] | None:
    """``dst.copy_(src)`` for every ``(dst, src)`` of ``pairs``, as numpy byte copies split over
    :func:`host_threads` threads.

    Args:
        pairs: CPU tensors for which :func:`host_copyable` holds (any shapes).
        s64sums: also return each pair's ``s64sum`` of the copied bytes. Each piece is summed
            right after its copy, while it is still in the cache: 538 MB cost 0.048 s this way
            against 0.056 s for a copy and then a separate sum (2-core machine, one thread).
            Summed with wrap-around over 8-byte-aligned destinations with zero padding between
            them, they give the ``s64sum`` of the buffer they fill.
    Returns:
        One checksum per pair (ints in the int64 range) with ``s64sums``, else ``None``.
    Raises:
        ValueError: :func:`host_copyable` does not hold for a pair (nothing was copied).
    """
    return host_copy_scan(pairs, s64sums)[0]


def host_copy_scan(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], s64sums: bool = False,
                   finite: bool = False) -> tuple[list[int] | None, list[bool] | None]:
    """:func:`host_copy_many`, and with ``finite`` the non-finite test of each pair's elements
    (:func:`rlserve.transfer.finite.np_nonfinite` on each piece right after its copy, from the
    cache). Returns ``(checksums or None, per pair "holds NaN / inf" or None)``; raises what
    :func:`host_copy_many` raises."""
    views = []
    for dst, src in pairs:
        if not host_copyable(dst, src):
            raise ValueError(f"host copy: needs contiguous CPU tensors of one dtype and size, got {dst.dtype} "
                             f"{tuple(dst.shape)} {dst.device} <- {src.dtype} {tuple(src.shape)} {src.device}")
        views.append((_u8(dst), _u8(src), src.dtype if finite else None))
    sums, bad = _per_array([s.size for _, s, _ in views],
                           lambda i, a, b: _copy_piece(views[i][0][a:b], views[i][1][a:b], s64sums, views[i][2]))
    return (sums if s64sums else None), (bad if finite else None)


def _per_array(sizes: list[int], piece) -> tuple[list[int], list[bool]]:
    """Run ``piece(i, a, b) -> (sum, bad)`` over the :func:`_ranges` of each array ``i`` of
    ``sizes`` bytes (on the pool, :func:`_run`) and return, per array, the wrapped sum of its
    pieces' sums and whether any piece was bad."""
    tasks, owner = [], []
    for i, n in enumerate(sizes):
        for a, b in _ranges(n):
            tasks.append((lambda i=i, a=a, b=b: piece(i, a, b), b - a))
            owner.append(i)
    totals = [0] * len(sizes)
    bad = [False] * len(sizes)
    for i, (v, nf) in zip(owner, _run(tasks, sum(sizes))):
        totals[i] += v
        bad[i] = bad[i] or nf
    return [wrap64(v) for v in totals], bad


def _copy_piece(d: np.ndarray, s: np.ndarray, s64sum: bool, finite_dtype=None) -> tuple[int, bool]:
    """Copy ``s`` into ``d``; with ``s64sum`` return the piece's checksum (a piece starts at a
    multiple of 8 bytes of its tensor; only a tensor's last piece has a zero-padded tail), with
    ``finite_dtype`` whether the copied ``finite_dtype`` elements hold a non-finite value (in
    :data:`TEST_BYTES` steps: copy, sum, test while in the cache)."""
    if not checked(finite_dtype):
        np.copyto(d, s)
        return (_s64sum_piece(d) if s64sum else 0), False
    total, bad = 0, False
    for a in range(0, d.size, TEST_BYTES):
        dd = d[a: a + TEST_BYTES]
        np.copyto(dd, s[a: a + TEST_BYTES])
        total += _s64sum_piece(dd) if s64sum else 0
        bad = bad or np_nonfinite(dd, finite_dtype)
    return total, bad


def _s64sum_piece(a: np.ndarray) -> int:
    """Unwrapped int64-word sum of ``a``, its last ``len % 8`` bytes as one zero-padded word."""
    n8 = a.size - a.size % 8
    total = _sum_words(a[:n8]) if n8 else 0
    if a.size != n8:
        tail = np.zeros(8, dtype=np.uint8)
        tail[: a.size - n8] = a[n8:]
        total += int(tail.view("<i8")[0])
    return total


def wrap64(v: int) -> int:
    """Python int -> the int64 range, wrapping (two's complement)."""
    return ((v + (1 << 63)) % (1 << 64)) - (1 << 63)


def _sum_words(a: np.ndarray) -> int:
    """Wrapping int64 sum of ``a`` (uint8, length a multiple of 8) read as little-endian int64."""
    if a.ctypes.data % 8:
        a = a.copy()  # an int64 view needs an 8-byte-aligned start
    return int(np.add.reduce(a.view("<i8"), dtype=np.int64))


def host_s64sums(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The ``s64sum`` checksum (:mod:`rlserve.transfer.wire.packing`) of each contiguous CPU tensor's
    bytes, split over :func:`host_threads` threads. The bytes are read as little-endian int64
    words and summed with wrap-around. The last ``n % 8`` bytes form one zero-padded word.
    Returns ints in the int64 range, the same values as the torch path gives."""
    arrays = [_u8(t if t.is_contiguous() else t.contiguous()) for t in tensors]
    return _per_array([a.size for a in arrays], lambda i, a, b: (_s64sum_piece(arrays[i][a:b]), False))[0]


def host_scan_spans(u8: torch.Tensor, spans: Sequence[tuple[int, int, torch.dtype | None]],
                    s64sum: bool = True) -> tuple[int | None, list[bool]]:
    """One pass over a CPU byte buffer (a packed bucket): its ``s64sum`` and, per span, the
    non-finite test of the elements it holds.

    Args:
        u8: contiguous 1-D uint8 CPU tensor.
        spans: ``(offset, nbytes, dtype)`` per tensor in ``u8`` (bytes; any offsets, in
            increasing order, not overlapping); a dtype :func:`~rlserve.transfer.finite.checked`
            rejects is not tested.
        s64sum: also sum the whole buffer.
    Returns:
        ``(checksum of u8 or None, per span "holds NaN / inf")``. Each 1 MiB piece is summed and
        the spans' elements that start in it are tested right after, from the cache.
    """
    a = _u8(u8)
    tested = [(k, off, nb, dt) for k, (off, nb, dt) in enumerate(spans) if nb and checked(dt)]

    ends = [off + nb for _, off, nb, _ in tested]

    def piece(lo: int, hi: int) -> tuple[int, list[int]]:
        total, bad = 0, []
        for sub in range(lo, hi, TEST_BYTES):  # sum, then test from the cache
            top = min(hi, sub + TEST_BYTES)
            total += _s64sum_piece(a[sub:top]) if s64sum else 0
            j = bisect.bisect_right(ends, sub)  # the first span ending after sub
            while j < len(tested) and tested[j][1] < top:
                k, off, nb, dt = tested[j]
                size = dt.itemsize
                start = off + max(0, -(-(sub - off) // size) * size)  # first element starting here
                end = min(off + nb, off + -(-(top - off) // size) * size)  # through the last one starting here
                if start < end and np_nonfinite(a[start:end], dt):
                    bad.append(k)
                j += 1
        return total, bad

    out = _run([(lambda lo=lo, hi=hi: piece(lo, hi), hi - lo) for lo, hi in _ranges(a.size)], a.size)
    flags = [False] * len(spans)
    for _, bad in out:
        for k in bad:
            flags[k] = True
    return (wrap64(sum(t for t, _ in out)) if s64sum else None), flags


def host_s64sum(u8: torch.Tensor) -> int:
    """:func:`host_s64sums` of one tensor."""
    return host_s64sums([u8])[0]
