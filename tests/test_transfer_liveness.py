"""Trainer liveness (rlserve.transfer.server.liveness) and the abortable receive it relies on.

The end-to-end kill tests (a real trainer SIGKILLed at each point of a sync, timeout_s=300) are
in test_transfer_e2e.py; benchmarks/kill_matrix.py prints the times."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from rlserve.transfer.errors import TransferAbortedError
from rlserve.transfer.backends.group import TransferGroup, bind_master_store
from rlserve.transfer.server.liveness import StoreLiveness
from rlserve.server.launch import parent_death_signal
from tests.transfer_harness import bound_socket

STORE_HOST = """
import sys, time, torch.distributed as dist
from datetime import timedelta
store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
print(store.port, flush=True)
time.sleep(120)
"""


def _wait_gone(watch: StoreLiveness, limit_s: float) -> str:
    deadline = time.monotonic() + limit_s
    while watch.gone() is None:
        assert time.monotonic() < deadline, f"{watch} never reported the peer gone"
        time.sleep(0.01)
    return watch.gone()


@contextlib.contextmanager
def _watched_store_host():
    """A TCPStore host in a subprocess and a started :class:`StoreLiveness` connected to it:
    ``(process, its port, the watch)``. The process is killed at the end."""
    proc = subprocess.Popen([sys.executable, "-c", STORE_HOST], stdout=subprocess.PIPE, text=True,
                            preexec_fn=parent_death_signal())
    try:
        port = int(proc.stdout.readline())
        watch = StoreLiveness("127.0.0.1", port)
        watch.start()
        assert watch.wait_connected(30)
        yield proc, port, watch
    finally:
        proc.kill()
        proc.wait(30)


def test_store_liveness_notices_a_killed_process():
    with _watched_store_host() as (proc, port, watch):
        time.sleep(0.5)
        assert watch.gone() is None  # alive: the silent connection stays open
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        t0 = time.monotonic()
        reason = _wait_gone(watch, 30)
        print(f"store liveness: SIGKILL noticed after {time.monotonic() - t0:.3f} s")
        assert "closed its connection: the trainer process died" in reason and str(port) in reason
        watch.stop()
        watch.join(30)


def test_store_liveness_keeps_alive_a_silent_connection_and_sets_keepalive(monkeypatch):
    """The watch never writes: it waits for end of file. A host that vanishes without closing
    the connection is caught by TCP keepalive, set to give up after ~unresponsive_s."""
    import rlserve.transfer.server.liveness as liveness

    seen = {}
    real = liveness._keepalive

    def spy(sock, unresponsive_s):
        real(sock, unresponsive_s)
        seen["keepalive"] = sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
        if hasattr(socket, "TCP_KEEPIDLE"):
            seen["idle"] = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)
            seen["interval"] = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL)
            seen["count"] = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)

    monkeypatch.setattr(liveness, "_keepalive", spy)
    with socket.socket() as quiet:
        quiet.bind(("127.0.0.1", 0))
        quiet.listen()
        watch = StoreLiveness("127.0.0.1", quiet.getsockname()[1], unresponsive_s=12)
        watch.start()
        assert watch.wait_connected(30)
        peer, _ = quiet.accept()
        with peer:
            peer.settimeout(0.3)
            with pytest.raises(socket.timeout):
                peer.recv(1)  # nothing is ever sent
            assert watch.gone() is None
            assert seen["keepalive"] == 1
            if "idle" in seen:
                assert (seen["idle"], seen["interval"], seen["count"]) == (4, 2, 5)
        _wait_gone(watch, 30)  # the peer closed
        watch.stop()
        watch.join(30)


def test_store_liveness_nothing_listening():
    held = bound_socket()  # bound, never listening: connections refused, and no other process can take it
    try:
        watch = StoreLiveness("127.0.0.1", held.getsockname()[1], connect_timeout_s=1.0)
        watch.start()
        assert not watch.wait_connected(30)
        assert "cannot be reached" in _wait_gone(watch, 30)
        watch.join(30)
    finally:
        held.close()


def test_stopped_watch_reports_nothing():
    with _watched_store_host() as (proc, _port, watch):
        watch.stop()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        watch.join(30)
        assert watch.gone() is None  # the manager stopped it (the group was torn down first)


def test_abort_ends_a_receive_the_peer_never_sends():
    """gloo does not always report a dead peer: a posted receive can wait for the backend's own
    timeout. ``TransferGroup.abort(reason)`` ends the wait at once and the error names why."""
    store = bind_master_store("127.0.0.1", 60.0)  # rank 0's, listening before rank 1 is told
    groups: dict = {}

    def join(rank):
        groups[rank] = TransferGroup.create("gloo", "127.0.0.1", store.port, rank, 2, 60.0,
                                            store=store if rank == 0 else None)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    g0, g1 = groups[0], groups[1]
    try:
        buf = torch.empty(1024, dtype=torch.uint8)
        work = g1.broadcast(buf, 0)  # rank 0 never sends
        threading.Timer(0.2, g1.abort, args=("the trainer is gone: test",)).start()
        t0 = time.monotonic()
        with pytest.raises(TransferAbortedError, match="bucket 1/1 aborted: the trainer is gone: test"):
            g1.wait(work, what="bucket 1/1")
        assert time.monotonic() - t0 < 30  # (0.2 s; the group's timeout is 60 s)
        with pytest.raises(TransferAbortedError, match="the trainer is gone"):  # later waits too
            g1.wait(g1.broadcast(buf, 0), what="bucket 2/2")
    finally:
        g1.destroy()
        g0.destroy()


def test_trainer_liveness_config_is_checked():
    from rlserve.transfer.server.manager import WeightTransferManager

    with pytest.raises(ValueError, match="trainer_liveness"):
        WeightTransferManager(None, {"backend": "gloo", "trainer_liveness": "no"})
