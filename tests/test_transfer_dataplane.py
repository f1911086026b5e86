"""Weight-transfer data plane on CPU (gloo), no engine: bucket plan, checksum, packed /
unpacked broadcast, failure detection, teardown and re-init."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from rlserve.errors import WeightUpdateError
from rlserve.server.launch import bound_socket, parent_death_signal, reserved_port
from rlserve.transfer.errors import ChecksumMismatchError, NonFiniteWeightsError, WeightTransferFailedError
from rlserve.transfer.backends.group import TransferGroup, bind_master_store
from rlserve.transfer.wire.packing import (
    ALIGN,
    BucketBuffers,
    as_bytes,
    bucket_checksums_from_tensors,
    checksum,
    pack,
    plan_buckets,
    tensor_checksum,
    unpack,
)
from rlserve.transfer.wire.protocol import InitInfo, UpdateInfo, dtype_to_name
from rlserve.transfer.server.receiver import WeightReceiver
from rlserve.transfer.wire.header import check_transport_fields
from rlserve.transfer.sdk.sender import send_packed, send_unpacked


def make_tensors(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("a.weight", torch.randn(33, 17, generator=g)),
        ("b.weight", torch.randn(7, 5, generator=g).to(torch.bfloat16)),  # 70 bytes: not a multiple of 4
        ("c.bias", torch.randn(3, generator=g).to(torch.float16)),  # 6 bytes
        ("empty", torch.empty(0, 4)),
        ("scalar", torch.tensor(3.5)),
        ("d.weight", torch.randn(64, 48, generator=g)),
        ("e.weight", torch.randn(129, generator=g).double()),
    ]


def info_for(tensors, packed=True, size=4096, nbuf=2, checksums=True) -> UpdateInfo:
    info = UpdateInfo(names=[n for n, _ in tensors], dtype_names=[dtype_to_name(t.dtype) for _, t in tensors],
                      shapes=[list(t.shape) for _, t in tensors], packed=packed,
                      packed_buffer_size_bytes=size, packed_num_buffers=nbuf)
    info.validate()
    if checksums:
        per = [tensor_checksum(t) for _, t in tensors]
        if packed:
            info.checksums = bucket_checksums_from_tensors(
                plan_buckets(info.names, info.dtypes(), info.shapes, size), per)
        else:
            info.checksums = per
    return info


# --------------------------------------------------------------------------- pure functions
def test_plan_exceed_rule_and_determinism():
    names = ["t0", "t1", "t2", "t3"]
    dtypes = [torch.uint8] * 4
    shapes = [[400], [400], [400], [3000]]
    plan = plan_buckets(names, dtypes, shapes, 1000)
    # t0 -> 512 (<= 1000, stays open); t1 at 512 ends 912 -> 1024 > 1000: closes WITH t1 in it
    assert [[s.name for s in b.slots] for b in plan] == [["t0", "t1"], ["t2", "t3"]]
    assert [s.offset for s in plan[0].slots] == [0, 512]
    assert plan[0].nbytes == 1024
    # t2 at 0 -> 512; t3 at 512, 3000 bytes -> 3584: bigger than the nominal size, one bucket
    assert plan[1].nbytes == 3584
    # exactly at the size does not close: <= size stays open
    plan2 = plan_buckets(["x", "y"], [torch.uint8] * 2, [[ALIGN], [1]], ALIGN)
    assert [[s.name for s in b.slots] for b in plan2] == [["x", "y"]]
    # same metadata -> same plan (both sides compute it independently)
    assert plan_buckets(names, dtypes, shapes, 1000) == plan
    assert all(s.offset % ALIGN == 0 for b in plan for s in b.slots)


def test_checksum_additive_and_sensitive():
    ts = make_tensors()
    info = info_for(ts, size=1 << 20)
    plan = plan_buckets(info.names, info.dtypes(), info.shapes, 1 << 20)
    assert len(plan) == 1
    buf = torch.full((plan[0].nbytes,), 0xAB, dtype=torch.uint8)  # garbage padding gets zeroed
    packed = pack(buf, plan[0], [t for _, t in ts])
    assert checksum(packed) == info.checksums[0]
    for (n, v), (n2, t) in zip(unpack(packed, plan[0]), ts):
        assert n == n2 and v.dtype == t.dtype and torch.equal(v, t)
    packed[5] ^= 1
    assert checksum(packed) != info.checksums[0]
    # int64 wrap-around is exact and order independent
    big = torch.full((1 << 12,), -1, dtype=torch.int64).view(torch.uint8)
    assert checksum(big) == -(1 << 12)


def test_update_info_validation():
    with pytest.raises(WeightUpdateError, match="same length"):
        UpdateInfo.from_dict({"names": ["a"], "dtype_names": [], "shapes": [[1]]})
    with pytest.raises(WeightUpdateError, match="unknown dtype"):
        UpdateInfo.from_dict({"names": ["a"], "dtype_names": ["complex64"], "shapes": [[1]]})
    with pytest.raises(WeightUpdateError, match="unknown field"):
        UpdateInfo.from_dict({"names": [], "dtype_names": [], "shapes": [], "pickled": True})
    with pytest.raises(WeightUpdateError, match="twice"):
        UpdateInfo.from_dict({"names": ["a", "a"], "dtype_names": ["float32"] * 2, "shapes": [[1], [1]]})
    u = UpdateInfo.from_dict({"names": ["a"], "dtype_names": ["torch.bfloat16"], "shapes": [[2, 3]],
                              "is_checkpoint_format": True})
    assert u.dtypes() == [torch.bfloat16]
    r = u.resolved(InitInfo(master_port=1))
    assert r.packed is True and r.packed_num_buffers == 2 and r.packed_buffer_size_bytes == 1 << 30
    r.checksums = [1, 2]
    with pytest.raises(WeightUpdateError, match="checksums has 2"):
        check_transport_fields(r, "gloo")
    with pytest.raises(WeightUpdateError, match="master_port"):
        InitInfo.from_dict({"backend": "gloo"})
    with pytest.raises(WeightUpdateError, match="backend"):
        InitInfo.from_dict({"backend": "mpi", "master_port": 5})


# --------------------------------------------------------------------------- two ranks (threads)
def run_pair(sender_fn, receiver_fn, timeout_s=20.0, port=0):
    """Trainer (rank 0, hosts the store) and one receiver (rank 1), each on a thread. ``port`` 0:
    the store listens on a port the kernel picked before the receiver is told (``bind_master_store``,
    as the SDK does); else that port."""
    results, errors = {}, {}
    store = bind_master_store("127.0.0.1", timeout_s) if not port else None
    port = port or store.port

    def trainer():
        try:
            g = TransferGroup.create("gloo", "127.0.0.1", port, 0, 2, timeout_s, store=store)
            try:
                results["trainer"] = sender_fn(g)
            finally:
                g.destroy(wait_s=5)
        except BaseException as e:  # noqa: BLE001
            errors["trainer"] = e

    def receiver():
        try:
            init = InitInfo(backend="gloo", master_port=port, world_size=2, timeout_s=timeout_s)
            r = WeightReceiver(init, 1, torch.device("cpu"))
            r.connect()
            try:
                results["receiver"] = receiver_fn(r)
            finally:
                r.close()
        except BaseException as e:  # noqa: BLE001
            errors["receiver"] = e

    ts = [threading.Thread(target=trainer), threading.Thread(target=receiver)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout_s * 3)
    assert not any(t.is_alive() for t in ts), "a side hung"
    return results, errors


@pytest.mark.parametrize("packed,size,nbuf", [(True, 4096, 2), (True, 1 << 20, 1), (True, 300, 3), (False, 0, 2)])
def test_broadcast_bit_identical(packed, size, nbuf):
    ts = make_tensors(1)
    info = info_for(ts, packed=packed, size=size or 1 << 20, nbuf=nbuf)
    got: dict[str, torch.Tensor] = {}
    calls = []

    def sink(pairs):
        calls.append([n for n, _ in pairs])
        for n, t in pairs:
            got[n] = t.clone()

    send = send_packed if packed else send_unpacked
    res, err = run_pair(lambda g: send(g, info, iter(ts), torch.device("cpu")),
                        lambda r: r.receive(info, sink))
    assert not err, err
    assert list(got) == [n for n, _ in ts]
    for n, t in ts:
        assert got[n].dtype == t.dtype and got[n].shape == t.shape
        assert torch.equal(as_bytes(got[n]), as_bytes(t)), n  # bit-identical
    if packed:
        plan = plan_buckets(info.names, info.dtypes(), info.shapes, info.packed_buffer_size_bytes)
        assert calls == [[s.name for s in b.slots] for b in plan]
        assert res["trainer"]["bytes"] == res["receiver"]["bytes"] == sum(b.nbytes for b in plan)
    else:
        assert calls == [[n] for n, _ in ts]


def test_checksum_mismatch_detected_before_sink():
    ts = make_tensors(2)
    info = info_for(ts, size=600)  # several buckets
    n_buckets = len(info.checksums)
    assert n_buckets >= 3
    bad = UpdateInfo(**{**info.__dict__, "checksums": list(info.checksums)})
    bad.checksums[1] += 1  # the receiver expects another sum for bucket 1
    seen = []
    res, err = run_pair(lambda g: send_packed(g, info, iter(ts), torch.device("cpu")),
                        lambda r: r.receive(bad, lambda pairs: seen.extend(n for n, _ in pairs)), timeout_s=2)
    assert isinstance(err.get("receiver"), ChecksumMismatchError), err
    assert "bucket 2/" in str(err["receiver"])
    plan = plan_buckets(info.names, info.dtypes(), info.shapes, 600)
    assert seen == [s.name for s in plan[0].slots]  # bucket 0 went through, bucket 1 never reached the sink


def test_source_must_match_announced_metadata():
    ts = make_tensors(3)
    info = info_for(ts)
    wrong = [(n, t) for n, t in ts]
    wrong[0] = ("a.weight", torch.randn(2, 2))
    res, err = run_pair(lambda g: send_packed(g, info, iter(wrong), torch.device("cpu")),
                        lambda r: r.receive(info, lambda p: None), timeout_s=3)
    assert isinstance(err.get("trainer"), ValueError)
    assert isinstance(err.get("receiver"), WeightTransferFailedError)  # peer left / timed out: no hang


def test_send_buffers_reused_across_updates():
    """The trainer's packed send buffers are kept between updates (fresh host pages fault on
    first write) and a second update through them still arrives bit-identical."""
    ts = make_tensors(6)
    info = info_for(ts, size=600)
    bufs = BucketBuffers()
    ptrs = []

    def send(g):
        out = []
        for _ in range(2):
            out.append(send_packed(g, info, iter(ts), torch.device("cpu"), buffers=bufs))
            ptrs.append([b.data_ptr() for b in bufs.get(2, 1, torch.device("cpu"))])
        return out

    got = []

    def recv(r):
        for _ in range(2):
            d = {}
            r.receive(info, lambda p: d.update({n: t.clone() for n, t in p}))
            got.append(d)

    res, err = run_pair(send, recv)
    assert not err, err
    assert ptrs[0] == ptrs[1] and len(ptrs[0]) == 2
    for d in got:
        for n, t in ts:
            assert torch.equal(as_bytes(d[n]), as_bytes(t)), n
    bufs.release()
    assert bufs.get(2, 1, torch.device("cpu"))[0].numel() == 1  # released: a fresh, smaller buffer


@pytest.mark.parametrize("after", [False, True])
def test_tensors_laid_out_like_the_buckets_are_sent_unpacked(after):
    """Views into one flat tensor, each a multiple of 256 bytes and back to back, are what the
    buckets would hold: every bucket goes out of that memory (no send buffer is allocated) and
    arrives bit-identical, its checksum (announced or sent after the data) matching."""
    flat = torch.randn(64 * 10)
    ts = [(f"w{i}", flat[64 * i: 64 * (i + 1)].view(8, 8)) for i in range(10)]  # 256 bytes each
    info = info_for(ts, size=600)  # 3 tensors (768 bytes) per bucket
    if after:
        info.checksums, info.checksums_after_data = None, True
    bufs = BucketBuffers()
    got = {}
    res, err = run_pair(lambda g: send_packed(g, info, iter(ts), torch.device("cpu"), buffers=bufs),
                        lambda r: r.receive(info, lambda p: got.update({n: t.clone() for n, t in p})))
    assert not err, err
    assert bufs._bufs == []
    for n, t in ts:
        assert torch.equal(got[n], t), n


def test_reinit_after_teardown_same_port():
    """Rank 0 hosts its store on the port its last group used (freed by the teardown; reserved
    by this test meanwhile, so no other process takes it in between)."""
    ts = make_tensors(4)
    info = info_for(ts)
    with reserved_port() as port:
        for _ in range(2):
            got = {}
            res, err = run_pair(lambda g: send_packed(g, info, iter(ts), torch.device("cpu")),
                                lambda r: r.receive(info, lambda p: got.update({n: t.clone() for n, t in p})),
                                port=port)
            assert not err, err
            assert torch.equal(got["d.weight"], ts[5][1])


def test_rendezvous_timeout_when_trainer_never_comes():
    held = bound_socket()  # the port stays taken and refuses connections: no trainer, by construction
    try:
        init = InitInfo(backend="gloo", master_port=held.getsockname()[1], world_size=2, timeout_s=1.5)
        r = WeightReceiver(init, 1, torch.device("cpu"))
        t0 = time.monotonic()
        with pytest.raises(WeightTransferFailedError):
            r.connect()
        assert time.monotonic() - t0 < 10
    finally:
        held.close()


# --------------------------------------------------------------------------- SIGKILL mid-update
TRAINER_SCRIPT = textwrap.dedent("""
    import os, signal, sys, torch
    sys.path.insert(0, {root!r})
    from rlserve.transfer.backends.group import TransferGroup, bind_master_store
    from rlserve.transfer.wire.packing import plan_buckets, max_bucket_bytes, pack
    from rlserve.transfer.sdk.sender import send_header
    from tests.test_transfer_dataplane import make_tensors, info_for
    ts = make_tensors(5)
    info = info_for(ts, size=600)
    plan = plan_buckets(info.names, info.dtypes(), info.shapes, 600)
    store = bind_master_store("127.0.0.1", 30.0)
    print("PORT", store.port, flush=True)
    g = TransferGroup.create("gloo", "127.0.0.1", store.port, 0, 2, 30.0, store=store)
    buf = torch.empty(max_bucket_bytes(plan), dtype=torch.uint8)
    by_name = dict(ts)
    b = plan[0]
    header, header_work = send_header(g, info, torch.device("cpu"), plan)
    g.wait(g.broadcast(pack(buf, b, [by_name[s.name] for s in b.slots]), 0))
    g.wait(header_work)
    print("SENT-FIRST", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_trainer_sigkill_mid_update_receiver_does_not_hang():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", TRAINER_SCRIPT.format(root=root)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=root,
                            preexec_fn=parent_death_signal())
    try:
        # its store listens before it says where (bind_master_store); bounded: a hang, not a speed
        assert select.select([proc.stdout], [], [], 300)[0], "the trainer never said its port"
        line = proc.stdout.readline()
        assert line.startswith("PORT "), (line, proc.stderr.read() if proc.poll() is not None else "")
        port = int(line.split()[1])
        ts = make_tensors(5)
        info = info_for(ts, size=600)
        init = InitInfo(backend="gloo", master_port=port, world_size=2, timeout_s=30.0)
        r = WeightReceiver(init, 1, torch.device("cpu"))
        r.connect()
        loaded = []
        t0 = time.monotonic()
        with pytest.raises(WeightTransferFailedError):
            r.receive(info, lambda pairs: loaded.extend(n for n, _ in pairs))
        elapsed = time.monotonic() - t0
        assert elapsed < 15, f"receiver took {elapsed:.1f}s to notice a dead trainer"
        plan = plan_buckets(info.names, info.dtypes(), info.shapes, 600)
        assert loaded == [s.name for s in plan[0].slots]
        r.close()
    finally:
        proc.kill()
        out, errs = proc.communicate(timeout=10)
    assert "SENT-FIRST" in out, errs[-2000:]


def test_ipc_handle_validation_without_cuda():
    """Malformed IPC handles are refused before any CUDA call (the payload can name no code)."""
    from rlserve.transfer.wire.ipc import import_handle

    with pytest.raises(WeightUpdateError, match="missing"):
        import_handle({})
    base = {"tensor_cls": "Tensor", "size": [4], "stride": [1], "tensor_offset": 0, "storage_cls": "TypedStorage",
            "dtype": "uint8", "device": 0, "device_uuid": "GPU-nope", "handle": "AAAA", "storage_size_bytes": 4,
            "storage_offset_bytes": 0, "requires_grad": False, "ref_counter_handle": "AAAA",
            "ref_counter_offset": 0, "event_handle": None, "event_sync_required": False}
    with pytest.raises(WeightUpdateError, match="unknown tensor or storage class"):
        import_handle({**base, "tensor_cls": "os.system"})
    with pytest.raises(WeightUpdateError, match="non-negative"):
        import_handle({**base, "tensor_offset": -1})
    with pytest.raises(WeightUpdateError, match="not visible"):
        import_handle(base)


def test_deferred_checksums_compared_once_at_the_end():
    """GPU receivers queue each bucket's sum on the stream, and with checksums_after_data every
    receiver keeps each bucket's sum; all are compared at the end (one host sync for the queued
    ones); the comparison itself is device-agnostic and names the bucket."""
    from rlserve.transfer.wire.packing import checksum, checksum_tensor

    good = torch.arange(64, dtype=torch.uint8)
    bad = good.clone()
    bad[3] ^= 1
    expected = [checksum(good), checksum(good)]
    ok = [(checksum_tensor(good), 0, "bucket 1/2", 64, []), (checksum(good), 1, "bucket 2/2", 64, [])]  # queued / host
    WeightReceiver._check_deferred(ok, expected)  # no error
    WeightReceiver._check_deferred([], expected)
    WeightReceiver._check_deferred(ok, None)  # nothing announced: nothing to compare
    wrong = [ok[0], (checksum_tensor(bad), 1, "bucket 2/2", 64, [])]
    with pytest.raises(ChecksumMismatchError, match="bucket 2/2.*!= announced.*not committed"):
        WeightReceiver._check_deferred(wrong, expected)
    with pytest.raises(ChecksumMismatchError, match="bucket 1/2.*sent after the data"):
        WeightReceiver._check_deferred([(checksum(bad), 0, "bucket 1/2", 64, [])], expected, after_data=True)
    # the non-finite tensors the pass found (names, or device flags + names) fail after the sums
    nan = [ok[0], (checksum(good), 1, "bucket 2/2", 64, (torch.tensor([0, 1]), ["a", "b.weight"]))]
    with pytest.raises(NonFiniteWeightsError, match="'b.weight' \\(bucket 2/2\\).*refused"):
        WeightReceiver._check_deferred(nan, None)
    with pytest.raises(ChecksumMismatchError):  # a corrupt bucket is named as such first
        WeightReceiver._check_deferred([wrong[1][:4] + (["b.weight"],)], expected)


def test_ipc_ref_fields_validated():
    """ipc_handles_ref and the one-call fields: a well-formed ref, the checksum tensor / event
    only with handles and a ref, device_checksums only with a ref and no host list; a call with
    a ref and no names is "by ref"; a ref the server does not hold, a ref on a packed update or
    on another backend are refused (400)."""
    base = {"names": ["a"], "dtype_names": ["float32"], "shapes": [[2]], "packed": False}
    with pytest.raises(WeightUpdateError, match="ipc_handles_ref must be"):
        UpdateInfo.from_dict({**base, "ipc_handles_ref": "no spaces allowed"})
    with pytest.raises(WeightUpdateError, match="come with ipc_handles"):
        UpdateInfo.from_dict({**base, "ipc_handles_ref": "r1", "ipc_event_handle": "AAAA"})
    with pytest.raises(WeightUpdateError, match="device_checksums needs"):
        UpdateInfo.from_dict({**base, "device_checksums": True})
    with pytest.raises(WeightUpdateError, match="device_checksums needs"):
        UpdateInfo.from_dict({**base, "ipc_handles_ref": "r1", "device_checksums": True, "checksums": [1]})
    by_ref = UpdateInfo.from_dict({"names": [], "dtype_names": [], "shapes": [], "packed": False,
                                   "ipc_handles_ref": "r1", "device_checksums": True})
    assert by_ref.by_ref and not UpdateInfo.from_dict({**base, "ipc_handles_ref": "r1"}).by_ref
    named = UpdateInfo.from_dict({**base, "ipc_handles_ref": "r1"})
    check_transport_fields(named, "ipc", {"r1": {}})
    with pytest.raises(WeightUpdateError, match="unknown to this server"):
        check_transport_fields(named, "ipc", {})
    with pytest.raises(WeightUpdateError, match="per-tensor handles"):
        packed = UpdateInfo.from_dict({**base, "packed": True, "ipc_handles_ref": "r1"})
        check_transport_fields(packed.resolved(InitInfo(backend="ipc", master_port=1)), "ipc", {"r1": {}})
    with pytest.raises(WeightUpdateError, match="backend is 'gloo'"):
        check_transport_fields(named, "gloo")
    r = WeightReceiver(InitInfo(backend="ipc", master_port=1, world_size=2), 1, torch.device("cpu"))
    with pytest.raises(WeightUpdateError, match="unknown to this worker"):
        r.with_ref_metadata(by_ref)


def test_checksums_after_data_fields_validated():
    """checksums_after_data: a packed gloo / NCCL update without a checksums list; with a list,
    unpacked, or on ipc it is refused (400)."""
    base = {"names": ["a"], "dtype_names": ["float32"], "shapes": [[2]], "packed": True, "checksums_after_data": True}
    init = InitInfo(backend="gloo", master_port=1)
    ok = UpdateInfo.from_dict(base).resolved(init)
    check_transport_fields(ok, "gloo")
    check_transport_fields(ok, "nccl")
    with pytest.raises(WeightUpdateError, match="checksums_after_data is for packed updates"):
        UpdateInfo.from_dict({**base, "checksums": [1]})
    with pytest.raises(WeightUpdateError, match="checksums_after_data is for packed updates"):
        UpdateInfo.from_dict({**base, "packed": False})
    with pytest.raises(WeightUpdateError, match="must be true or false"):
        UpdateInfo.from_dict({**base, "checksums_after_data": "yes"})
    with pytest.raises(WeightUpdateError, match="needs a packed gloo / NCCL update"):
        check_transport_fields(UpdateInfo.from_dict({**base, "ipc_handles": [{}]}).resolved(init), "ipc")
    unpacked_by_default = UpdateInfo.from_dict({**base, "packed": None}).resolved(InitInfo(backend="gloo", master_port=1,
                                                                                          packed=False))
    with pytest.raises(WeightUpdateError, match="needs a packed gloo / NCCL update"):
        check_transport_fields(unpacked_by_default, "gloo")
