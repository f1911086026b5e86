"""rlserve servers behind the SGLang router (``sglang-router`` from PyPI; skipped without it):
requests reach the servers through the router (its added fields accepted at their neutral
values only), the router's worker API adds and removes servers, and the address helpers pick a
routable interface rather than assuming loopback."""

from __future__ import annotations

import os

import pytest
import requests

from rlserve.distributed.group import local_address_toward, primary_address
from rlserve.scaleout.router import RouterOptions, router_available
from tests.scaleout_harness import router_completion

pytestmark = pytest.mark.skipif(router_available() is not None, reason=router_available() or "")


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    from rlserve.scaleout.local import LocalServers
    from rlserve.scaleout.router import SGLangRouter

    path = tiny_model("llama")
    logs = str(tmp_path_factory.mktemp("router_logs"))
    old = os.environ.get("RLSERVE_ENGINE_MODE")
    os.environ["RLSERVE_ENGINE_MODE"] = "thread"  # one process per server: faster starts on 2 cores
    try:
        with LocalServers(path, 2, log_dir=logs) as servers, \
                SGLangRouter(servers.urls[:1], options=RouterOptions(policy="cache_aware"),
                             log_path=f"{logs}/router.log") as router:
            yield path, servers, router
    finally:
        if old is None:
            os.environ.pop("RLSERVE_ENGINE_MODE", None)
        else:
            os.environ["RLSERVE_ENGINE_MODE"] = old


def test_router_adds_and_removes_servers_and_forwards_requests(fleet):
    path, servers, router = fleet
    assert router.healthy_urls() == [servers.urls[0]]
    router.add_worker(servers.urls[1])
    assert router.healthy_urls() == sorted(servers.urls)
    listed = {w["url"]: w for w in router.workers()}
    assert listed[servers.urls[1]]["model_id"] == path  # read from the server's /get_model_info
    ans = router_completion(router.url, path, "The capital of France is", max_tokens=4)
    choice = ans["choices"][0]
    assert len(choice["token_ids"]) == 4 and choice["prompt_token_ids"]  # rlserve's fields came back
    assert router.remove_worker(servers.urls[1]) is True
    assert router.healthy_urls() == [servers.urls[0]]
    assert router.remove_worker(servers.urls[1]) is False  # not listed any more: nothing to do
    router.add_worker(servers.urls[1])


def test_cache_aware_routing_keeps_a_prefix_on_one_server(fleet):
    """The same long prompt prefix goes to the server that already holds it (prefix-cache-aware):
    every repeat lands where the first went, whatever server that was."""
    path, servers, router = fleet
    router.wait_workers(servers.urls)
    before = {u: _requests_done(u) for u in servers.urls}
    prefix = "Reinforcement learning from human feedback trains a policy with rollouts. " * 2
    for i in range(4):
        router_completion(router.url, path, prefix + str(i), max_tokens=2)
    delta = {u: _requests_done(u) - before[u] for u in servers.urls}
    assert sorted(delta.values()) == [0, 4], delta


def _requests_done(url: str) -> float:
    from tests.scaleout_harness import metric

    return metric(url, "vllm:request_success_total")


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "no_stop_trim": False, "return_hidden_states": False}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                              "no_stop_trim": False, "return_hidden_states": False, "separate_reasoning": True,
                              "stream_reasoning": True}),
])
def test_router_fields_accepted_at_their_neutral_values(fleet, route, body):
    url = fleet[1].urls[0]
    assert requests.post(url + route, json=body, timeout=120).status_code == 200
    for field in ("no_stop_trim", "return_hidden_states"):
        r = requests.post(url + route, json={**body, field: True}, timeout=120)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_value" and err["param"] == field, err


def test_addresses_never_assume_loopback():
    assert local_address_toward("127.0.0.1") == "127.0.0.1"
    addr = primary_address()
    # the interface of the default route toward itself is itself (loopback only on a machine
    # without a route off it)
    assert local_address_toward(addr) == addr
