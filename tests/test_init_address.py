"""``init_info.master_address`` that no trainer can be reached at (session 19's adversarial pass):
refused with 400 at once, nothing changed, instead of a rendezvous retried for ``timeout_s``
before a 504 (the pass saw ``"\\u00e9\\u0000"`` hold its request past a 60 s client timeout).

Session 22 (FIX item 3): every init refusal names its field in ``param`` (it was null), as the route's body names it
(``init_info.<field>``; TRL's ``/init_communicator/``: ``port``, ``world_size``)."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.transfer_harness import free_port
from tests.transfer_sync import PROMPT_IDS, hf_greedy, llama, server_greedy, trainer  # noqa: F401 (llama: a fixture)


@pytest.mark.parametrize("address", ["no-such-host.invalid", "\u00e9\u0000", "127.0.0.1 ", "h" * 254],
                         ids=["unknown-name", "non-ascii-nul", "space", "too-long"])
def test_unreachable_master_address_is_refused_at_once(llama, shared, address):  # noqa: F811
    path, hf = llama
    with shared(path) as srv:
        body = {"init_info": {"backend": "gloo", "master_address": address, "master_port": free_port(),
                              "world_size": 2, "rank_offset": 1, "timeout_s": 30}}
        t0 = time.monotonic()
        r = httpx.post(srv.url + "/init_weight_transfer_engine", json=body, timeout=120)
        took = time.monotonic() - t0
        assert r.status_code == 400, (r.status_code, r.text, f"{took:.1f} s")
        err = r.json()["error"]
        assert err["code"] == "weight_update_refused" and "init_info.master_address" in err["message"], err
        assert err["param"] == "init_info.master_address", err
        assert httpx.get(srv.url + "/weight_info", timeout=30).json()["state"] == "uninitialized"
        eng = trainer(srv.url, hf)  # a good init and sync still work
        eng.send_weights()
        assert server_greedy(srv.url).json()["completion_ids"] == [hf_greedy(hf, p) for p in PROMPT_IDS]
        eng.shutdown()


@pytest.mark.parametrize("route, body, param", [
    ("/init_weight_transfer_engine", {"backend": "bogus"}, "init_info.backend"),
    ("/init_weight_transfer_engine", {"master_port": "x"}, "init_info.master_port"),
    ("/init_weight_transfer_engine", {"master_port": 0}, "init_info.master_port"),
    ("/init_weight_transfer_engine", {"world_size": 3}, "init_info.world_size"),
    ("/init_weight_transfer_engine", {"timeout_s": 1e-9}, "init_info.timeout_s"),
    ("/init_weight_transfer_engine", {"packed": "yes"}, "init_info.packed"),
    ("/init_weight_transfer_engine", {"session": "s" * 129}, "init_info.session"),
    ("/init_weight_transfer_engine", {"bogus_field": 1}, "init_info.bogus_field"),
    ("/init_communicator/", {"port": 70000}, "port"),
    ("/init_communicator/", {"world_size": 5}, "world_size"),
])
def test_init_refusals_name_their_field(llama, shared, route, body, param):  # noqa: F811
    path, _hf = llama
    with shared(path) as srv:
        if route == "/init_communicator/":
            req = {"host": "127.0.0.1", "port": free_port(), **body}
        else:
            req = {"init_info": {"backend": "gloo", "master_address": "127.0.0.1", "master_port": free_port(),
                                 "world_size": 2, "rank_offset": 1, "timeout_s": 30, **body}}
        r = httpx.post(srv.url + route, json=req, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["code"], err["param"]) == ("weight_update_refused", param), err
        assert param.split(".")[-1] in err["message"], err
        assert httpx.get(srv.url + "/weight_info", timeout=30).json()["state"] == "uninitialized"
