"""``/init_weight_transfer_engine`` pointed at an address where no trainer's TCPStore listens (session 21,
FIX21 item 3: a 500 ``weight_transfer_failed`` after gloo's connect failed): a 502
``weight_transfer_unreachable`` (a peer the server relies on failed, as a gateway's upstream; a rendezvous
past ``timeout_s`` stays 504 ``weight_transfer_timeout``), the group state stays clean, and an init to a live
trainer right after works and syncs."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.transfer_harness import InProcessServer
from tests.transfer_sync import trainer


@pytest.fixture
def closing_port():
    """A port whose listener accepts each connection and closes it at once (no TCPStore there)."""
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(16)

    def serve():
        while True:
            try:
                c, _ = ls.accept()
            except OSError:  # closed: the test is over
                return
            c.close()

    threading.Thread(target=serve, daemon=True).start()
    yield ls.getsockname()[1]
    ls.close()


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
