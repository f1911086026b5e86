"""Start a real ``rlserve serve`` process for tests and examples.

    with ServerProcess(model_dir, "--max-num-seqs", "32") as srv:
        requests.get(srv.url + "/health")

The server binds ``--port 0`` (a free port picked by the OS, so parallel tests never
collide) and the URL is read from its ready line. Its output goes to a log file (never a
pipe that could fill up and block it); the log's tail is included in every error.
Every wait is bounded. It never outlives this process (:mod:`rlserve.server.launch`).
"""

from __future__ import annotations

import sys

from rlserve.server.launch import ServerStartError, ServerSubprocess

__all__ = ["ServerProcess", "ServerStartError"]


class ServerProcess(ServerSubprocess):
    """A ``python -m rlserve serve MODEL ...`` subprocess.

    Started by :func:`rlserve.server.launch.spawn_server`: its own session (``stop`` ends its
    process group), output to a log file, and on Linux SIGTERMed by the kernel when the thread
    that started it ends -- a test run killed with ``kill -9`` leaves no server behind (start it
    from a thread that outlives it: the main thread, normally).

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

    Raises (start):
        ServerStartError: the process exited, or was not healthy within ``startup_timeout_s``
            (the log's tail is in the message).
    """

    def __init__(self, model: str, *args: str, startup_timeout_s: float = 180.0, env: dict | None = None,
                 launcher: tuple[str, ...] = ("-m", "rlserve")):
        super().__init__(env, None, startup_timeout_s, log_prefix="rlserve-server-")
        self.model = model
        self.launcher = tuple(launcher)
        self.args = [str(a) for a in args]
        self.url: str | None = None

    def _ready_url(self) -> str | None:
        """The URL of the ready line (``--port 0``: the OS picked the port), once printed."""
        if self.url is None:
            self.url = self.ready_url()
        return self.url

    def start(self) -> "ServerProcess":
        self._spawn_and_wait([sys.executable, *self.launcher, "serve", self.model, "--port", "0", *self.args],
                             self._ready_url, "rlserve serve")
        return self
