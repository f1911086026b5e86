"""No port race in the transfer group's rendezvous (tests/README.md, "Ports").

- The trainer SDK (``master_port=0``, the default) hosts its ``TCPStore`` before the server hears
  of the port: the port is listening when ``/init_weight_transfer_engine`` is sent.
- TRL's protocol, where the server binds the port the trainer names: ``TRLWeightSyncClient``
  with ``group_port=0`` picks another port when the server reports ``EADDRINUSE``. The retry is
  forced here: the test holds the first port it hands out (bound, not listening: the server's
  bind fails, a connect is refused), so the first try fails on every run, never by chance.
- The SGLang router (it binds ports picked for it): started again on new ones, forced the same way.
- Launchers of ``rlserve serve`` read the port it bound (``--port 0``) from its ready line; a port
  another program binds later is reserved meanwhile (``reserved_port``: its premise).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading

import httpx
import pytest
import torch

from rlserve.server.launch import address_in_use, bound_socket, free_port, reserved_port
from rlserve.transfer import GlooTrainerInitInfo, ModuleSource, WeightTransferTrainerFactory
from rlserve.transfer.backends.group import TransferGroup
from rlserve.transfer.sdk.init_info import _port_in_use
from tests.transfer_harness import InProcessServer, wait_for_state
from tests.transfer_sync import PROMPT_IDS, hf_greedy, llama, server_greedy  # noqa: F401 (llama: a fixture)

T = 60.0


class _ServerStandIn:
    """The part of ``HTTPWeightSyncClient`` a ``GroupTrainerEngine`` init uses, played by the test:
    its ``init_weight_transfer_engine`` records whether the trainer's store already listens on the
    announced port, then joins the group as the server's one worker (rank 1) on that port."""

    def __init__(self):
        self.session = None
        self.seen: list[tuple[int, bool]] = []
        self.groups: list[TransferGroup] = []

    def init_weight_transfer_engine(self, init_info: dict, timeout_s: float | None = None) -> dict:
        port = init_info["master_port"]
        self.seen.append((port, _port_in_use(port)))
        self.groups.append(TransferGroup.create("gloo", "127.0.0.1", port, 1, 2, T, session=init_info["session"]))
        return {"ok": True}

    def shutdown_weight_transfer_engine(self) -> dict:
        for g in self.groups:
            g.destroy(wait_s=5.0)
        return {}


def test_sdk_store_listens_before_the_server_is_told():
    """The old SDK picked ``_free_port()`` (closed again) and sent it while its rendezvous thread
    bound it: at the HTTP call the port was free, and another process could take it."""
    stand_in = _ServerStandIn()
    info = GlooTrainerInitInfo(world_size=2, timeout_s=T)
    eng = WeightTransferTrainerFactory.trainer_init(info, client=stand_in, source=ModuleSource(torch.nn.Linear(2, 2)))
    try:
        (port, listening), = stand_in.seen
        assert listening, f"the trainer's store was not listening on {port} when the server was told"
        assert info.master_port == port == eng.group.master_port and eng.group.alive
        eng.reinit()  # a re-init hosts a new store, listening before it is announced too
        assert len(stand_in.seen) == 2 and stand_in.seen[1][1], stand_in.seen
        assert info.master_port == stand_in.seen[1][0] == eng.group.master_port
    finally:
        eng.shutdown()


@contextlib.contextmanager
def _taken_port(holder: str):
    """A port "another process" holds: ``bound`` (not listening: connections are refused) or
    ``listening`` (what accepts a connection closes it at once: not a TCPStore). Either way a
    server's bind of it fails with ``EADDRINUSE``."""
    held = bound_socket()
    stop = threading.Event()
    th = None
    if holder == "listening":
        held.listen()
        held.settimeout(0.1)

        def refuse():
            while not stop.is_set():
                try:
                    held.accept()[0].close()
                except OSError:  # (the accept's timeout: look at stop again)
                    pass

        th = threading.Thread(target=refuse, daemon=True)
        th.start()
    try:
        yield held.getsockname()[1]
    finally:
        stop.set()
        if th is not None:
            th.join(T)
        held.close()


@pytest.mark.parametrize("holder", ["bound", "listening"])
def test_trl_client_retries_a_port_the_server_could_not_bind(llama, monkeypatch, caplog, holder):  # noqa: F811
    """``bound``: the client sees nothing listen and the server's EADDRINUSE first; ``listening``:
    its join fails on the foreign listener first, then the server's verdict says why."""
    from rlserve.transfer.sdk import trl

    path, hf = llama
    picks: list[int] = []
    with _taken_port(holder) as taken, \
            InProcessServer(path, transfer_config={"backend": "gloo", "timeout_s": T}) as srv, \
            caplog.at_level(logging.WARNING, logger=trl.__name__):
        monkeypatch.setattr(trl, "free_port", lambda host="127.0.0.1": picks.append(
            taken if not picks else free_port(host)) or picks[-1])
        c = trl.TRLWeightSyncClient(srv.url, group_port=0, timeout_s=T)
        c.init_communicator()
        assert len(picks) == 2 and picks[0] == taken and c.group_port == picks[1] != taken, picks
        warned = [r.getMessage() for r in caplog.records if r.name == trl.__name__]
        assert len(warned) == 1 and f"port {taken}" in warned[0] and "try 2 of 3" in warned[0], warned
        assert "in use" in warned[0].lower(), warned  # the server's own EADDRINUSE, quoted
        wait_for_state(srv.url, "ready", T)  # (the server's side of the rendezvous ends after this one's)
        info = httpx.get(srv.url + "/weight_info", timeout=T).json()
        assert info["init_info"]["master_port"] == c.group_port, info
        c.update_model_params(hf)
        c.reset_prefix_cache()
        assert server_greedy(srv.url).json()["completion_ids"] == [hf_greedy(hf, p) for p in PROMPT_IDS]
        c.close_communicator()


def test_trl_client_given_a_taken_port_says_so(llama):  # noqa: F811
    """A port given (not 0) is not replaced: the init fails with the server's reason, and the
    server is back to ``uninitialized`` (a later init on a free port works)."""
    from rlserve.transfer.sdk import trl

    path, _hf = llama
    held = bound_socket()
    try:
        with InProcessServer(path, transfer_config={"backend": "gloo", "timeout_s": T}) as srv:
            c = trl.TRLWeightSyncClient(srv.url, group_port=held.getsockname()[1], timeout_s=T)
            with pytest.raises(trl.PortTakenError) as ei:
                c.init_communicator()
            assert f"port {held.getsockname()[1]}" in str(ei.value) and c.group is None, ei.value
            assert httpx.get(srv.url + "/weight_info", timeout=T).json()["state"] == "uninitialized"
    finally:
        held.close()


def test_held_socket_refuses_connections():
    """The premise of the tests above: a bound socket that does not listen reserves its port (no
    bind, even with ``SO_REUSEADDR``) and refuses connections (nothing answers there)."""
    held = bound_socket()
    try:
        port = held.getsockname()[1]
        assert _port_in_use(port)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=T).close()
    finally:
        held.close()


def test_reserved_port_takes_its_users_bind_and_no_one_elses():
    """The ``reserve_port`` fixture's premise (``launch.reserved_port``): a plain bind of the port
    fails while it is reserved, before, during and after its user (a ``TCPStore``, which binds with
    ``SO_REUSEADDR``) listens on it; the user's bind works, also a second time."""
    import datetime

    import torch.distributed as dist

    def plain_bind_refused(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError as e:
                return address_in_use(e)
        return False

    with reserved_port() as port:
        assert plain_bind_refused(port)
        for _ in range(2):
            store = dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=T), wait_for_workers=False)
            client = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=T))
            client.set("k", "v")
            assert store.get("k") == b"v" and store.port == port
            assert plain_bind_refused(port)
            del client, store
        assert plain_bind_refused(port)


def test_ready_url_reads_the_port_the_server_bound():
    """``rlserve serve --port 0`` names its port in its ready line (rlserve/cli/serve.py's format);
    launchers (DemoServer with ``url=None``, LocalServers, the Ray launcher) read it from there."""
    from rlserve.demo import DemoServer
    from rlserve.server.launch import ready_url

    line = ("rlserve: serving '/m' as 'm' on http://0.0.0.0:41234 (OpenAI API at http://0.0.0.0:41234/v1, "
            "weight version 0)\n")
    assert ready_url("starting\n") is None
    assert ready_url("starting\n" + line) == "http://127.0.0.1:41234"
    assert ready_url(line, host="10.1.2.3") == "http://10.1.2.3:41234"
    assert ready_url(line.replace("0.0.0.0", "[::]")) == "http://127.0.0.1:41234"
    assert ready_url(line.replace("0.0.0.0", "192.168.0.7")) == "http://192.168.0.7:41234"
    with pytest.raises(ValueError, match="needs a log file"):
        DemoServer(["x"], None, log_path="-")


def test_router_starts_again_on_new_ports_when_one_was_taken(monkeypatch, caplog):
    """The SGLang router binds ports picked for it; the first pick is taken on purpose (a socket
    this test holds), so its first start fails with EADDRINUSE on every run and the second, on
    new ports, serves."""
    from rlserve.scaleout import router as rt

    why = rt.router_available()
    if why is not None:
        pytest.skip(why)
    held = bound_socket()
    taken = held.getsockname()[1]
    picks: list[list[int]] = []

    def pick(n: int, host: str = "127.0.0.1") -> list[int]:
        got = real(n, host)
        if not picks:
            got[-1] = taken  # the router's own port (the metrics port stays a free one)
        picks.append(list(got))
        return got

    real = rt.free_ports
    monkeypatch.setattr(rt, "free_ports", pick)
    try:
        with caplog.at_level(logging.WARNING, logger=rt.__name__), rt.SGLangRouter([], startup_timeout_s=T) as r:
            assert len(picks) == 2 and picks[0][-1] == taken and r.port == picks[1][-1] != taken, picks
            warned = [x.getMessage() for x in caplog.records if x.name == rt.__name__]
            assert len(warned) == 1 and f"port {taken}" in warned[0] and "try 2 of 3" in warned[0], warned
            assert r.workers() == [] and httpx.get(r.url + "/health", timeout=T).status_code == 200
    finally:
        held.close()
