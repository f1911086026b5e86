"""``rlserve serve --api-server-count N`` (vLLM's flag): N API processes serve one listening socket
over the same engine cores.

Topology (vLLM's, with one difference: its parent is a manager, rlserve's is API process 0):

* **API process 0** is the ``rlserve serve`` process. It binds the listening socket, starts the
  engine cores (each told the input / output addresses of every API process,
  :mod:`rlserve.engine.core.core_proc`) and, right after (before the cores are ready: as vLLM starts
  its API servers beside ``launch_core_engines``), processes 1..N-1 (:class:`APIServerProcessManager`)
  with the socket (an inherited file descriptor) and the cores' socket directories
  (``RLSERVE_API_SERVER_ATTACH``, JSON); then it waits for its cores and builds its app while they
  import, check and load their tokenizer (until session 25 they started only once process 0's engine
  was ready and its app built). On the shared 2-core CPU machine at load 6-9 the start-up did not get
  measurably shorter (BENCHMARKS.md, start-up, T11: every process's start is CPU-bound there, two
  chat-template workers per API process included); the overlap pays where cores are idle meanwhile. It owns every control state --
  ``WeightState`` (weights valid / lost, the version label), the ``WeightTransferManager`` (transfer
  group, update sessions), pause and held requests, sleep, the prefix cache -- and serves its app a
  second time on a private unix socket (``control.sock`` in its first core's socket directory, mode
  0700) for the other processes.
* **API processes 1..N-1** run the same command (the same flags: the same checks, tokenizer,
  chat template, defaults) with ``RLSERVE_API_SERVER_ATTACH`` set: they attach to the cores
  (:class:`~rlserve.engine.front.core_attach.AttachedCoreReplica`, one per data-parallel replica), accept connections on the shared
  socket (the kernel hands each new connection to one of the N processes) and serve generation
  themselves. Every control route (:data:`CONTROL_PATHS`: weight sync, pause / resume, sleep / wake,
  reset_prefix_cache, abort_requests, and the routes that report that state) is forwarded as is
  -- method, path, query, headers (the key included: process 0 checks it), body -- to process 0
  over the unix socket (:class:`ForwardControl`), and its answer returned (and logged there, once:
  :class:`ControlSocketAccessFilter`). Process 0's admission
  decisions (held by a pause, 503 while asleep or with lost weights) reach them through the cores
  (:mod:`rlserve.engine.front.front_sync`), acked before a pause acts on the cores.
* **Refused with N > 1** (a startup error): ``--enable-lora`` (adapters loaded at run time live in
  process 0's registry; vLLM 0.32 refuses runtime LoRA updating with ``api_server_count > 1`` too),
  ``--engine-mode thread``. Engine-core restarts are off (``--max-engine-restarts`` is taken as 0): a core that dies leaves every process answering 503.
* **Start-up and** ``/health``: each process serves (and its ``/health`` answers 200, as vLLM's: the
  engine client is up and its cores alive) once its cores sent it their ready message and its app
  started, so any process that answers can serve generation; a process that does not serve yet does
  not accept connections (the kernel hands them to those that do). ``rlserve: serving ...`` (the ready
  line) comes once all N serve.
* **Logs**: every line of API process ``i`` starts ``(ApiServer_i pid=P)`` (vLLM's names; uvicorn's lines
  too): :mod:`rlserve.server.log_prefix`.
* **Lifetime**: a process 1..N-1 that exits while the server runs stops the server (process 0
  logs which one and how it ended, stops the others and its cores, exits 1). SIGINT / SIGTERM to
  process 0 stops processes 1..N-1 first (SIGTERM, SIGKILL after :data:`STOP_GRACE_S`), then its
  cores. Processes 1..N-1 get SIGTERM from the kernel when process 0 dies (``PR_SET_PDEATHSIG``),
  as the cores do.
* **Metrics**: ``/metrics`` of every process answers the N processes' aggregate (prometheus_client's
  multiprocess mode, as vLLM: :mod:`rlserve.server.metrics_mp`; counters and histograms summed,
  gauges as vLLM aggregates them, in a directory process 0 makes and removes at exit, or the user's
  ``PROMETHEUS_MULTIPROC_DIR``, as vLLM); only
  ``rlserve_api_server_info{index,count}`` is the answering process's own (which one it is). The
  sleep-mode gauges are process 0's (the others have no sleep state of their own), written at its
  scrapes and after each sleep / wake_up; ``process_*`` / ``python_*`` are left out (as vLLM does).
* **Request ids**: every route makes its id from a random 96-bit UUID part (``cmpl-``, ``chatcmpl-``,
  ...), so the ids of different processes do not collide in the cores.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading

from rlserve import envs

logger = logging.getLogger(__name__)

#: the environment variable that makes ``rlserve serve`` API process ``client_index`` > 0
ATTACH_ENV = "RLSERVE_API_SERVER_ATTACH"
#: seconds processes 1..N-1 get to stop after SIGTERM before SIGKILL
STOP_GRACE_S = 5.0
#: routes processes 1..N-1 forward to process 0 (compared without a trailing slash)
CONTROL_PATHS = frozenset(p.rstrip("/") for p in (
    "/pause", "/resume", "/is_paused", "/reset_prefix_cache", "/abort_requests", "/server_info",
    "/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/sync_weights",
    "/finish_weight_update", "/shutdown_weight_transfer_engine", "/weight_info", "/weight_checker",
    "/init_communicator/", "/update_named_param/", "/close_communicator/",
    "/sleep", "/wake_up", "/is_sleeping", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"))


def attach_from_env() -> dict | None:
    """This process's attach description when it is API process 1..N-1, else None:
    ``{"client_index", "count", "core_dirs", "listen_fd", "control_socket", "ready_fd", "metrics_dir"}``."""
    raw = envs.RLSERVE_API_SERVER_ATTACH
    return json.loads(raw) if raw else None


def check_args(args) -> str | None:
    """The error of an ``--api-server-count`` that cannot be served with these flags, else None
    (and engine-core restarts turned off for N > 1)."""
    n = args.api_server_count
    if n < 1:
        return "--api-server-count must be at least 1"
    if n == 1:
        return None
    if args.enable_lora:
        return ("--api-server-count > 1 with --enable-lora: adapters loaded at run time live in API server 0 "
                "(vLLM 0.32 refuses runtime LoRA updating with api_server_count > 1 as well)")
    if (args.engine_mode or "process") != "process":
        return "--api-server-count > 1 needs --engine-mode process (the API processes share the engine-core processes)"
    if args.max_engine_restarts:
        if attach_from_env() is None:  # said once, by process 0 (the others run the same command line)
            logger.info("--api-server-count %d: engine-core restarts are off (--max-engine-restarts ignored)", n)
        args.max_engine_restarts = 0
    return None


def say_ready(attach: dict) -> None:
    """API process 1..N-1 serves: tell process 0 (which announces the server once all have)."""
    try:
        os.write(attach["ready_fd"], b"1")
        os.close(attach["ready_fd"])
    except OSError:
        pass


def listen_socket(attach: dict) -> socket.socket:
    """The listening socket API process 0 bound, inherited as ``attach["listen_fd"]``."""
    sock = socket.socket(fileno=attach["listen_fd"])
    sock.set_inheritable(False)
    return sock


def control_socket(directory: str) -> tuple[socket.socket, str]:
    """API process 0's private listening unix socket for the forwarded control routes, in
    ``directory`` (its first engine core's socket directory: only this user can enter it, and it goes
    with the server, or with the next server's start after a kill, ``core_spawn.socket_dir``).
    Returns ``(socket, path)``."""
    path = os.path.join(directory, "control.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(128)
    sock.set_inheritable(False)
    return sock, path


class ControlSocketAccessFilter(logging.Filter):
    """API process 0's filter on uvicorn's access log: drops the lines of requests that came over the
    control socket (a route process 1..N-1 forwarded, :class:`ForwardControl`). That process logs the
    request itself, with the client's address and the answer's status; process 0's line had an empty
    address (a unix socket has no peer address: uvicorn logs ``" - "``), so each forwarded request was
    logged twice. Process 0's only unix socket is the control socket (``rlserve serve`` binds its HTTP
    socket on TCP), so an empty address is that socket's. uvicorn's access record: ``'%s - "%s %s
    HTTP/%s" %d'`` with the client address first (``uvicorn.protocols.utils.get_client_addr``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (isinstance(args, tuple) and args and args[0] == "")


def quiet_control_socket_access_log() -> None:
    """Install :class:`ControlSocketAccessFilter` on ``uvicorn.access`` (API process 0, N > 1; after
    uvicorn configured its logging)."""
    logging.getLogger("uvicorn.access").addFilter(ControlSocketAccessFilter())


class APIServerProcessManager:
    """API process 0's processes 1..N-1 (vLLM's class name): started with :meth:`start` as soon as the
    engine cores were (``AsyncEngine``'s ``on_started``: beside the cores' start, as vLLM starts its API
    servers inside ``launch_core_engines``), watched (:meth:`watch`), stopped with :meth:`stop`, which
    also closes process 0's control socket and removes the metric files' directory when process 0 made it.

    Args:
        count: N. listen_sock: the shared listening socket. argv: ``rlserve serve``'s arguments.
        metrics_dir: the metric values' shared directory (:func:`rlserve.server.metrics_mp.setup_dir`);
            ``remove_metrics_dir``: whether :meth:`stop` removes it (False: the user's).
    """

    def __init__(self, count: int, listen_sock, argv: list[str], metrics_dir: str | None = None,
                 remove_metrics_dir: bool = True):
        self.count = count
        self.metrics_dir = metrics_dir
        self.remove_metrics_dir = remove_metrics_dir
        self.listen_sock = listen_sock
        self.core_dirs: list[str] = []
        self.control: socket.socket | None = None  # process 0's control socket, once started
        self.control_path: str | None = None
        self.argv = list(argv)
        self.procs: list[subprocess.Popen] = []
        self._ready: list[int] = []  # read ends of each process's ready pipe
        self.stopping = False
        self.failure: str | None = None  # why the server stops: a process that ended on its own

    def start(self, replicas) -> None:
        """Bind process 0's control socket (in the first core's socket directory) and start processes
        1..N-1 attached to ``replicas``' cores (started, maybe not ready yet: each process waits for its
        cores' ready message, :class:`~rlserve.engine.front.core_attach.AttachedCoreReplica`). Call from
        the main thread: the kernel's parent-death signal follows the thread that started them."""
        from rlserve.server.launch import parent_death_signal

        self.core_dirs = [r.socket_dir for r in replicas]
        self.control, self.control_path = control_socket(self.core_dirs[0])
        fd = self.listen_sock.fileno()
        for i in range(1, self.count):
            r, w = os.pipe()
            env = dict(os.environ)
            env[ATTACH_ENV] = json.dumps({"client_index": i, "count": self.count, "core_dirs": self.core_dirs,
                                          "listen_fd": fd, "control_socket": self.control_path, "ready_fd": w,
                                          "metrics_dir": self.metrics_dir})
            try:
                self.procs.append(subprocess.Popen([sys.executable, "-m", "rlserve", "serve", *self.argv], env=env,
                                                   stdin=subprocess.DEVNULL, pass_fds=(fd, w),
                                                   preexec_fn=parent_death_signal(signal.SIGTERM)))
            finally:
                os.close(w)
            self._ready.append(r)
        which = "1" if self.count == 2 else f"1..{self.count - 1}"
        logger.info("API server process%s %s started (pid%s %s)", "" if self.count == 2 else "es", which,
                    "" if self.count == 2 else "s", ", ".join(str(p.pid) for p in self.procs))

    def wait_ready(self) -> bool:
        """Block until every process said it serves (:func:`say_ready`); False when one ended first."""
        ok = True
        for r in self._ready:
            try:
                ok = os.read(r, 1) == b"1" and ok
            finally:
                os.close(r)
        self._ready = []
        return ok

    def watch(self, on_failure) -> None:
        """Call ``on_failure()`` (from a watcher thread) once any process ends before :meth:`stop`."""
        def run(i: int, proc: subprocess.Popen) -> None:
            rc = proc.wait()
            if self.stopping:
                return
            from rlserve.proc_state import exit_text

            self.failure = f"API server {i} (pid {proc.pid}) {exit_text(rc)}"
            logger.error("%s: stopping the server", self.failure)
            on_failure()

        for i, proc in enumerate(self.procs, start=1):
            threading.Thread(target=run, args=(i, proc), name=f"rlserve-api-server-{i}-watch", daemon=True).start()

    def terminate(self) -> None:
        """SIGTERM every process still running (the server stops: their ends are not failures)."""
        self.stopping = True
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGTERM)
                except OSError:
                    pass

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """:meth:`terminate`, SIGKILL what is left after ``grace_s``; reap them all; then close the
        control socket and remove the metric files' directory (when process 0 made it). Idempotent."""
        self.terminate()
        for p in self.procs:
            try:
                p.wait(grace_s)
            except subprocess.TimeoutExpired:
                logger.warning("API server (pid %d) did not stop within %g s: killed", p.pid, grace_s)
                p.kill()
                p.wait()
        if self.control is not None:
            self.control.close()
            self.control = None
        if self.control_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.control_path)
        if self.remove_metrics_dir:
            from rlserve.server.metrics_mp import remove_dir

            remove_dir(self.metrics_dir)


class ForwardControl:
    """ASGI middleware of API processes 1..N-1: a request for a :data:`CONTROL_PATHS` route is sent
    to API process 0 over its unix socket and its answer returned as is; every other request goes
    to ``app``. A body larger than ``max_body_bytes`` is answered 413 here (process 0 would too).
    Process 0 unreachable: 503 ``api_server_unavailable``."""

    def __init__(self, app, control_path: str, max_body_bytes: int | None = None):
        import httpx

        logging.getLogger("httpx").setLevel(logging.WARNING)  # (a line per forwarded request otherwise)
        self.app = app
        self.state = getattr(app, "state", None)
        self.max_body_bytes = max_body_bytes
        self._client = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=control_path), timeout=None,
                                         base_url="http://api-server-0")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"].rstrip("/") not in CONTROL_PATHS:
            return await self.app(scope, receive, send)
        body = bytearray()
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            if self.max_body_bytes is not None and len(body) > self.max_body_bytes:
                return await _answer(send, 413, "request_too_large",
                                     f"request body over {self.max_body_bytes} bytes (--max-request-body-bytes)")
            if not msg.get("more_body", False):
                break
        skip = (b"host", b"content-length", b"connection", b"transfer-encoding")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in skip]
        url = scope["path"] + ("?" + scope["query_string"].decode("latin-1") if scope.get("query_string") else "")
        import httpx

        try:
            r = await self._client.request(scope["method"], url, headers=headers, content=bytes(body))
        except httpx.HTTPError as e:
            return await _answer(send, 503, "api_server_unavailable",
                                 f"API server 0, which serves the control routes, did not answer: {e}")
        out = [(k, v) for k, v in r.headers.raw if k.lower() not in skip]
        out.append((b"content-length", str(len(r.content)).encode()))
        await send({"type": "http.response.start", "status": r.status_code, "headers": out})
        await send({"type": "http.response.body", "body": r.content})


async def _answer(send, status: int, code: str, message: str) -> None:
    """An OpenAI-style JSON error (:func:`rlserve.server.errors.error_body`)."""
    from rlserve.server.errors import error_body

    body = json.dumps(error_body(status, message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
