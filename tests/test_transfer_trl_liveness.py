"""TRL's layout (server worker 0 hosts the store, the trainer is the last rank) is liveness-watched
too (issue 25): the trainer's connections to the store are found after the rendezvous and a
trainer killed mid-batch fails the batch at once, not after ``timeout_s``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from rlserve.transfer.server.tcp_peer import StoreConnectionLiveness, _ip, own_endpoints, tcp_table
from rlserve.server.launch import parent_death_signal
from tests.transfer_harness import InProcessServer

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux's /proc/net/tcp")

CLIENT = """
import socket, sys, time
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
print(s.getsockname()[1], flush=True)
time.sleep(600)
"""


def test_addresses_are_read_like_the_kernel_writes_them():
    assert _ip("0100007F") == "127.0.0.1"
    assert _ip("0000000000000000FFFF00000100007F") == "127.0.0.1"  # IPv4-mapped (dual-stack listener)
    assert _ip("00000000000000000000000001000000") == "00000000000000000000000001000000"  # ::1 stays hex


def test_watch_finds_the_peer_and_notices_its_death():
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    mine = socket.create_connection(("127.0.0.1", port))  # a "worker's" own client: excluded
    accepted = [srv.accept()[0]]
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, str(port)], stdout=subprocess.PIPE, text=True,
                            preexec_fn=parent_death_signal())
    try:
        peer_port = int(proc.stdout.readline())
        accepted.append(srv.accept()[0])
        ours = own_endpoints(port)
        assert ["127.0.0.1", mine.getsockname()[1]] in ours and all(p != peer_port for _, p in ours), ours
        watch = StoreConnectionLiveness(port, [tuple(e) for e in ours], min_interval_s=0.0)
        watch.start()
        assert watch.peers == {("127.0.0.1", peer_port)}, (watch.peers, tcp_table()[:5])
        assert watch.gone() is None
        proc.kill()
        proc.wait(30)
        deadline = time.monotonic() + 30
        while watch.gone() is None:
            assert time.monotonic() < deadline, "the peer's death was never noticed"
            time.sleep(0.05)
        assert f"port {port}" in watch.gone() and str(peer_port) in watch.gone()
        watch.stop()
        assert watch.gone() is None  # a stopped watch reports nothing
    finally:
        proc.kill()
        for s in (*accepted, mine, srv):
            s.close()


def test_trl_trainer_killed_between_tensors_fails_the_batch_at_once(tiny_model):
    """In place, timeout_s 300: the killed TRL trainer's batch fails within seconds (the
    failure path: 503 until a full update, group torn down), not after 300 s."""
    from tests.kill_matrix import BAD_SEED, model_meta
    from tests.kill_trainer import spawn_killed_trainer

    path = tiny_model("llama")
    meta = model_meta(path)
    with InProcessServer(path, transfer_config={"backend": "gloo", "timeout_s": 300}) as srv:
        spawn_killed_trainer(srv.url, 0, 300, "trl", "between_buckets", meta, BAD_SEED, packed=False)
        t_kill = time.monotonic()
        while (info := httpx.get(srv.url + "/weight_info", timeout=30).json())["state"] != "uninitialized":
            assert time.monotonic() - t_kill < 120, f"not noticed (timeout_s is 300): {info}"
            time.sleep(0.05)
        assert "the trainer is gone" in info["last_update"]["error"], info
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=60)
        assert r.status_code == 503, r.text  # in place, the first tensor was loaded
