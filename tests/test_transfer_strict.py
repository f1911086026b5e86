"""Weight-sync answers that say what happened (issue 25's list): the SDK raises the server's
refusal rather than the broken broadcast it caused, finish_weight_update of an incomplete
declared update says what it did, init_info.timeout_s has a floor."""

from __future__ import annotations

import threading

import httpx
import pytest
import torch

from rlserve.errors import WeightUpdateError
from rlserve.transfer import GlooTrainerInitInfo, TensorListSource, WeightSyncHTTPError
from rlserve.transfer.sdk import engine as sdk
from rlserve.transfer.errors import WeightTransferFailedError
from rlserve.transfer.wire.packing import BucketBuffers
from rlserve.transfer.wire.protocol import MIN_TIMEOUT_S, WIRE_INT_MAX, InitInfo, UpdateInfo
from tests.transfer_sync import checksums, llama, server_greedy, trainer  # noqa: F401 (fixture)
from tests.transfer_harness import InProcessServer, free_port


class _Client:
    """update_weights blocks until ``release`` is set, then raises ``error``."""

    session = None

    def __init__(self, error: BaseException):
        self.error = error
        self.release = threading.Event()

    def update_weights(self, update_info, timeout_s=None):
        self.release.wait(60)
        raise self.error


def _engine(client) -> sdk.GroupTrainerEngine:
    eng = sdk.GroupTrainerEngine.__new__(sdk.GroupTrainerEngine)
    sdk.TrainerWeightTransferEngine.__init__(eng, GlooTrainerInitInfo(master_port=1, timeout_s=60), client,
                                             TensorListSource([("a.weight", torch.zeros(4))]))
    eng.group, eng._buffers, eng.device = object(), BucketBuffers(), torch.device("cpu")
    return eng


def test_sdk_raises_the_servers_refusal_not_the_closed_connection(monkeypatch):
    """A server that refuses an update while the trainer broadcasts tears the group down first
    and answers 400 after: the trainer's broadcast fails with gloo's "Connection closed by peer"
    before the answer arrives. The SDK waits for the answer and raises it."""
    refusal = WeightSyncHTTPError("/update_weights", 400, "the trainer's data does not match update_info: ...",
                                  "invalid_request_error", "weight_update_refused")
    client = _Client(refusal)

    def broken_broadcast(group, info, tensors, device, check=None, **kw):
        threading.Timer(0.3, client.release.set).start()  # the answer comes after the broken broadcast
        raise WeightTransferFailedError("broadcast failed (rank 0/2, gloo): Connection closed by peer")

    monkeypatch.setattr(sdk, "send_packed", broken_broadcast)
    eng = _engine(client)
    info = eng._metadata_info(False)
    with pytest.raises(WeightSyncHTTPError) as ei:
        eng._send(info, info.to_dict())
    assert ei.value.status_code == 400 and "does not match update_info" in ei.value.message
    assert isinstance(ei.value.__cause__, WeightTransferFailedError)  # the broadcast's error is kept as the cause


def test_sdk_raises_its_own_errors_without_waiting(monkeypatch):
    """An error of the trainer's side (a source yielding other tensors) is not a closed
    connection: it is raised at once, not after waiting for the server (which still waits for
    data here)."""
    client = _Client(WeightSyncHTTPError("/update_weights", 504, "timed out", None, None))

    def bad_source(group, info, tensors, device, check=None, **kw):
        raise ValueError("source yielded 'b.weight' where the announced order has 'a.weight'")

    monkeypatch.setattr(sdk, "send_packed", bad_source)
    eng = _engine(client)
    info = eng._metadata_info(False)
    try:
        with pytest.raises(ValueError, match="announced order"):
            eng._send(info, info.to_dict())
        assert not client.release.is_set()  # raised while the server's answer was still pending
    finally:
        client.release.set()


def test_timeout_s_floor():
    base = {"backend": "gloo", "master_port": 1234, "world_size": 2}
    for bad in (1e-9, 0.5, 0, -1):
        with pytest.raises(WeightUpdateError, match=f"from {MIN_TIMEOUT_S:g}.*bounds the rendezvous"):
            InitInfo.from_dict({**base, "timeout_s": bad})
    assert InitInfo.from_dict({**base, "timeout_s": MIN_TIMEOUT_S}).timeout_s == MIN_TIMEOUT_S


def test_ints_beyond_the_engine_wire_are_refused():
    """An int the engine-core wire (MessagePack: at most 2**64 - 1) cannot carry is a 400 naming
    its field. Before (adv20), update_info.packed_buffer_size_bytes 2**70 passed start_weight_update
    and /update_weights answered 500 OverflowError and tore the transfer group down;
    init_info.packed_buffer_size_bytes 2**64 answered 500 the same way; a shape of 2**70 passed too."""
    base = {"backend": "gloo", "master_port": 1234, "world_size": 2}
    for big in (WIRE_INT_MAX + 1, 2**64, 2**70):
        with pytest.raises(WeightUpdateError, match="init_info.packed_buffer_size_bytes must be <="):
            InitInfo.from_dict({**base, "packed_buffer_size_bytes": big})
        upd = {"names": ["a.weight"], "dtype_names": ["float32"], "shapes": [[4]]}
        with pytest.raises(WeightUpdateError, match="update_info.packed_buffer_size_bytes must be <="):
            UpdateInfo.from_dict({**upd, "packed_buffer_size_bytes": big})
        with pytest.raises(WeightUpdateError, match=r"update_info.shapes\[0\]"):
            UpdateInfo.from_dict({**upd, "shapes": [[big]]})
    assert InitInfo.from_dict({**base, "packed_buffer_size_bytes": WIRE_INT_MAX}).packed_buffer_size_bytes == WIRE_INT_MAX
    assert UpdateInfo.from_dict({"names": ["a.weight"], "dtype_names": ["float32"], "shapes": [[WIRE_INT_MAX]]}).shapes


def _send_first_tensors(eng, k: int):
    """Make ``eng`` declare its whole source at start_weight_update but send only its first
    ``k`` tensors (a trainer bug, or one that died between update calls)."""
    honest = eng._send

    def short(info, declared):
        full = eng.source
        eng.source = TensorListSource(list(full.named_tensors())[:k])
        try:
            sub = eng._metadata_info(partial=True)
            sub.checksums_after_data = eng._checksums_after_data(sub)
            return honest(sub, sub.to_dict())
        finally:
            eng.source = full

    eng._send = short
    return honest


@pytest.mark.parametrize("staging", ["none", "device"])
def test_finish_of_an_incomplete_update_says_what_happened(llama, staging):  # noqa: F811
    path, hf = llama
    with InProcessServer(path, staging=staging) as srv:
        base = checksums(srv.url)
        r = httpx.post(srv.url + "/init_weight_transfer_engine", timeout=30, json={"init_info": {
            "backend": "gloo", "master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2,
            "timeout_s": 1e-9}})
        assert r.status_code == 400 and "init_info.timeout_s" in r.json()["error"]["message"], r.text
        eng = trainer(srv.url, hf)
        n = len(list(eng.source.named_tensors()))
        honest = _send_first_tensors(eng, 3)
        with pytest.raises(WeightSyncHTTPError) as ei:
            eng.send_weights()
        msg = ei.value.message
        assert ei.value.status_code == 400 and f"{n - 3} of the {n} declared tensors never arrived" in msg, msg
        if staging == "none":
            assert "the 3 that arrived were loaded in place" in msg and "503" in msg, msg
            r = server_greedy(srv.url)
            assert r.status_code == 503 and "full weight update" in r.json()["error"]["message"]
        else:
            assert "nothing was committed" in msg and "old weights keep serving" in msg, msg
            assert server_greedy(srv.url).status_code == 200 and checksums(srv.url) == base
        assert not srv.aengine.is_paused()
        eng._send = honest
        eng.send_weights()  # a full update lands: available again
        assert server_greedy(srv.url).status_code == 200
        eng.shutdown()
