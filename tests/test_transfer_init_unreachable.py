"""``/init_weight_transfer_engine`` pointed at an address where no trainer's TCPStore listens (session 21,
FIX21 item 3: a 500 ``weight_transfer_failed`` after gloo's connect failed): a 502
``weight_transfer_unreachable`` (a peer the server relies on failed, as a gateway's upstream; a rendezvous
past ``timeout_s`` stays 504 ``weight_transfer_timeout``), the group state stays clean, and an init to a live
trainer right after works and syncs.

Session 22 (FIX item 1): a listener that takes the connection and never answers (torch's TCPStore client waited
for ever on its handshake; the manager's deadline answered a 504 naming no address after ``timeout_s`` + 30 s) is
the same 502, from :func:`rlserve.transfer.wire.store_probe.probe_store`'s deadline (``timeout_s``), naming the
address and what did not answer; a 502's ``type`` is ``bad_gateway_error`` (it was the catch-all ``error``)."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.transfer_harness import InProcessServer, listening_port
from tests.transfer_sync import trainer


@pytest.fixture
def closing_port():
    """A port whose listener accepts each connection and closes it at once (no TCPStore there)."""
    with listening_port(lambda conn: conn.close()) as port:
        yield port


@pytest.fixture
def silent_port():
    """A port whose listener takes each connection and never sends a byte (nor closes it)."""
    with listening_port(lambda conn: None) as port:
        yield port


def _init(url: str, port: int) -> httpx.Response:
    info = {"master_address": "127.0.0.1", "master_port": port, "world_size": 2, "rank_offset": 1,
            "backend": "gloo", "timeout_s": 5}  # (torch retries a reset connection until then)
    return httpx.post(url + "/init_weight_transfer_engine", json={"init_info": info}, timeout=180)


def test_no_store_at_the_port_is_a_502_and_a_live_trainer_then_syncs(tiny_model, closing_port):
    path = tiny_model("llama")
    with InProcessServer(path) as srv:
        for port in (closing_port, srv.port):  # reset at once; an HTTP server (no TCPStore handshake)
            r = _init(srv.url, port)
            assert r.status_code == 502, r.text
            err = r.json()["error"]
            assert err["code"] == "weight_transfer_unreachable", err
            assert f"could not connect to the transfer group's TCPStore at 127.0.0.1:{port} (rank 1/2, gloo)" \
                in err["message"], err
        assert srv.manager._init is None and srv.manager._busy is None  # no group, no call left running
        assert httpx.get(srv.url + "/weight_info", timeout=30).json()["state"] == "uninitialized"
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        eng = trainer(srv.url, hf)
        try:
            assert eng.send_weights()["status"] == "ok"
        finally:
            eng.shutdown()


def test_a_listener_that_never_answers_is_a_502_naming_the_address(tiny_model, silent_port):
    with InProcessServer(tiny_model("llama")) as srv:
        r = _init(srv.url, silent_port)  # timeout_s 5: before session 22, a 504 after 35 s naming no address
        assert r.status_code == 502, r.text
        err = r.json()["error"]
        assert (err["type"], err["code"], err["param"]) == ("bad_gateway_error", "weight_transfer_unreachable",
                                                            None), err
        assert (f"could not connect to the transfer group's TCPStore at 127.0.0.1:{silent_port} (rank 1/2, gloo): "
                "the listener there took the connection but sent 0 of the 4 bytes of a TCPStore handshake answer "
                "within 5 s (timeout_s)") in err["message"], err
        assert srv.manager._init is None and srv.manager._busy is None
        assert httpx.get(srv.url + "/weight_info", timeout=30).json()["state"] == "uninitialized"
