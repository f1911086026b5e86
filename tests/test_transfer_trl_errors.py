"""TRL's per-tensor routes after their group is gone: a conflict (409, OpenAI-style JSON error),
not a 500. Found by schemathesis (issue 23): ``/update_named_param/`` after another call had torn
the TRL group down answered 500 ``TransferAbortedError``."""

from __future__ import annotations

import time

import httpx
import pytest

from rlserve.transfer.sdk.trl import TRLWeightSyncClient
from tests.transfer_harness import InProcessServer, reserved_port, wait_for_state

T = 60.0


@pytest.fixture(scope="module")
def llama_path(tiny_model):
    return tiny_model("llama")


def _err(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["code"], str), err
    return err


def _wait_trl_error(url: str) -> str:
    deadline = time.monotonic() + T
    while (e := httpx.get(url + "/weight_info", timeout=T).json()["trl"]["error"]) is None:
        assert time.monotonic() < deadline, "the TRL failure was never recorded"
        time.sleep(0.02)
    return e


def test_update_named_param_after_the_trl_group_was_torn_down_is_409(llama_path):
    named = {"name": "model.norm.weight", "dtype": "torch.float32", "shape": [64]}
    with InProcessServer(llama_path, transfer_config={"backend": "gloo", "timeout_s": 60}) as srv:
        # never initialised: 409
        err = _err(httpx.post(srv.url + "/update_named_param/", json=named, timeout=T), 409)
        assert err["code"] == "no_transfer_engine" and "/init_communicator/" in err["message"], err

        # schemathesis' case: a TRL tensor being received when another call tears the group
        # down (the receive ends with TransferAbortedError, recorded for the next TRL call)
        trl = TRLWeightSyncClient(srv.url, group_port=0, timeout_s=60)
        trl.init_communicator()
        trl.http.update_named_param(**named)  # its broadcast never follows
        wait_for_state(srv.url, "update", T)  # the receive started
        assert httpx.post(srv.url + "/shutdown_weight_transfer_engine", timeout=T).status_code == 200
        _wait_trl_error(srv.url)
        err = _err(httpx.post(srv.url + "/update_named_param/", json=named, timeout=T), 409)
        assert err["code"] == "no_transfer_engine" and err["type"] == "conflict_error", err
        assert "TransferAbortedError" in err["message"] and "/init_communicator/ again" in err["message"], err
        # reported once; nothing was loaded, the server is unharmed
        err = _err(httpx.post(srv.url + "/update_named_param/", json=named, timeout=T), 409)
        assert "TransferAbortedError" not in err["message"], err
        info = httpx.get(srv.url + "/weight_info", timeout=T).json()
        assert info["trl"]["error"] is None and info["state"] == "uninitialized" and info["weight_version"] == "0"
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=T)
        assert r.status_code == 200, r.text
        trl.group.destroy(wait_s=5.0)

        # a pending TRL rendezvous (no trainer joins) cancelled by a shutdown: 409 naming it (the
        # server binds the port; reserved here, so no other process takes it before)
        with reserved_port() as port:
            r = httpx.post(srv.url + "/init_communicator/", json={"host": "127.0.0.1", "port": port,
                                                                  "world_size": 2}, timeout=T)
            assert r.status_code == 200, r.text
            wait_for_state(srv.url, "init", T)  # the rendezvous started
            assert httpx.post(srv.url + "/shutdown_weight_transfer_engine", timeout=T).status_code == 200
            _wait_trl_error(srv.url)
        err = _err(httpx.post(srv.url + "/update_named_param/", json=named, timeout=T), 409)
        assert err["code"] == "no_transfer_engine" and "cancelled by shutdown_weight_transfer_engine" in err["message"]


def test_close_communicator_after_a_failed_init_is_a_clean_200(llama_path):
    """P33 (issue 33's leftover): ``/close_communicator/`` after an ``/init_communicator/`` whose
    rendezvous failed (no trainer joined within ``timeout_s``) answered the init's own error as
    a 500 (``WeightTransferFailedError: wait timeout``). Now a 200 no-op naming that failure;
    the server serves and a new init works. Fails before (500)."""
    with InProcessServer(llama_path, transfer_config={"backend": "gloo", "timeout_s": 1}) as srv, \
            reserved_port() as port:  # the server binds it; no other process can take it before
        r = httpx.post(srv.url + "/init_communicator/", json={"host": "127.0.0.1", "port": port,
                                                              "world_size": 2}, timeout=T)
        assert r.status_code == 200, r.text
        assert "wait timeout" in _wait_trl_error(srv.url)  # nobody joined: the init failed
        r = httpx.post(srv.url + "/close_communicator/", timeout=T)
        assert r.status_code == 200, r.text
        msg = r.json()["message"]
        assert msg.startswith("no communicator to close: the last /init_communicator/ failed (") and "wait timeout" in msg
        info = httpx.get(srv.url + "/weight_info", timeout=T).json()
        assert info["trl"]["error"] is None and info["state"] == "uninitialized" and info["weight_version"] == "0"
        # a second close: nothing recorded any more, the ordinary no-op
        assert httpx.post(srv.url + "/close_communicator/", timeout=T).json() == {
            "message": "Request received, closing communicator"}
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=T)
        assert r.status_code == 200, r.text
        trl = TRLWeightSyncClient(srv.url, group_port=0, timeout_s=60)  # a trainer that joins
        trl.init_communicator()
        wait_for_state(srv.url, "ready", T)
        trl.close_communicator()
