"""rlserve servers behind the SGLang router (``pip install rlserve[router]``: ``sglang-router``).

The router is SGLang's model gateway, a Rust binary shipped in the ``sglang-router`` wheel; we
start it as a subprocess (``python -m sglang_router.launch_router``) and drive its worker API.
What it does with rlserve servers (``sglang-router`` 0.3.2, checked here):

- **Discovery**: the ``--worker-urls`` given at start, plus ``POST /workers {"url": ...}`` /
  ``DELETE /workers/{id}`` at run time (both answer "queued"; the change lands moments later,
  :meth:`SGLangRouter.add_worker` / :meth:`~SGLangRouter.remove_worker` wait for it). Registering a
  worker reads its ``/health``, ``/server_info`` (``dp_size``) and ``/model_info`` (falling back
  to ``/get_model_info``, which rlserve serves).
- **Routing**: ``--policy cache_aware`` (the default here) keeps an approximate radix tree of the
  prompt *text* each worker saw and sends a request to the worker with the longest match above
  ``--cache-threshold`` (0.3), unless the load is unbalanced (``--balance-abs-threshold`` /
  ``--balance-rel-threshold``), then to the least loaded. ``/v1/completions`` needs text prompts
  (token-id prompts are refused by the router); it forwards every field it does not know
  (``return_token_ids``, ``structured_outputs``, ...) and adds ``no_stop_trim`` /
  ``return_hidden_states`` (rlserve accepts them at their neutral values). ``/v1/chat/completions``
  drops the fields it does not know (``return_token_ids`` among them).
- **Health**: a background ``GET /health`` every ``--health-check-interval-secs`` (60 s by
  default); ``--health-failure-threshold`` (3) failures in a row mark the worker unhealthy and it
  gets no more requests (it stays listed). A request to a dead worker fails, is retried
  (``--retry-max-retries``, 5) and opens that worker's circuit breaker after a few failures, so
  a dead worker costs a few failed requests until the health check or the breaker catches it:
  the multi-server trainer removes a server it found dead from the router at once
  (:meth:`SGLangRouter.remove_worker`), which needs no waiting.
- **Paused servers**: rlserve holds requests that arrive while it is paused (``/pause``), so a
  request the router forwards during a weight sync waits in the server and completes after the
  resume (the router's own timeout, ``--request-timeout-secs``, is 1800 s).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Sequence

from rlserve.demo import DemoServer, ServerStartError
from rlserve.server.launch import PORT_TRIES, address_in_use, free_ports

logger = logging.getLogger(__name__)

#: The routing policies ``sglang-router`` 0.3 offers for regular (non-disaggregated) serving.
POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")


class RouterError(RuntimeError):
    """The router refused a call, or did not reach the asked state in time."""


def router_available() -> str | None:
    """``None`` when ``sglang_router`` can be imported, else why not (for test skips)."""
    try:
        import sglang_router  # noqa: F401
    except ImportError as e:
        return f"sglang-router is not installed (pip install 'rlserve[router]'): {e}"
    return None


@dataclass
class RouterOptions:
    """Flags of ``sglang_router.launch_router`` (their names, underscores for dashes).

    Attributes:
        policy: one of :data:`POLICIES`.
        cache_threshold: cache-aware: the smallest prefix-match ratio (0..1) that sends a request
            to the worker holding the prefix.
        health_check_interval_secs / health_failure_threshold / health_success_threshold:
            the background health check (seconds between checks; failures / successes in a row).
        request_timeout_secs: how long the router waits for a worker's answer.
        retry_max_retries: retries of a request whose worker failed (0: none).
        shutdown_grace_period_secs: seconds the router lets requests in flight finish when
            stopped.
        api_key: sent to the workers as ``Authorization: Bearer`` (rlserve's ``--api-key``).
        log_level: ``debug`` / ``info`` / ``warn`` / ``error``.
        extra_args: more command-line flags, passed as they are.
    """

    policy: str = "cache_aware"
    cache_threshold: float = 0.3
    health_check_interval_secs: int = 60
    health_failure_threshold: int = 3
    health_success_threshold: int = 2
    request_timeout_secs: int = 1800
    retry_max_retries: int = 5
    shutdown_grace_period_secs: int = 5
    api_key: str | None = None
    log_level: str = "warn"
    extra_args: Sequence[str] = field(default_factory=tuple)

    def args(self) -> list[str]:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        out = ["--policy", self.policy, "--cache-threshold", str(self.cache_threshold),
               "--health-check-interval-secs", str(self.health_check_interval_secs),
               "--health-failure-threshold", str(self.health_failure_threshold),
               "--health-success-threshold", str(self.health_success_threshold),
               "--request-timeout-secs", str(self.request_timeout_secs),
               "--retry-max-retries", str(self.retry_max_retries),
               "--shutdown-grace-period-secs", str(self.shutdown_grace_period_secs),
               "--log-level", self.log_level]
        if self.api_key:
            out += ["--api-key", self.api_key]
        return out + list(self.extra_args)


def router_command(worker_urls: Sequence[str], host: str, port: int, prometheus_port: int,
                   options: RouterOptions) -> list[str]:
    """The ``python -m sglang_router.launch_router`` command line."""
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port),
           # its metrics exporter binds a port of its own (29000 by default: two routers collide)
           "--prometheus-host", host, "--prometheus-port", str(prometheus_port)]
    if worker_urls:
        cmd += ["--worker-urls", *[u.rstrip("/") for u in worker_urls]]
    return cmd + options.args()


class SGLangRouter:
    """A running SGLang router (its own process group) and a client of its worker API.

    Args:
        worker_urls: the rlserve servers to route to (``http://host:port``).
        host: the interface the router listens on (``0.0.0.0`` to serve other hosts).
        port: its port (0: a free one). The router binds its ports itself, after they were
            picked here (:func:`~rlserve.server.launch.free_ports`; it cannot bind port 0 and say
            which it got): when it exits saying one was taken meanwhile (``EADDRINUSE``), it is
            started again on new ones (a warning; up to
            :data:`~rlserve.server.launch.PORT_TRIES` starts).
        options: :class:`RouterOptions`.
        log_path: the router's log file (``None``: a new temporary file; ``"-"``: this terminal).
        startup_timeout_s: bound on the wait until every worker is registered and healthy.

    Use as a context manager or call :meth:`start` / :meth:`stop`. ``url`` is the router's
    OpenAI-compatible base URL (``/v1/completions`` etc.); ``port`` / ``metrics_port`` its ports
    (the last start's).

    Raises:
        RouterError: ``sglang-router`` is missing, or the router did not come up in time.
    """

    def __init__(self, worker_urls: Sequence[str], host: str = "127.0.0.1", port: int = 0,
                 options: RouterOptions | None = None, log_path: str | None = None,
                 startup_timeout_s: float = 120.0):
        why = router_available()
        if why is not None:
            raise RouterError(why)
        self.options = options or RouterOptions()
        self.host = host
        self.worker_urls = [u.rstrip("/") for u in worker_urls]
        self.startup_timeout_s = float(startup_timeout_s)
        self._given_port, self._log_path = port, log_path
        self._new_process()

    def _new_process(self) -> None:
        """The router's process (not started) on freshly picked ports (``port``, if given, kept)."""
        client_host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        picked = free_ports(1 if self._given_port else 2, client_host)  # distinct
        self.port = self._given_port or picked.pop()
        self.metrics_port = picked[0]
        self.url = f"http://{client_host}:{self.port}"
        cmd = router_command(self.worker_urls, self.host, self.port, self.metrics_port, self.options)
        self._proc = DemoServer(cmd, self.url, log_path=self._log_path, startup_timeout_s=self.startup_timeout_s)

    @classmethod
    def attach(cls, url: str) -> "SGLangRouter":
        """A client of a router started elsewhere: the worker API only (:meth:`start` and
        :meth:`stop` do nothing)."""
        self = cls.__new__(cls)
        self.url, self.options, self.worker_urls, self._proc = url.rstrip("/"), RouterOptions(), [], None
        return self

    # ------------------------------------------------------------------ process
    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def log_path(self) -> str | None:
        return None if self._proc is None else self._proc.log_path

    def log_tail(self, n_chars: int = 4000) -> str:
        return "" if self._proc is None else self._proc.log_tail(n_chars)

    def start(self) -> "SGLangRouter":
        """Start the process; return once it answers and lists every worker as healthy."""
        if self._proc is None:
            return self
        try:
            remaining = self._proc.startup_timeout_s
            t = self._start_on_free_ports()
            self.wait_workers(self.worker_urls, timeout_s=max(1.0, remaining - t))
        except BaseException:
            self.stop()
            raise
        return self

    def _start_on_free_ports(self) -> float:
        """Start the process and wait for its ``/health`` (seconds waited, the last start's); a
        start that ends in ``EADDRINUSE`` is retried on new ports (class docstring).

        Raises:
            ServerStartError: it exited for another reason, :data:`PORT_TRIES` starts found a port
                taken, or it was not healthy in time."""
        for attempt in range(1, PORT_TRIES + 1):
            self._proc.start()
            try:
                return self._proc.wait_healthy()
            except ServerStartError:
                if attempt == PORT_TRIES or not address_in_use(self._proc.log_tail()):
                    raise
                logger.warning("the router could not bind port %d or its metrics port %d (taken by another process "
                               "since they were picked; its log: %s): starting it on new ones (try %d of %d)",
                               self.port, self.metrics_port, self._proc.log_path, attempt + 1, PORT_TRIES)
                self._proc.stop()
                self._new_process()
        raise AssertionError("unreachable")  # pragma: no cover

    def stop(self) -> int | None:
        """Stop the router (SIGTERM to its process group, SIGKILL after a bounded wait)."""
        if self._proc is None:
            return None
        return self._proc.stop(grace_s=float(self.options.shutdown_grace_period_secs) + 5.0)

    def __enter__(self) -> "SGLangRouter":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ worker API
    def _http(self, method: str, path: str, **kw):
        import requests

        try:
            r = requests.request(method, self.url + path, timeout=kw.pop("timeout", 10.0), **kw)
        except requests.RequestException as e:
            raise RouterError(f"{method} {path}: the router at {self.url} does not answer: {e}") from e
        if r.status_code >= 400:
            raise RouterError(f"{method} {path} -> HTTP {r.status_code}: {r.text[:500]}")
        return r.json() if r.content else {}

    def workers(self) -> list[dict]:
        """``GET /workers``: ``[{"id", "url", "is_healthy", "load", "model_id", ...}]``."""
        return list(self._http("GET", "/workers").get("workers", []))

    def healthy_urls(self) -> list[str]:
        """URLs of the workers the router routes to (registered and healthy)."""
        return sorted(w["url"] for w in self.workers() if w.get("is_healthy"))

    def _wait(self, done, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            ws = self.workers()
            if done(ws):
                return
            if time.monotonic() > deadline:
                raise RouterError(f"{what}: not done within {timeout_s:.0f} s; the router lists "
                                  f"{[(w.get('url'), w.get('is_healthy')) for w in ws]}\n{self.log_tail(2000)}")
            time.sleep(0.05)

    def wait_workers(self, urls: Sequence[str], timeout_s: float = 60.0) -> None:
        """Block until every one of ``urls`` is registered and healthy."""
        want = {u.rstrip("/") for u in urls}
        self._wait(lambda ws: want <= {w["url"] for w in ws if w.get("is_healthy")},
                   f"registering {sorted(want)}", timeout_s)

    def add_worker(self, url: str, timeout_s: float = 60.0) -> None:
        """``POST /workers``, then wait until the router routes to it."""
        url = url.rstrip("/")
        self._http("POST", "/workers", json={"url": url})
        self.wait_workers([url], timeout_s)

    def remove_worker(self, url: str, timeout_s: float = 30.0) -> bool:
        """``DELETE /workers/{id}`` of every entry with this URL, then wait until none is listed.
        Returns whether the router listed it."""
        url = url.rstrip("/")
        ids = [w["id"] for w in self.workers() if w.get("url") == url]
        for wid in ids:
            self._http("DELETE", f"/workers/{wid}")
        self._wait(lambda ws: url not in {w["url"] for w in ws}, f"removing {url}", timeout_s)
        return bool(ids)

