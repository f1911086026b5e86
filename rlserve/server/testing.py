"""Start a real ``rlserve serve`` process for tests and examples.

    with ServerProcess(model_dir, "--max-num-seqs", "32") as srv:
        requests.get(srv.url + "/health")

The server binds ``--port 0`` (a free port picked by the OS, so parallel tests never
collide) and the URL is read from its ready line. Its output goes to a log file (never a
pipe that could fill up and block it); the log's tail is included in every error.
Every wait is bounded.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import httpx

_READY = re.compile(r"rlserve: serving .* on (http://\S+) ")


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time (the message has its log)."""


class ServerProcess:
    """A ``python -m rlserve serve MODEL ...`` subprocess.

    Args:
        model: model directory.
        *args: extra CLI flags.
        startup_timeout_s: seconds to wait for the ready line and ``/health`` (default 180).
        env: extra environment variables.
        launcher: the interpreter arguments that run the CLI, before ``serve`` (default
            ``("-m", "rlserve")``); e.g. ``("-c", code)`` where ``code`` patches something and
            then calls :func:`rlserve.cli.main` (``sys.argv[1:]`` holds ``serve MODEL ...``).

    Attributes:
        url: ``http://127.0.0.1:PORT`` once started (a wildcard bind is reached on 127.0.0.1).
        proc: the ``subprocess.Popen``.
        log_path: the server's stdout+stderr.
    """

    def __init__(self, model: str, *args: str, startup_timeout_s: float = 180.0, env: dict | None = None,
                 launcher: tuple[str, ...] = ("-m", "rlserve")):
        self.model = model
        self.launcher = tuple(launcher)
        self.args = [str(a) for a in args]
        self.startup_timeout_s = startup_timeout_s
        self.env = dict(os.environ, **(env or {}))
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.url: str | None = None
        self.proc: subprocess.Popen | None = None
        fd, self.log_path = tempfile.mkstemp(prefix="rlserve-server-", suffix=".log")
        os.close(fd)

    def log_tail(self, n_chars: int = 4000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n_chars:]
        except OSError:
            return ""

    def start(self) -> "ServerProcess":
        cmd = [sys.executable, *self.launcher, "serve", self.model, "--port", "0", *self.args]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            m = _READY.search(self.log_tail(1_000_000))
            if m:
                url = m.group(1)
                url = url.replace("//0.0.0.0:", "//127.0.0.1:").replace("//[::]:", "//127.0.0.1:")
                self.url = url
                break
            time.sleep(0.1)
        else:
            self.stop()
            raise ServerStartError(f"no ready line within {self.startup_timeout_s}s:\n{self.log_tail()}")
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise ServerStartError(f"/health not OK within {self.startup_timeout_s}s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
