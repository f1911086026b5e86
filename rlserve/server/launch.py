"""Running a server as a subprocess (``rlserve serve``, ``vllm serve``): the pieces every launcher
shares (:class:`rlserve.server.testing.ServerProcess`, :class:`rlserve.demo.DemoServer`,
``benchmarks/vllm_serve.py``'s ``VLLMServer``).

- :func:`spawn_server` starts the command in a session (process group) of its own, output to a
  file (never a pipe that could fill up and block it), and on Linux with ``PR_SET_PDEATHSIG``
  set: the kernel sends the server SIGTERM when the thread that started it ends, so a test run
  or script that is killed (``kill -9``, a CI timeout) does not leave servers behind. SIGTERM
  (not SIGKILL) lets the server stop its own children (engine-core processes, TP followers) as
  on a normal stop.
- :func:`wait_healthy` waits for ``GET /health`` (bounded; fails at once if the process exits).
  Past its timeout it keeps waiting while the server is only starved of CPU (:class:`StartClock`).
- :func:`stop_group` ends the server's whole process group: SIGTERM, SIGKILL after a grace.
- :class:`ServerSubprocess`: the object around them that ``ServerProcess``, ``DemoServer`` and
  ``VLLMServer`` are (environment, log file, ``log_tail``, start-and-wait, ``stop``, ``with``).
- Ports: a server of this process listens on :func:`bound_socket`; an ``rlserve serve``
  subprocess binds ``--port 0`` and its URL is read from its ready line (:func:`ready_url`);
  a program that cannot bind port 0 and say so gets :func:`free_ports` and a restart on new
  ones when its log says :func:`address_in_use` (the SGLang router), or, where the caller
  holds it meanwhile, a :func:`reserved_port`.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable, Iterator, Sequence


class ServerStartError(RuntimeError):
    """The server exited, or was not healthy in time (the message has its log's tail)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to port 0, read it, close).

    Racy by nature: until its user binds it, any process's ``bind(0)`` (a gloo pair, another
    test's server) may take it (``EADDRINUSE`` then). Where the listener is in this process,
    prefer :func:`bound_socket`; for several ports at once, :func:`free_ports`."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports that were free on ``host`` a moment ago (all ``n`` sockets held
    while the ports are picked, so two calls in a row never give one port twice, as two
    :func:`free_port` calls can: the kernel may hand a just-closed port out again)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]


def bound_socket(host: str = "127.0.0.1") -> socket.socket:
    """A TCP socket bound to a port of ``host`` the kernel picked (``getsockname()[1]``), not yet
    listening: hand it to the server that listens on it (uvicorn: ``Server.run(sockets=[sock])``)
    and the port is never free between its choice and its use (no race, unlike
    :func:`free_port`). No ``SO_REUSEADDR``: no other socket can bind the port meanwhile (two
    such sockets could, and the first to listen would win). The caller closes it."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((host, 0))
    except BaseException:
        s.close()
        raise
    return s


#: How many times a launcher that picked a port for another program (which binds it later) picks
#: new ones when that program finds one taken (:func:`address_in_use`): another process's bind
#: in between is rare; three in a row, hardly.
PORT_TRIES = 3


def address_in_use(text: BaseException | str) -> bool:
    """Whether an error (or a log's text) says a bind failed because the port was taken
    (``EADDRINUSE``: "Address already in use" in Python's, Rust's and c10d's words)."""
    t = str(text)
    return "EADDRINUSE" in t or "address already in use" in t.lower()


#: ``rlserve serve``'s ready line (rlserve/cli/serve.py), with the URL it listens on.
_READY = re.compile(r"rlserve: serving .* on (http://\S+) ")


def ready_url(log_text: str, host: str | None = None) -> str | None:
    """The base URL (``http://HOST:PORT``) in ``rlserve serve``'s ready line in ``log_text``, or
    ``None`` before it is printed. With ``--port 0`` this is how a launcher learns the port the
    kernel picked (bound by the server itself: no race). A wildcard host (``0.0.0.0``, ``[::]``)
    becomes ``127.0.0.1``; ``host``, when given, replaces the line's (a node's address)."""
    m = _READY.search(log_text)
    if m is None:
        return None
    url = m.group(1)
    port = url.rsplit(":", 1)[1]
    if host is not None:
        return f"http://{host}:{port}"
    return url.replace("//0.0.0.0:", "//127.0.0.1:").replace("//[::]:", "//127.0.0.1:")


@contextlib.contextmanager
def reserved_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port the kernel picked, reserved while inside: a socket stays bound to it (with
    ``SO_REUSEADDR``, never listening), so no other process's ``bind(0)`` or outgoing connection
    gets it, while a program told to use it that binds with ``SO_REUSEADDR`` (c10d's ``TCPStore``,
    ``rlserve serve``, uvicorn) binds and listens on it as on a free port -- also again after a
    restart, inside the same block. For a port another program binds later: unlike
    :func:`free_port`, it cannot be taken in between. (A program binding without ``SO_REUSEADDR``
    gets ``EADDRINUSE``; two of them told the same port: the first to listen wins.)"""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        yield s.getsockname()[1]
    finally:
        s.close()


def _prctl():
    """libc's ``prctl`` (Linux), loaded in the parent: the child between fork and exec must not
    import or load anything (another thread may have held the import lock at the fork)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def parent_death_signal(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel send ``sig`` to the child when the thread that
    started it ends (Linux ``PR_SET_PDEATHSIG``; it survives the exec). ``None`` where there is
    no ``prctl`` (not Linux). Best effort: the launchers' ``stop`` still ends the group on a
    normal exit."""
    prctl = _prctl()
    if prctl is None:
        return None

    parent = os.getpid()

    def preexec() -> None:
        prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
        if os.getppid() != parent:  # the parent died before the line above: no signal will come
            os._exit(1)

    return preexec


def spawn_server(cmd: Sequence[str], log_path: str | None, env: dict | None = None,
                 cwd: str | None = None) -> tuple[subprocess.Popen, object]:
    """Start ``cmd`` in a new session with stdin closed and stdout + stderr to ``log_path``
    (``None``: this terminal), SIGTERMed by the kernel if the calling thread ends first
    (:func:`parent_death_signal`), in directory ``cwd`` (default: this one; ``python -m`` imports
    from there first). Start it from a thread that lives as long as the server
    should (the main thread, normally). Returns ``(proc, log file)``; close the file after the
    process ended (``None`` for the terminal)."""
    log = open(log_path, "w") if log_path is not None else None
    try:
        proc = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT if log is not None else None, env=env, cwd=cwd,
                                start_new_session=True, preexec_fn=parent_death_signal())
    except BaseException:
        if log is not None:
            log.close()
        raise
    return proc, log


#: a start that ran past its timeout fails once its processes used this share of one core over
#: the timeout (``rlserve serve`` of a tiny model on the CPU: ~13 CPU-s to healthy; at load 40-60
#: on 2 cores a process gets ~0.04 of a core, ~330 s wall for those 13 s: session 16's
#: "not healthy within 180 s" failures, with an empty log, were starved starts, not hangs)
STARVED_SHARE = 0.25
#: seconds without any CPU used by the server's processes, past the timeout: a hang that sleeps
STALL_S = 60.0
#: the wait never runs past ``timeout_s`` times this (seconds)
MAX_STRETCH = 10.0


def tree_cpu_by_process(pid: int) -> dict[str, float]:
    """User + system CPU seconds of process ``pid`` and each live descendant, by ``"<pid> <name>"``
    (from ``/proc/*/stat``; children already exited and reaped count through their parent's
    ``cutime`` / ``cstime``). Empty without ``/proc`` or when ``pid`` is gone."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    kids: dict[int, list[int]] = {}
    stats: dict[int, tuple[str, float]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return {}
    for d in names:
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                head, rest = f.read().rsplit(")", 1)
            fields = rest.split()
            stats[int(d)] = (head.split("(", 1)[1], sum(int(x) for x in fields[11:15]) / tick)  # utime stime cutime cstime
            kids.setdefault(int(fields[1]), []).append(int(d))
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        if p in stats:
            out[f"{p} {stats[p][0]}"] = stats[p][1]
        todo.extend(kids.get(p, ()))
    return out


def tree_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` and its descendants (children they reaped
    included; :func:`tree_cpu_by_process` summed); None without ``/proc`` or when ``pid`` is gone."""
    per = tree_cpu_by_process(pid)
    return sum(per.values()) if per else None


class StartClock:
    """When a server's start has failed for time (:func:`wait_healthy`). Before ``timeout_s``
    wall seconds: never. After it (reading the CPU its process tree used, at most once a second):
    when that CPU reached :data:`STARVED_SHARE` x ``timeout_s`` (the start had its share of the
    machine: a spin or a start far slower than it should be), when it used no CPU for
    :data:`STALL_S` seconds (a hang that sleeps), or at :data:`MAX_STRETCH` x ``timeout_s``.
    Without ``/proc``: at ``timeout_s``. ``cpu`` and ``clock`` are injectable for tests."""

    def __init__(self, pid: int, timeout_s: float, cpu: Callable[[int], float | None] = tree_cpu_seconds,
                 clock: Callable[[], float] = time.monotonic):
        self.pid, self.timeout_s, self.cpu, self.clock = pid, float(timeout_s), cpu, clock
        self.t0 = clock()
        self._seen: tuple[float, float] | None = None  # (CPU seconds, when they last grew)
        self._next_read = 0.0

    def expired(self) -> str | None:
        """None while the wait goes on, else why it ends (for the error message)."""
        now = self.clock()
        wall = now - self.t0
        if wall <= self.timeout_s:
            return None
        late = f"within {self.timeout_s:.0f} s"
        if wall > self.timeout_s * MAX_STRETCH:
            return f"{late} (nor within {wall:.0f} s of a starved start)"
        if now < self._next_read:
            return None
        self._next_read = now + 1.0
        used = self.cpu(self.pid)
        if used is None:
            return late
        if self._seen is None or used > self._seen[0]:
            self._seen = (used, now)
        if used >= STARVED_SHARE * self.timeout_s:
            return f"{late} ({wall:.0f} s; its processes used {used:.1f} s of CPU: not a starved start)"
        if now - self._seen[1] >= STALL_S:
            return f"{late} ({wall:.0f} s; its processes used no CPU for {STALL_S:.0f} s: hung)"
        return None


def wait_healthy(proc: subprocess.Popen, url: str | Callable[[], str | None], timeout_s: float,
                 log_tail: Callable[[], str], what: str = "the server", poll_s: float = 0.1,
                 error: type[Exception] = ServerStartError) -> float:
    """Block until ``GET {url}/health`` answers 200; return the seconds waited.

    Args:
        url: the base URL, or a function giving it once known (``None`` until then: e.g. read
            from the server's ready line when it bound port 0).
        timeout_s: the bound on the wait (seconds) on a machine that gives the server its share
            of CPU; a starved start gets longer (:class:`StartClock`).
        log_tail: gives the end of the server's log, for the error messages.
        error: the exception class raised (the caller's own ``ServerStartError``).

    Raises:
        error: as soon as the process exits, or when :class:`StartClock` says the start failed.
    """
    import httpx

    t0 = time.monotonic()
    clock = StartClock(proc.pid, timeout_s)
    while True:
        rc = proc.poll()
        if rc is not None:
            raise error(f"{what} exited with status {rc} before it was ready; its log ends with:\n{log_tail()}")
        base = url() if callable(url) else url
        if base is not None:
            try:
                if httpx.get(base.rstrip("/") + "/health", timeout=5).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
        why = clock.expired()
        if why is not None:
            raise error(f"{what} was not healthy {why}; its log ends with:\n{log_tail()}")
        time.sleep(poll_s)


def killpg(pgid: int, sig: int) -> None:
    """``os.killpg`` that ignores a group that is gone (or not ours)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop_group(proc: subprocess.Popen | None, grace_s: float = 15.0) -> int | None:
    """Stop a process started by :func:`spawn_server` and everything left in its process group:
    SIGTERM, SIGKILL after ``grace_s``, then SIGKILL to the group's stragglers. Idempotent;
    returns the exit status (``None`` if it never started)."""
    if proc is None:
        return None
    pgid = proc.pid  # a new session: the server leads its own group
    if proc.poll() is None:
        killpg(pgid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            killpg(pgid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
    killpg(pgid, signal.SIGKILL)  # stragglers of the group
    return proc.returncode


class ServerSubprocess:
    """A server process started by :func:`spawn_server` and stopped by :func:`stop_group`: the
    part :class:`rlserve.server.testing.ServerProcess`, :class:`rlserve.demo.DemoServer` and
    ``benchmarks/vllm_serve.py``'s ``VLLMServer`` share. A subclass's ``start()`` calls
    :meth:`_spawn` with its command line (:meth:`_spawn_and_wait` to also wait for health) and
    returns ``self``; ``with`` starts it and stops it at the end.

    Args:
        env: extra environment variables, over this process's (``PYTHONUNBUFFERED=1`` unless given).
        log_path: the file for the server's stdout + stderr; ``"-"``: this terminal; ``None``: a new
            file ``<log_prefix>*.log`` in the temporary directory (kept after the stop: its path
            and tail go into the errors).
        startup_timeout_s: the bound on the wait for ``/health`` (seconds), for the subclass's wait.

    Attributes:
        proc: the ``subprocess.Popen`` once started, else ``None``.
        log_path, env, startup_timeout_s: as given (``env`` merged).
    """

    def __init__(self, env: dict | None = None, log_path: str | None = None, startup_timeout_s: float = 600.0,
                 log_prefix: str = "rlserve-server-"):
        self.env = dict(os.environ, **(env or {}))
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.startup_timeout_s = float(startup_timeout_s)
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix=log_prefix, suffix=".log")
            os.close(fd)
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self._log_file = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def log_tail(self, n_chars: int = 4000) -> str:
        """The last ``n_chars`` characters of the server's log (``""`` if it cannot be read)."""
        if self.log_path == "-":
            return "(server output went to the terminal above)"
        try:
            with open(self.log_path, errors="replace") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - n_chars))
                return f.read()
        except OSError:
            return ""

    def ready_url(self, host: str | None = None) -> str | None:
        """:func:`ready_url` of this server's log (``None`` until the line is there; never for a
        server writing to the terminal)."""
        if self.log_path == "-":
            return None
        return ready_url(self.log_tail(1_000_000), host)

    def _spawn(self, cmd: Sequence[str]) -> None:
        """Start ``cmd`` (:func:`spawn_server`); returns at once."""
        self.proc, self._log_file = spawn_server(cmd, None if self.log_path == "-" else self.log_path, self.env)

    def _spawn_and_wait(self, cmd: Sequence[str], url: str | Callable[[], str | None], what: str,
                        error: type[Exception] = ServerStartError, poll_s: float = 0.1) -> float:
        """:meth:`_spawn` ``cmd``, then :func:`wait_healthy` on ``url`` (bounded by
        ``startup_timeout_s``); on any failure the process group is stopped before the error
        propagates. Returns the seconds waited.

        Raises:
            error: the process exited, or was not healthy in time (its log's tail in the message).
        """
        self._spawn(cmd)
        try:
            return wait_healthy(self.proc, url, self.startup_timeout_s, self.log_tail, what=what, poll_s=poll_s,
                                error=error)
        except BaseException:
            self.stop()
            raise

    def start(self) -> "ServerSubprocess":
        raise NotImplementedError

    def stop(self, grace_s: float = 15.0) -> int | None:
        """Stop the server and everything in its process group (its engine cores, TP followers):
        SIGTERM, SIGKILL after ``grace_s`` seconds (:func:`stop_group`). Idempotent; returns the
        exit status (``None`` if it never started)."""
        rc = stop_group(self.proc, grace_s)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return rc

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
