"""rlserve.transfer.wire.store_probe.probe_store against each kind of listener (session 22, FIX item 1): a real
``TCPStore`` passes (the probe speaks torch 2.13's handshake: if it did not, this store would not answer the nonce),
one that never answers / closes / answers other bytes is ``TrainerUnreachableError`` naming the address, nothing
listening is ``TransferTimeoutError`` naming it; the store still serves its own client after a probe."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from rlserve.transfer.errors import TrainerUnreachableError, TransferTimeoutError
from rlserve.transfer.wire.store_probe import probe_store
from tests.transfer_harness import listening_port


def _refusal(error: type, port: int, timeout_s: float) -> str:
    """The message of ``error``, which probing ``127.0.0.1:port`` for ``timeout_s`` seconds must raise."""
    with pytest.raises(error) as e:
        probe_store("127.0.0.1", port, timeout_s, "rank 1/2, gloo")
    return str(e.value)


def test_a_tcpstore_answers_and_keeps_serving():
    master = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    probe_store("127.0.0.1", master.port, 10, "rank 1/2, gloo")
    master.set("k", "v")
    client = dist.TCPStore("127.0.0.1", master.port, None, False, timedelta(seconds=10), wait_for_workers=False)
    assert client.get("k") == b"v"


@pytest.mark.parametrize("answer, words", [
    (lambda c: None,  # holds the connection, silent, until the test is over
     "the listener there took the connection but sent 0 of the 4 bytes of a TCPStore handshake answer within 1 s"),
    (lambda c: (c.recv(64), c.close()),  # read first: a close with unread bytes would be a reset
     "the listener there closed the connection after 0 bytes of an answer"),
    (lambda c: (c.recv(64), c.sendall(b"HTTP/1.0 400 Bad\r\n\r\n"), c.close()),
     "the listener there answered 48545450, not a TCPStore's handshake answer"),
])
def test_a_listener_that_is_not_a_store_is_named(answer, words):
    with listening_port(answer) as port:
        msg = _refusal(TrainerUnreachableError, port, 1)
    assert msg.startswith(f"could not connect to the transfer group's TCPStore at 127.0.0.1:{port} "
                          f"(rank 1/2, gloo): {words}"), msg


def test_nothing_listening_is_a_timeout_naming_the_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        msg = _refusal(TransferTimeoutError, port, 0.5)
    assert msg.startswith(f"nothing took a connection to the transfer group's TCPStore at 127.0.0.1:{port} "
                          "(rank 1/2, gloo) within 0.5 s (timeout_s; last: "), msg
