"""Trainer liveness (rlserve.transfer.liveness) and the abortable receive it relies on.

The end-to-end kill tests (a real trainer SIGKILLed at each point of a sync, timeout_s=300) are
in test_transfer_e2e.py / test_transfer_manager.py; benchmarks/kill_matrix.py prints the times."""

from __future__ import annotations

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
from rlserve.transfer.group import TransferGroup
from rlserve.transfer.liveness import StoreLiveness
from tests.transfer_harness import free_port

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


def test_store_liveness_notices_a_killed_process():
    proc = subprocess.Popen([sys.executable, "-c", STORE_HOST], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        watch = StoreLiveness("127.0.0.1", port, interval_s=0.05)
        watch.start()
        assert watch.wait_connected(30)
        deadline = time.monotonic() + 30
        while watch.probes < 3:  # alive: probes are answered
            assert time.monotonic() < deadline and watch.gone() is None
            time.sleep(0.01)
        assert watch.gone() is None
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        t0 = time.monotonic()
        reason = _wait_gone(watch, 30)
        print(f"store liveness: SIGKILL noticed after {time.monotonic() - t0:.3f} s")
        assert "closed its connection" in reason and str(port) in reason
        watch.stop()
    finally:
        proc.kill()
        proc.wait(30)


def test_store_liveness_silent_peer_counts_as_gone():
    """A host that vanished without closing the connection: the connection attempt (or a probe)
    stays unanswered; past ``unresponsive_s`` the peer counts as gone (a TCPStore client request
    alone would block without any bound)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # accepts (the kernel does), never answers
        watch = StoreLiveness("127.0.0.1", silent.getsockname()[1], unresponsive_s=0.5)
        watch.start()
        reason = _wait_gone(watch, 30)
        assert "did not answer" in reason
        watch.stop()
    watch._thread.join(60)  # the closed socket ends its connection attempt (no thread left at exit)


def test_store_liveness_nothing_listening():
    watch = StoreLiveness("127.0.0.1", free_port(), connect_timeout_s=1.0)
    watch.start()
    assert not watch.wait_connected(30)
    assert "cannot be reached" in _wait_gone(watch, 30) or "did not answer" in watch.gone()
    watch.stop()
    watch._thread.join(60)


def test_stopped_watch_reports_nothing():
    proc = subprocess.Popen([sys.executable, "-c", STORE_HOST], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        watch = StoreLiveness("127.0.0.1", port, interval_s=0.05)
        watch.start()
        assert watch.wait_connected(30)
        watch.stop()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        time.sleep(0.3)
        assert watch.gone() is None  # the manager stopped it (the group was torn down first)
    finally:
        proc.kill()
        proc.wait(30)


def test_abort_ends_a_receive_the_peer_never_sends():
    """gloo does not always report a dead peer: a posted receive can wait for the backend's own
    timeout. ``TransferGroup.abort(reason)`` ends the wait at once and the error names why."""
    port = free_port()
    groups: dict = {}

    def join(rank):
        groups[rank] = TransferGroup.create("gloo", "127.0.0.1", port, rank, 2, 60.0)

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
    from rlserve.transfer.manager import WeightTransferManager

    with pytest.raises(ValueError, match="trainer_liveness"):
        WeightTransferManager(None, {"backend": "gloo", "trainer_liveness": "no"})
