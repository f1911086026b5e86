"""rlserve servers placed by Ray (local Ray on CPU; skipped without ``ray``, or without
``sglang-router`` for the router part): one placement group, a bundle per server, each server
bound to the node's address (not loopback); then the same as ``tests/test_scaleout.py`` on the
Ray-placed servers: one trainer syncs both through one group, one is killed mid-sync, the next
sync runs with the survivor."""

from __future__ import annotations

import os
import urllib.parse

import pytest

from rlserve.scaleout.ray_launcher import ray_available
from rlserve.scaleout.router import router_available
from tests.scaleout_harness import check_one_version_and_greedy, kill_mid_sync_and_recover, killing_source, \
    router_completion

ADMIN = "ray-admin"
PROMPTS = ["The capital of France is", "Hello world! Hello there,", "The quick brown fox"]

pytestmark = [pytest.mark.skipif(ray_available() is not None, reason=ray_available() or ""), pytest.mark.slow]


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    old = os.environ.get("RLSERVE_ENGINE_MODE")
    os.environ["RLSERVE_ENGINE_MODE"] = "thread"  # inherited by Ray's workers and the servers
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        if old is None:
            os.environ.pop("RLSERVE_ENGINE_MODE", None)
        else:
            os.environ["RLSERVE_ENGINE_MODE"] = old


def test_ray_places_servers_in_one_placement_group(ray_cluster, tiny_model):
    from ray.util.placement_group import placement_group_table

    from rlserve.scaleout.ray_launcher import launch_servers

    path = tiny_model("llama")
    fleet = launch_servers(path, 2, cpus_per_server=1, admin_key=ADMIN,
                           serve_args=["--dtype", "float32", "--load-format", "dummy", "--max-model-len", "128",
                                       "--weight-staging", "host"])
    try:
        table = placement_group_table(fleet.placement_group)
        assert table["state"] == "CREATED" and len(table["bundles"]) == 2
        assert len(set(fleet.urls)) == 2
        node_ip = ray_cluster.util.get_node_ip_address()
        for url, info in zip(fleet.urls, fleet.infos):
            assert urllib.parse.urlsplit(url).hostname == node_ip == info["node_ip"]  # the node's address
            ans = router_completion(url, path, "Hello", max_tokens=2)
            assert len(ans["choices"][0]["token_ids"]) == 2
        if router_available() is None:
            _sync_and_kill(fleet, path)
        else:
            fleet.kill(1)
        assert not ray_cluster.get(fleet.actors[1].alive.remote())
        assert ray_cluster.get(fleet.actors[0].alive.remote())
    finally:
        fleet.shutdown()
    assert placement_group_table(fleet.placement_group)["state"] == "REMOVED"


def _sync_and_kill(fleet, path: str) -> None:
    """The router over the Ray-placed servers, a trainer at the node's address syncing both, then
    server 1 killed mid-sync (through its actor)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlserve.scaleout.router import SGLangRouter
    from rlserve.transfer.sdk.multi_server import MultiServerTrainer

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with SGLangRouter(fleet.urls) as router:
        trainer = MultiServerTrainer.create(fleet.urls, killing_source(hf), admin_key=ADMIN, router=router,
                                            timeout_s=60, packed_buffer_size_bytes=64 << 10)
        try:
            # the trainer's store and gloo bind the address the servers' node reaches it by
            assert trainer.engine.init_info.master_address == urllib.parse.urlsplit(fleet.urls[0]).hostname
            trainer.send_weights()
            check_one_version_and_greedy(trainer, router.url, path, hf, PROMPTS[:2], ADMIN)
            kill_mid_sync_and_recover(trainer, lambda: fleet.kill(1), fleet.urls[1], router, path, hf, PROMPTS,
                                      ADMIN)
        finally:
            trainer.shutdown()
