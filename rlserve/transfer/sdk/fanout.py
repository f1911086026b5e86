"""One control-plane client for N rlserve servers that share one transfer group.

:class:`FanOutClient` has :class:`~rlserve.transfer.HTTPWeightSyncClient`'s methods, and each
call goes to every server concurrently (one thread per server). The trainer's group engine
(gloo / NCCL) takes it as its ``client`` unchanged: one rendezvous, one broadcast per bucket
that reaches every server's workers, one set of start / update / finish calls.

Ranks (vLLM's ``rank_offset``): the trainer is rank 0; server ``i``'s workers are
``offset_i + dp_index * TP + tp_rank`` with ``offset_0 = 1`` and ``offset_{i+1} = offset_i +
world_size_i`` (its TP x DP, from ``GET /get_world_size``); the group has ``1 + sum(world_size_i)``
ranks. ``init_weight_transfer_engine`` sends each server the trainer's ``init_info`` with its
own ``rank_offset`` and ``shared_group: true`` (the world size is not just its workers + 1).

A call succeeds only when every server's part succeeded; otherwise it raises
:class:`FanOutError` (which server answered what) as soon as one part failed, while the others
run on (their answers are in :attr:`FanOutClient.last_results`). ``no_transfer_engine`` (409)
from every failing server is raised as that error, so the engine re-initialises as it does for
one server.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from typing import Callable, Sequence

from rlserve.transfer.errors import WeightTransferFailedError
from rlserve.transfer.sdk.client import HTTPWeightSyncClient, WeightSyncConflictError
from rlserve.transfer.wire.protocol import DEFAULT_TIMEOUT_S


class FanOutError(WeightTransferFailedError):
    """Some servers' parts of a fanned-out call failed.

    Attributes:
        route: the call (e.g. ``"update_weights"``).
        failures: ``{url: exception}`` of the parts that failed (those seen when it was raised).
        code: the failures' common error code when all share one (``"no_transfer_engine"``).
        status_code: their common HTTP status, if any.
    """

    def __init__(self, route: str, failures: dict[str, BaseException]):
        self.route = route
        self.failures = dict(failures)
        codes = {getattr(e, "code", None) for e in failures.values()}
        statuses = {getattr(e, "status_code", None) for e in failures.values()}
        self.code = codes.pop() if len(codes) == 1 else None
        self.status_code = statuses.pop() if len(statuses) == 1 else None
        parts = "; ".join(f"{u}: {type(e).__name__}: {e}" for u, e in self.failures.items())
        self.message = f"{route} failed on {len(self.failures)} server(s): {parts}"
        self.error_type = None
        # (not super().__init__: FanOutConflictError's next base is WeightSyncHTTPError, whose
        # arguments are one server's answer)
        Exception.__init__(self, self.message)


class FanOutConflictError(FanOutError, WeightSyncConflictError):
    """Every failed part was a 409; ``code`` is theirs when they share one (the trainer engine
    re-initialises on ``no_transfer_engine``)."""


def _raise(route: str, failures: dict[str, BaseException]) -> None:
    if all(isinstance(e, WeightSyncConflictError) for e in failures.values()):
        raise FanOutConflictError(route, failures)
    raise FanOutError(route, failures)


class FanOutClient:
    """The control planes of several servers as one client (see the module docstring).

    Args:
        urls: the servers' base URLs, in rank order.
        admin_key: each server's ``--admin-key`` (one for all).
        timeout_s: per-call read timeout (as :class:`HTTPWeightSyncClient`).
        client_factory: ``fn(url) -> HTTPWeightSyncClient`` (tests wrap calls through it).

    Attributes:
        clients: ``{url: HTTPWeightSyncClient}`` of the servers in the group now.
        world_sizes: ``{url: TP x DP}``, read once per server.
        last_results: ``{url: answer or exception}`` of the last fanned-out call.

    Raises:
        FanOutError: a server did not answer ``/get_world_size``.
    """

    def __init__(self, urls: Sequence[str], admin_key: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 client_factory: Callable[[str], HTTPWeightSyncClient] | None = None):
        if not urls:
            raise ValueError("FanOutClient needs at least one server URL")
        urls = [u.rstrip("/") for u in urls]
        if len(set(urls)) != len(urls):
            raise ValueError(f"duplicate server URLs: {urls}")
        make = client_factory or (lambda u: HTTPWeightSyncClient(u, admin_key=admin_key, timeout_s=timeout_s))
        self.clients: dict[str, HTTPWeightSyncClient] = {u: make(u) for u in urls}
        self._pool = cf.ThreadPoolExecutor(max_workers=max(4, 2 * len(urls)), thread_name_prefix="rlserve-fanout")
        self._lock = threading.Lock()
        self._session: str | None = None
        self.last_results: dict[str, object] = {}
        self.world_sizes: dict[str, int] = {}
        self.world_sizes = {u: int(n) for u, n in self.call("get_world_size").items()}

    # ------------------------------------------------------------------ membership
    @property
    def urls(self) -> list[str]:
        return list(self.clients)

    def rank_offsets(self) -> dict[str, int]:
        """``{url: rank of its worker 0}``: 1, then each server after the previous one's workers."""
        out, nxt = {}, 1
        for u in self.clients:
            out[u] = nxt
            nxt += self.world_sizes[u]
        return out

    def get_world_size(self) -> int:
        """Workers of every server together (the group is this + 1, the trainer)."""
        return sum(self.world_sizes[u] for u in self.clients)

    def drop(self, urls: Sequence[str]) -> None:
        """Leave these servers out of every later call and of the next group (re-init needed)."""
        for u in urls:
            self.clients.pop(u.rstrip("/"), None)

    @property
    def session(self) -> str | None:
        return self._session

    @session.setter
    def session(self, value: str | None) -> None:
        self._session = value
        for c in self.clients.values():
            c.session = value

    # ------------------------------------------------------------------ fan-out
    def call(self, route: str, per_url: Callable[[str], tuple] | None = None, wait_all: bool = False) -> dict:
        """``client.<route>(*args)`` on every server at once; ``{url: answer}``.

        Args:
            per_url: ``fn(url) -> args`` (default: no arguments).
            wait_all: wait for every part even after one failed (``False``: raise at the first
                failure; the rest keep running, see :attr:`last_results`).
        Raises:
            FanOutError / FanOutConflictError: a part failed.
        """
        futs = {}
        results: dict[str, object] = {}
        self.last_results = results
        for u, c in list(self.clients.items()):
            args = per_url(u) if per_url is not None else ()
            fut = self._pool.submit(getattr(c, route), *args)
            fut.add_done_callback(lambda f, u=u: results.__setitem__(u, f.exception() or f.result()))
            futs[fut] = u
        failures: dict[str, BaseException] = {}
        pending = set(futs)
        while pending:
            done, pending = cf.wait(pending, return_when=cf.ALL_COMPLETED if wait_all else cf.FIRST_EXCEPTION)
            for f in done:
                if f.exception() is not None:
                    failures[futs[f]] = f.exception()
            if failures and not wait_all:
                break
        if failures:
            _raise(route, failures)
        return {futs[f]: f.result() for f in futs}

    def map(self, fn: Callable[[str], object]) -> dict:
        """``{url: fn(url)}`` for every server, run concurrently; ``fn`` must not raise."""
        futs = {u: self._pool.submit(fn, u) for u in self.clients}
        return {u: f.result() for u, f in futs.items()}

    # ------------------------------------------------------------------ HTTPWeightSyncClient's API
    def init_weight_transfer_engine(self, init_info: dict, timeout_s: float | None = None) -> dict:
        """Every server joins the trainer's group, each with its own ``rank_offset``."""
        offsets = self.rank_offsets()
        return self.call("init_weight_transfer_engine",
                         lambda u: (dict(init_info, rank_offset=offsets[u], shared_group=True), timeout_s))

    def start_weight_update(self, update_info: dict | None = None) -> dict:
        return self.call("start_weight_update", lambda u: (update_info,))

    def update_weights(self, update_info: dict, timeout_s: float | None = None) -> dict:
        return self.call("update_weights", lambda u: (update_info, timeout_s))

    def finish_weight_update(self, weight_version: str | None = None, timeout_s: float | None = None) -> dict:
        return self.call("finish_weight_update", lambda u: (weight_version, timeout_s), wait_all=True)

    def shutdown_weight_transfer_engine(self) -> dict:
        return self.call("shutdown_weight_transfer_engine", wait_all=True)

    def weight_info(self) -> dict:
        return self.call("weight_info", wait_all=True)

    def pause(self, mode: str = "abort", clear_cache: bool = False) -> dict:
        return self.call("pause", lambda u: (mode, clear_cache), wait_all=True)

    def resume(self) -> dict:
        return self.call("resume", wait_all=True)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def is_dead(url: str, timeout_s: float = 5.0) -> bool:
    """Whether nothing answers at ``url`` any more (connection refused or no answer to
    ``GET /health`` within ``timeout_s``). A server that answers, even with an error, is alive."""
    import requests

    try:
        requests.get(url.rstrip("/") + "/health", timeout=(min(timeout_s, 5.0), timeout_s))
        return False
    except requests.RequestException:
        return True


__all__ = ["FanOutClient", "FanOutError", "FanOutConflictError", "is_dead"]
