"""The demo's ``rlserve serve`` subprocess (:class:`DemoServer`: own session, bounded /health wait,
killed as a group; built on :mod:`rlserve.server.launch`) and the signal handling around it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Iterator, Sequence

from rlserve.demo.common import ServerStartError
from rlserve.demo.layout import Layout
from rlserve.server.launch import spawn_server, stop_group, wait_healthy


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


class DemoServer:
    """An ``rlserve serve`` subprocess in its own session, killed as a group.

    Args:
        cmd: the command line (:func:`serve_command`).
        url: the base URL it will answer on (``http://127.0.0.1:PORT``).
        env: extra environment variables.
        log_path: file for the server's stdout+stderr; ``"-"`` = this terminal; ``None`` = a
            new file ``rlserve-demo-server-*.log`` in the temporary directory (kept: its path is
            printed, and its tail is part of every error).
        startup_timeout_s: bound on the wait for ``/health``.
    """

    def __init__(self, cmd: list[str], url: str, env: dict | None = None, log_path: str | None = None,
                 startup_timeout_s: float = 600.0):
        self.cmd = list(cmd)
        self.url = url.rstrip("/")
        self.env = dict(os.environ, **(env or {}))
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.startup_timeout_s = float(startup_timeout_s)
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="rlserve-demo-server-", suffix=".log")
            os.close(fd)
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self._log_file = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def log_tail(self, n_chars: int = 4000) -> str:
        if self.log_path == "-":
            return "(server output went to the terminal above)"
        try:
            with open(self.log_path, errors="replace") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - n_chars))
                return f.read()
        except OSError:
            return ""

    def start(self) -> "DemoServer":
        """Spawn the process (returns at once; :meth:`wait_healthy` waits)."""
        self.proc, self._log_file = spawn_server(self.cmd, None if self.log_path == "-" else self.log_path, self.env)
        return self

    def wait_healthy(self, poll_s: float = 0.25) -> float:
        """Block until ``GET /health`` answers 200; return the seconds waited. Raises
        :class:`ServerStartError` as soon as the process exits, or after ``startup_timeout_s``."""
        assert self.proc is not None, "start() first"
        return wait_healthy(self.proc, self.url, self.startup_timeout_s, self.log_tail, poll_s=poll_s,
                            what=f"the server (log {self.log_path})", error=ServerStartError)

    def stop(self, grace_s: float = 15.0) -> int | None:
        """Stop the server and everything in its process group (TP workers included):
        SIGTERM, SIGKILL after ``grace_s``. Idempotent; returns the exit status."""
        rc = stop_group(self.proc, grace_s)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return rc

    def __enter__(self) -> "DemoServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


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


