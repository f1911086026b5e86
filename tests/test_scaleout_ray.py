"""rlserve servers placed by Ray (local Ray on CPU; skipped without ``ray``): one placement
group, a bundle per server, each server bound to the node's address (not loopback)."""

from __future__ import annotations

import os
import urllib.parse

import pytest

from rlserve.scaleout.ray_launcher import ray_available
from tests.scaleout_harness import router_completion

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
    fleet = launch_servers(path, 2, cpus_per_server=1, admin_key="k",
                           serve_args=["--dtype", "float32", "--load-format", "dummy", "--max-model-len", "128"])
    try:
        table = placement_group_table(fleet.placement_group)
        assert table["state"] == "CREATED" and len(table["bundles"]) == 2
        assert len(set(fleet.urls)) == 2
        node_ip = ray_cluster.util.get_node_ip_address()
        for url, info in zip(fleet.urls, fleet.infos):
            assert urllib.parse.urlsplit(url).hostname == node_ip == info["node_ip"]  # the node's address
            ans = router_completion(url, path, "Hello", max_tokens=2)
            assert len(ans["choices"][0]["token_ids"]) == 2
        fleet.kill(1)
        assert not ray_cluster.get(fleet.actors[1].alive.remote())
        assert ray_cluster.get(fleet.actors[0].alive.remote())
    finally:
        fleet.shutdown()
    assert placement_group_table(fleet.placement_group)["state"] == "REMOVED"
