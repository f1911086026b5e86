"""Host copies and checksums of the data planes (rlserve.transfer.host_ops): the same bytes and
the same s64sum as the torch path, on one thread and split over several."""

import pytest
import torch

from rlserve.transfer import host_ops
from rlserve.transfer.host_ops import host_copy_many, host_copyable, host_s64sum, host_s64sums


def _torch_s64sum(u8: torch.Tensor) -> int:
    """Reference: int64 words summed by torch (wrap-around), the tail zero-padded."""
    n8 = u8.numel() - u8.numel() % 8
    total = int(u8[:n8].clone().view(torch.int64).sum()) if n8 else 0
    if u8.numel() != n8:
        tail = torch.zeros(8, dtype=torch.uint8)
        tail[: u8.numel() - n8] = u8[n8:]
        total += int(tail.view(torch.int64)[0])
    return ((total + (1 << 63)) % (1 << 64)) - (1 << 63)


@pytest.fixture(params=[1, 3], ids=["one-thread", "three-threads"])
def threads(request, monkeypatch):
    """Run with 1 and with 3 host threads; the split starts at 64 KiB so small tensors use it."""
    monkeypatch.setenv("RLSERVE_HOST_THREADS", str(request.param))
    monkeypatch.setattr(host_ops, "PARALLEL_MIN_BYTES", 64 << 10)
    monkeypatch.setattr(host_ops, "CHUNK_BYTES", 24 << 10)
    return request.param


def test_s64sums_equal_torch(threads):
    g = torch.Generator().manual_seed(0)
    big = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=g)
    cases = [big, big[3:], big[5: 5 + 100_003], big[:7], big[:0], big[8:8 + 64],
             torch.randn(1000, 37, generator=g).view(torch.uint8).reshape(-1)]
    got = host_s64sums(cases)
    assert got == [_torch_s64sum(c) for c in cases]
    assert host_s64sum(big) == got[0]
    assert all(-(1 << 63) <= v < (1 << 63) for v in got)
    assert host_s64sum(big) != host_s64sum(torch.cat([big[:-1], (big[-1:] + 1)]))  # one byte changed


def test_copy_many_equals_copy(threads):
    g = torch.Generator().manual_seed(1)
    srcs = [torch.randn(300, 257, generator=g), torch.randn(5, generator=g),
            torch.randint(0, 100, (70_001,), dtype=torch.int32, generator=g), torch.randn(0)]
    dsts = [torch.empty_like(s) for s in srcs]
    flat = torch.zeros(2 * 300 * 257)
    pairs = list(zip(dsts, srcs)) + [(flat[300 * 257:].view(300, 257), srcs[0])]  # a view inside a buffer
    host_copy_many(pairs)
    for d, s in zip(dsts, srcs):
        assert torch.equal(d, s)
    assert torch.equal(flat[300 * 257:].view(300, 257), srcs[0]) and not flat[: 300 * 257].any()


def test_copy_many_refuses_what_it_cannot_copy():
    a = torch.zeros(4, 4)
    assert not host_copyable(a.t(), torch.zeros(4, 4))  # not contiguous
    assert not host_copyable(a, torch.zeros(4, 4, dtype=torch.float64))  # dtype cast
    assert not host_copyable(a, torch.zeros(15))  # size
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        host_copy_many([(a.view(16), torch.ones(16)), (a.t(), torch.ones(4, 4))])
    assert not a.any()  # checked before anything was copied


def test_host_threads_default_leaves_small_machines_single_threaded(monkeypatch):
    monkeypatch.delenv("RLSERVE_HOST_THREADS", raising=False)
    monkeypatch.setattr(host_ops.os, "sched_getaffinity", lambda _pid: set(range(2)))
    assert host_ops.host_threads() == 1
    monkeypatch.setattr(host_ops.os, "sched_getaffinity", lambda _pid: set(range(16)))
    assert host_ops.host_threads() == 4
    monkeypatch.setattr(host_ops.os, "sched_getaffinity", lambda _pid: set(range(64)))
    assert host_ops.host_threads() == 4


def test_fused_copy_checksum_equals_packed_bucket_checksum(threads):
    """pack_checksummed's sum (each piece summed after its copy, odd sizes zero-padded) equals
    the checksum of the packed bucket."""
    from rlserve.transfer.wire.packing import checksum, max_bucket_bytes, pack, pack_checksummed, plan_buckets

    g = torch.Generator().manual_seed(2)
    tensors = [torch.randn(300, 101, generator=g), torch.randn(7, generator=g).to(torch.bfloat16),
               torch.randint(-5, 5, (33_333,), dtype=torch.int32, generator=g).to(torch.int8),
               torch.randn(64, 64, generator=g)]
    plan = plan_buckets([f"t{i}" for i in range(len(tensors))], [t.dtype for t in tensors],
                        [list(t.shape) for t in tensors], 1 << 30)
    assert len(plan) == 1
    buf = torch.full((max_bucket_bytes(plan),), 7, dtype=torch.uint8)  # stale bytes: padding gets zeroed
    packed, got = pack_checksummed(buf, plan[0], tensors)
    assert isinstance(got, int) and got == checksum(packed)
    again = pack(torch.empty_like(buf), plan[0], tensors)
    assert torch.equal(again, packed)
