"""Scale-out on CPU (gloo): three rlserve servers (staged updates) behind the SGLang router and
one trainer that syncs all of them in one transfer group (``rlserve.transfer.sdk.multi_server``).

One fleet for the module (starting servers is the expensive part); the tests run in file order
and the last one kills a server. Skipped without ``sglang-router`` (``pip install
'rlserve[router]'``). Every wait is on a state (a metric, a listing), never on a duration.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import subprocess
import sys

import pytest
import requests
import torch

from rlserve.distributed.group import local_address_toward, primary_address
from rlserve.scaleout.router import RouterOptions, router_available
from tests.scaleout_harness import (check_one_version_and_greedy, kill_mid_sync_and_recover, killing_source, metric,
                                    router_completion, wait_for)
from tests.transfer_harness import greedy_continuation

pytestmark = pytest.mark.skipif(router_available() is not None, reason=router_available() or "")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["The capital of France is", "Hello world! Hello there,", "The quick brown fox", "def main():"]
ADMIN = "scaleout-admin"


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    """``(model path, LocalServers of 3, SGLangRouter over the first 2)``: servers bound to every
    interface (the trainer reaches them, and they it, by this machine's routable address)."""
    from rlserve.scaleout.local import LocalServers
    from rlserve.scaleout.router import SGLangRouter

    path = tiny_model("llama")
    logs = str(tmp_path_factory.mktemp("scaleout_logs"))
    old = os.environ.get("RLSERVE_ENGINE_MODE")
    os.environ["RLSERVE_ENGINE_MODE"] = "thread"  # one process per server: faster starts on 2 cores
    try:
        with LocalServers(path, 3, staging="host", host="0.0.0.0", admin_key=ADMIN, log_dir=logs) as servers, \
                SGLangRouter(servers.urls[:2], options=RouterOptions(policy="cache_aware"),
                             log_path=f"{logs}/router.log") as router:
            yield path, servers, router
    finally:
        if old is None:
            os.environ.pop("RLSERVE_ENGINE_MODE", None)
        else:
            os.environ["RLSERVE_ENGINE_MODE"] = old


@pytest.fixture(scope="module")
def hf(fleet):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(fleet[0], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def trainer(fleet, hf):
    """One trainer over the three servers, its store on this machine's routable address."""
    from rlserve.transfer.sdk.multi_server import MultiServerTrainer

    _path, servers, router = fleet
    t = MultiServerTrainer.create(servers.urls, killing_source(hf), master_address=primary_address(),
                                  admin_key=ADMIN, router=router, timeout_s=60, packed_buffer_size_bytes=64 << 10)
    yield t
    t.shutdown()


def _scale(model, factor: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(factor)


# ---------------------------------------------------------------------------- the router
def test_router_adds_and_removes_servers_and_forwards_requests(fleet):
    path, servers, router = fleet
    assert router.healthy_urls() == sorted(servers.urls[:2])
    router.add_worker(servers.urls[2])
    assert router.healthy_urls() == sorted(servers.urls)
    listed = {w["url"]: w for w in router.workers()}
    assert listed[servers.urls[2]]["model_id"] == path  # read from the server's /get_model_info
    choice = router_completion(router.url, path, PROMPTS[0], max_tokens=4)["choices"][0]
    assert len(choice["token_ids"]) == 4 and choice["prompt_token_ids"]  # rlserve's fields came back
    assert router.remove_worker(servers.urls[2]) is True
    assert router.healthy_urls() == sorted(servers.urls[:2])
    assert router.remove_worker(servers.urls[2]) is False  # not listed any more: nothing to do
    router.add_worker(servers.urls[2])


def test_cache_aware_routing_keeps_a_prefix_on_one_server(fleet):
    """The same long prompt prefix goes to the server that already holds it: every repeat lands
    where the first went, whichever server that was."""
    path, servers, router = fleet
    before = {u: metric(u, "vllm:request_success_total") for u in servers.urls}
    prefix = "Reinforcement learning from human feedback trains a policy with rollouts. " * 2
    for i in range(4):
        router_completion(router.url, path, prefix + str(i), max_tokens=2)
    delta = sorted(metric(u, "vllm:request_success_total") - before[u] for u in servers.urls)
    assert delta == [0, 0, 4], delta


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
    assert local_address_toward(addr) == addr


# ---------------------------------------------------------------------------- one trainer, N servers
def test_one_send_weights_syncs_every_server_to_one_version(fleet, hf, trainer):
    path, servers, router = fleet
    assert trainer.client.rank_offsets() == {u: i + 1 for i, u in enumerate(servers.urls)}
    assert trainer.engine.init_info.world_size == 4
    assert trainer.engine.init_info.master_address == primary_address()
    for factor in (1.0, 1.5):
        _scale(hf, factor)
        v = trainer.send_weights()["weight_version"]
        assert check_one_version_and_greedy(trainer, router.url, path, hf, PROMPTS[:2], ADMIN) == v
    assert trainer.send_weights(weight_version="step-7")["weight_version"] == "step-7"
    assert set(trainer.weight_versions().values()) == {"step-7"}


def test_requests_through_the_router_during_a_sync_are_not_lost(fleet, hf, trainer):
    """Pause every server (keep), send requests through the router (each is held by the server it
    reached), sync, resume: every request completes, on the new weights."""
    path, servers, router = fleet
    held0 = sum(metric(u, "rlserve_num_requests_held") for u in servers.urls)
    trainer.pause("keep")
    with cf.ThreadPoolExecutor(6) as pool:
        futs = [pool.submit(router_completion, router.url, path, PROMPTS[i % 4] + " " * (i // 4), 6)
                for i in range(6)]
        try:
            wait_for(lambda: sum(metric(u, "rlserve_num_requests_held") for u in servers.urls) >= held0 + 6,
                     "6 requests held by the paused servers")
            assert not any(f.done() for f in futs)
            _scale(hf, 0.9)
            v = trainer.send_weights()["weight_version"]
        finally:
            trainer.resume()
        answers = [f.result(timeout=300) for f in futs]
    assert trainer.weight_versions() == {u: v for u in servers.urls}
    for ans in answers:  # generated after the commit: the new weights only
        c = ans["choices"][0]
        assert ans["weight_version"] == v
        assert c["token_ids"] == greedy_continuation(hf, c["prompt_token_ids"], len(c["token_ids"])), c


def test_a_server_killed_mid_sync_fails_the_update_everywhere(fleet, hf, trainer):
    """Server 1 dies after the update's first tensors went out: the update fails on every server;
    the staged survivors keep the old version and weights and keep serving through the router,
    which no longer lists the dead one; the next sync runs with the survivors."""
    path, servers, router = fleet
    kill_mid_sync_and_recover(trainer, lambda: servers.kill(1), servers.urls[1], router, path, hf, PROMPTS, ADMIN)


# ---------------------------------------------------------------------------- the example
def test_example_rlhf_multi_server(fleet):
    """The example against this module's servers (the two survivors) and router: its own trainer
    and group (a new init replaces the fixture trainer's), 3 rounds. (Run on its own, the example
    starts 2 servers and the router itself: that path is the fixture's, LocalServers +
    SGLangRouter.)"""
    path, servers, router = fleet
    urls = [u for u in servers.urls if u != servers.urls[1]]
    cmd = [sys.executable, os.path.join(ROOT, "examples", "rlhf_multi_server.py"), "--model", path,
           "--max-tokens", "4", "--router-url", router.url, "--admin-key", ADMIN]
    for u in urls:
        cmd += ["--server-url", u]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=ROOT),
                       cwd=ROOT)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("OK"), (r.stdout[-3000:], r.stderr[-3000:])
    assert r.stdout.count("equal the trainer's") == 3
