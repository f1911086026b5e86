"""Non-finite weights never go live (issue 33, finding 3): a sync whose tensor holds one NaN or
one +-inf is refused before commit with 400 ``non_finite_weights`` naming the tensor -- over
gloo (packed with the checksums after the data, the direct receive, unpacked with announced
checksums), TRL's routes and vLLM's wire, in bfloat16 / float16 / float32 / fp8 -- staged, the
old weights keep serving; in place, generation answers 503 until a complete good update. With
``--no-weight-check-finite`` the update commits (documented). All fail on the code before the
check (it committed every one of them)."""

from __future__ import annotations

import copy
import threading

import httpx
import pytest
import torch

from rlserve.transfer import ModuleSource, TensorListSource, WeightsRefusedNonFiniteError, hf_state_checksums
from rlserve.transfer.errors import NonFiniteWeightsError
from rlserve.transfer.sdk.trl import TRLWeightSyncClient
from tests.transfer_harness import InProcessServer, reserved_port
from tests.transfer_sync import (  # noqa: F401 (llama, llama384: fixtures)
    PROMPT_IDS,
    bumped,
    checksums,
    direct_trainer,
    hf_greedy,
    llama,
    llama384,
    server_greedy,
    trainer,
    version,
)

NAN, INF = float("nan"), float("inf")
#: in the last 64 KiB bucket of the tiny llama: the buckets before it were loaded in place
TARGET = "model.layers.1.mlp.down_proj.weight"


def poisoned(hf, value: float, dtype: torch.dtype | None = None, at: int = 7) -> TensorListSource:
    """``hf``'s tensors (cast to ``dtype`` when given), ``TARGET``'s element ``at`` set to ``value``."""
    out = []
    for n, t in ModuleSource(hf).named_tensors():
        t = t.detach().to(dtype or t.dtype, copy=True)  # never the model's own memory
        if n == TARGET:
            t.view(-1)[at: at + 1] = torch.tensor([value]).to(t.dtype)
        out.append((n, t))
    return TensorListSource(out)


def assert_refused(ei) -> None:
    e = ei.value
    assert isinstance(e, NonFiniteWeightsError)  # the SDK's class is also the server's
    assert e.status_code == 400 and e.code == "non_finite_weights", e
    assert repr(TARGET) in e.message and "not committed" in e.message, e.message


CASES = [("none", True, NAN, torch.float32), ("none", True, INF, torch.bfloat16),
         ("none", False, -INF, torch.float16), ("none", True, -INF, torch.float8_e5m2),
         ("device", True, -INF, torch.float32), ("device", True, NAN, torch.float8_e4m3fn),
         ("device", False, INF, torch.bfloat16), ("device", True, NAN, torch.float16)]


@pytest.mark.parametrize("staging,packed,value,dtype", CASES,
                         ids=[f"{s}-{'packed' if p else 'unpacked'}-{v}-{str(d)[6:]}" for s, p, v, d in CASES])
def test_nonfinite_sync_refused_naming_the_tensor(llama, shared, staging, packed, value, dtype):
    """packed: the SDK's default (checksums after the data; the in-place float32 case replays
    the recorded load, testing in the fused copy); unpacked: checksums announced per tensor."""
    path, hf = llama
    with shared(path, staging) as srv:
        eng = trainer(srv.url, hf, packed=packed)
        eng.send_weights()
        v, base = version(srv.url), checksums(srv.url)
        failures = httpx.get(srv.url + "/weight_info").json()["num_failures"]
        want = [hf_greedy(hf, p) for p in PROMPT_IDS]
        eng.source = poisoned(hf, value, dtype)
        with pytest.raises(WeightsRefusedNonFiniteError) as ei:
            eng.send_weights()
        assert_refused(ei)
        info = httpx.get(srv.url + "/weight_info").json()
        assert info["weight_version"] == v and info["num_failures"] == failures + 1
        assert not info["last_update"]["ok"] and "non-finite" in info["last_update"]["error"]
        # the class is named once (it was "NonFiniteWeightsError: update_weights failed on a
        # server worker: NonFiniteWeightsError: non-finite ...")
        assert info["last_update"]["error"].count("NonFiniteWeightsError") == 1, info["last_update"]
        assert "NonFiniteWeightsError" not in ei.value.message, ei.value.message  # the 400's code says it
        # the trainer reads what the refusal did to the served model (a new user read "not committed" as
        # "the old weights keep serving", which holds only for a staged update)
        if staging == "none":
            assert "503 model_unavailable until a full weight update lands" in ei.value.message, ei.value.message
        else:
            assert "the served weights are unchanged (staged update)" in ei.value.message, ei.value.message
        r = server_greedy(srv.url)
        if staging == "none":  # the buckets before TARGET's were loaded: never serve that mix
            assert r.status_code == 503 and repr(TARGET) in r.json()["error"]["message"], r.text
            assert r.json()["error"]["message"].count("NonFiniteWeightsError") == 1, r.text
            assert httpx.get(srv.url + "/health").status_code == 503
        else:  # the old weights serve, bit for bit
            assert r.status_code == 200 and r.json()["completion_ids"] == want
            assert r.json()["weight_version"] == v and checksums(srv.url) == base
        eng.source = ModuleSource(hf)  # a complete good update: served again
        assert eng.send_weights()["weight_version"] == bumped(v)
        r = server_greedy(srv.url)
        assert r.status_code == 200 and r.json()["completion_ids"] == want
        assert checksums(srv.url) == base


def test_nonfinite_direct_receive_in_place(llama384, shared):
    """A CPU server receiving packed updates straight into its parameters: the bucket holding
    the NaN was written, so 503 until the next full update (which is received directly again)."""
    path, hf = llama384
    with shared(path) as srv:
        eng = direct_trainer(srv.url, hf)
        v = version(srv.url)
        eng.source = poisoned(hf, NAN, at=0)
        with pytest.raises(WeightsRefusedNonFiniteError) as ei:
            eng.send_weights()
        assert_refused(ei)
        assert server_greedy(srv.url).status_code == 503
        eng.source = ModuleSource(hf)
        assert eng.send_weights()["weight_version"] == bumped(v, 2) or version(srv.url) == bumped(v)
        r = server_greedy(srv.url)
        assert r.status_code == 200 and r.json()["completion_ids"] == [hf_greedy(hf, p) for p in PROMPT_IDS]


def test_refused_push_then_new_group_logs_no_held_port(llama384, shared, caplog):
    """A refused NaN push breaks the group (the server tears it down), but every operation of
    it completed, so nothing holds the trainer's store port: the next ``send_weights`` joins a
    new group on the same port without the "still holds port" warning (session 18's demo
    logged "may still hold port" after every refused push). A port given (a ``master_port=0``
    trainer hosts each group on a new port and never checks): reserved by this test, so no other
    process takes it between the groups."""
    import logging

    path, hf = llama384
    with shared(path) as srv, reserved_port() as port:
        eng = trainer(srv.url, hf, master_port=port)
        eng.send_weights()
        assert eng.init_info.master_port == port
        eng.source = poisoned(hf, NAN)
        with pytest.raises(WeightsRefusedNonFiniteError):
            eng.send_weights()
        eng.source = ModuleSource(hf)
        with caplog.at_level(logging.INFO, logger="rlserve.transfer.sdk.engine"):
            eng.send_weights()
        assert not [r for r in caplog.records if "hold" in r.getMessage() and "port" in r.getMessage()], \
            [r.getMessage() for r in caplog.records]
        assert eng.init_info.master_port == port
        assert server_greedy(srv.url).status_code == 200
        eng.shutdown()


def test_port_in_use_sees_only_a_listening_socket():
    """``_port_in_use``: True while a socket listens on the port, False once it closed."""
    import socket

    from rlserve.transfer.sdk.init_info import _port_in_use

    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    assert _port_in_use(port) is True
    s.close()
    assert _port_in_use(port) is False


@pytest.mark.parametrize("staging", ["none", "device"])
def test_nonfinite_over_trls_routes(llama, shared, staging):
    """TRL's protocol (``/update_named_param/`` per tensor, committed at ``/reset_prefix_cache/``):
    the batch is refused naming the tensor; staged the old weights serve, in place 503; a good
    batch serves again."""
    path, hf = llama
    bad = copy.deepcopy(hf)
    with torch.no_grad():
        dict(bad.named_parameters())[TARGET].view(-1)[3] = -INF
    with shared(path, staging) as srv:
        c = TRLWeightSyncClient(srv.url, group_port=0, timeout_s=20)
        c.init_communicator()
        c.update_model_params(hf)
        c.reset_prefix_cache()
        v, base = version(srv.url), checksums(srv.url)
        with pytest.raises(WeightsRefusedNonFiniteError) as ei:
            c.update_model_params(bad)
            c.reset_prefix_cache()
        assert_refused(ei)
        assert version(srv.url) == v
        r = server_greedy(srv.url)
        if staging == "none":
            assert r.status_code == 503
        else:
            assert r.status_code == 200 and checksums(srv.url) == base
        c.close_communicator()
        c = TRLWeightSyncClient(srv.url, group_port=0, timeout_s=20)
        c.init_communicator()
        c.update_model_params(hf)
        c.reset_prefix_cache()
        r = server_greedy(srv.url)
        assert r.status_code == 200 and r.json()["completion_ids"] == [hf_greedy(hf, p) for p in PROMPT_IDS]
        c.close_communicator()


def test_check_off_commits_nonfinite_weights(llama):
    """``--no-weight-check-finite``: the update commits what arrived (the NaN is served: the
    server's sha256 of TARGET is that of the poisoned tensor); ``/server_info`` says so."""
    path, hf = llama
    with InProcessServer(path, check_finite=False) as srv:
        assert httpx.get(srv.url + "/server_info").json()["weight_check_finite"] is False
        eng = trainer(srv.url, hf)
        eng.send_weights()
        v = version(srv.url)
        src = poisoned(hf, NAN)
        eng.source = src
        assert eng.send_weights()["weight_version"] == bumped(v)
        assert checksums(srv.url)[TARGET] == hf_state_checksums(src.items, torch.float32)[TARGET]
        assert server_greedy(srv.url).status_code == 200
        eng.shutdown()


# ------------------------------------------------------------------ vLLM's wire (receiver level)
def _vllm_wire_tensors(value: float | None, fp8: bool = True):
    """Mixed dtypes, vLLM's back-to-back layout puts most of them at odd offsets; ``value`` goes
    into element 5 of ``t4`` (bfloat16) and NaN into ``t6`` (fp8 e4m3fn: NaN only; float16
    without ``fp8``: gloo, which carries the unpacked test, has no fp8 type)."""
    g = torch.Generator().manual_seed(0)
    f8 = torch.float8_e4m3fn if fp8 else torch.float16
    spec = [((10, 12), torch.bfloat16), ((7,), f8), ((40, 9), torch.float16), ((3, 5), torch.float32),
            ((301,), torch.bfloat16), ((1,), torch.float32), ((33,), f8), ((64, 4), torch.float32)]
    named = [(f"t{i}", torch.randn(s, generator=g).to(dt)) for i, (s, dt) in enumerate(spec)]
    if value is not None:
        for k, v in ((4, value), (6, NAN)):
            named[k][1].view(-1)[5:6] = torch.tensor([v]).to(named[k][1].dtype)
    return named


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("check", [True, False])
def test_vllm_wire_nonfinite(packed, check):
    """vLLM's wire (no checksums, no layout header; raw buckets or one tensor per broadcast),
    carried over gloo as in test_vllm_wire (vLLM's NCCL communicator needs CUDA): the bucket /
    tensor holding the NaN / inf is refused before the sink sees it, naming the tensor; with the
    check off every tensor arrives bit for bit."""
    from rlserve.transfer.backends.group import TransferGroup, bind_master_store
    from rlserve.transfer.backends.vllm_group import plan_vllm_buckets
    from rlserve.transfer.server.receiver import WeightReceiver
    from rlserve.transfer.wire.protocol import InitInfo, UpdateInfo, dtype_to_name

    store = bind_master_store("127.0.0.1", 60)  # rank 0's, listening before rank 1 is told
    port = store.port
    init = InitInfo(backend="gloo", master_port=port, world_size=2, timeout_s=60)
    init.wire = "vllm"
    named = _vllm_wire_tensors(INF, fp8=packed)
    info = UpdateInfo(names=[n for n, _ in named], dtype_names=[dtype_to_name(t.dtype) for _, t in named],
                      shapes=[list(t.shape) for _, t in named], packed=packed, packed_buffer_size_bytes=500,
                      packed_num_buffers=2)
    plan = plan_vllm_buckets(info.names, info.dtypes(), info.shapes, 500)

    def send():
        g = TransferGroup.create("gloo", "127.0.0.1", port, 0, 2, 60, store=store)
        msgs = [torch.cat([named[sl.index][1].reshape(-1).view(torch.uint8) for sl in b.slots]) for b in plan] \
            if packed else [t for _, t in named]
        for m in msgs:
            g.wait(g.broadcast(m, 0))
        g.destroy(wait_s=5)

    th = threading.Thread(target=send, daemon=True)
    th.start()
    rx = WeightReceiver(init, 1, torch.device("cpu"))
    rx.check_finite = check
    rx.group = TransferGroup.create("gloo", "127.0.0.1", port, 1, 2, 60)
    got: dict = {}
    try:
        if check:
            with pytest.raises(NonFiniteWeightsError, match="'t4'.*not committed") as ei:
                rx.receive(info, lambda pairs: got.update({n: t.clone() for n, t in pairs}))
        else:
            rx.receive(info, lambda pairs: got.update({n: t.clone() for n, t in pairs}))
    finally:
        th.join(60)
        rx.close()
    bytes_of = {n: t.reshape(-1).view(torch.uint8) for n, t in named}
    if not check:
        assert set(got) == set(bytes_of)
        assert all(torch.equal(got[n].reshape(-1).view(torch.uint8), bytes_of[n]) for n in got)
        return
    # the first bad unit stops loading (the rest is drained): nothing from t4's bucket / t4 on
    first_bad = next(b for b in plan if any(sl.name == "t4" for sl in b.slots)) if packed else None
    stop = first_bad.slots[0].index if packed else 4
    assert sorted(got) == [f"t{i}" for i in range(stop)]
    assert "'t4'" in str(ei.value)


def test_flag_parses():
    """``--weight-check-finite`` is on by default; ``--no-weight-check-finite`` turns it off."""
    from rlserve.cli import build_parser

    p = build_parser()
    assert p.parse_args(["serve", "m"]).weight_check_finite is True
    assert p.parse_args(["serve", "m", "--no-weight-check-finite"]).weight_check_finite is False


def test_a_worker_error_is_named_once():
    """The manager raises a worker's error as its rlserve class: the message names the class
    once (the class itself, or a class it does not map to in the text)."""
    from rlserve.transfer.errors import WeightTransferFailedError
    from rlserve.transfer.finite import refusal
    from rlserve.transfer.server.manager import WeightTransferManager

    why = refusal([TARGET])
    bad = {"done": True, "ok": False, "error_type": "NonFiniteWeightsError", "error": why}
    with pytest.raises(NonFiniteWeightsError) as ei:
        WeightTransferManager._poll_results([bad], "update_weights", None)
    assert str(ei.value) == f"update_weights failed on a server worker: {why}"
    other = {"done": True, "ok": False, "error_type": "RuntimeError", "error": "CUDA error: out of memory"}
    with pytest.raises(WeightTransferFailedError) as ei:
        WeightTransferManager._poll_results([other], "update_weights", None)
    assert str(ei.value) == "update_weights failed on a server worker: RuntimeError: CUDA error: out of memory"
