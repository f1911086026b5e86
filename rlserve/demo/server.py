"""The demo's ``rlserve serve`` subprocess (:class:`DemoServer`: own session, bounded /health wait,
killed as a group; built on :mod:`rlserve.server.launch`) and the signal handling around it."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
from typing import Iterator, Sequence

from rlserve.demo.common import ServerStartError
from rlserve.demo.layout import Layout
from rlserve.proc_state import pid_alive  # noqa: F401 (rlserve.demo exports it)
from rlserve.server.launch import ServerSubprocess, wait_healthy


def serve_command(model: str, layout: Layout, port: int, host: str = "127.0.0.1",
                  quantization: str | None = None, extra_args: Sequence[str] = ()) -> list[str]:
    """The ``python -m rlserve serve`` command line of a demo server (dummy weights, weight sync on)."""
    cmd = [sys.executable, "-m", "rlserve", "serve", model, "--host", host, "--port", str(port),
           "--load-format", "dummy", "--weight-transfer-config", json.dumps({"backend": layout.backend}),
           "--dtype", layout.dtype, "--device", layout.server_device, "--disable-access-log"]
    if layout.server_device_ids:
        cmd += ["--device-ids", ",".join(map(str, layout.server_device_ids))]
    if layout.tensor_parallel_size > 1:
        cmd += ["--tensor-parallel-size", str(layout.tensor_parallel_size)]
    if quantization:
        cmd += ["--quantization", quantization]
    return cmd + list(extra_args)


class DemoServer(ServerSubprocess):
    """An ``rlserve serve`` subprocess in its own session, killed as a group
    (:class:`~rlserve.server.launch.ServerSubprocess`: ``log_tail``, ``stop``, ``with``).

    Args:
        cmd: the command line (:func:`serve_command`).
        url: the base URL it will answer on (``http://127.0.0.1:PORT``); ``None``: ``cmd`` is an
            ``rlserve serve`` with ``--port 0``, which binds a port the kernel picks (no other
            process can take it first, as one picked here and bound there can be), and the URL
            is read from its ready line (:meth:`ready_url`) by :meth:`wait_healthy`. Needs a log
            file (not ``"-"``).
        env: extra environment variables.
        log_path: file for the server's stdout+stderr; ``"-"`` = this terminal; ``None`` = a
            new file ``rlserve-demo-server-*.log`` in the temporary directory (kept: its path is
            printed, and its tail is part of every error).
        startup_timeout_s: bound on the wait for ``/health``.
        url_host: (``url=None``) the host of the URL in place of the ready line's (a node's
            address where the server binds ``0.0.0.0``).

    Attributes:
        url: the base URL; ``None`` until :meth:`wait_healthy` read it when ``url`` was ``None``.

    Raises:
        ValueError: ``url=None`` with ``log_path="-"`` (the ready line would go to the terminal).
    """

    def __init__(self, cmd: list[str], url: str | None = None, env: dict | None = None,
                 log_path: str | None = None, startup_timeout_s: float = 600.0, url_host: str | None = None):
        if url is None and log_path == "-":
            raise ValueError("a server on --port 0 needs a log file: its port is read from its ready line")
        super().__init__(env, log_path, startup_timeout_s, log_prefix="rlserve-demo-server-")
        self.cmd = list(cmd)
        self.url = url.rstrip("/") if url is not None else None
        self.url_host = url_host

    def _url(self) -> str | None:
        if self.url is None:
            self.url = self.ready_url(self.url_host)
        return self.url

    def start(self) -> "DemoServer":
        """Spawn the process (returns at once; :meth:`wait_healthy` waits)."""
        self._spawn(self.cmd)
        return self

    def wait_healthy(self, poll_s: float = 0.25) -> float:
        """Block until ``GET /health`` answers 200; return the seconds waited. Raises
        :class:`ServerStartError` as soon as the process exits, or after ``startup_timeout_s``."""
        assert self.proc is not None, "start() first"
        return wait_healthy(self.proc, self._url, self.startup_timeout_s, self.log_tail, poll_s=poll_s,
                            what=f"the server (log {self.log_path})", error=ServerStartError)


@contextlib.contextmanager
def exit_on_signals(signals: Sequence[int] = (signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """Turn SIGTERM/SIGHUP into ``SystemExit(128 + signum)`` while inside (SIGINT already raises
    ``KeyboardInterrupt``), so ``finally`` blocks (server shutdown) run. Main thread only;
    elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, _frame):
        raise SystemExit(128 + signum)

    old = {}
    for s in signals:
        with contextlib.suppress(ValueError, OSError):
            old[s] = signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in old.items():
            with contextlib.suppress(ValueError, OSError):
                signal.signal(s, h)


