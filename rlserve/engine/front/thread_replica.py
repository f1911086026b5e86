"""An engine replica on a thread of the API process (``engine_mode="thread"``: debugging,
``engine_factory`` fakes in tests): :class:`ThreadReplica`.

One thread (``rlserve-engine-<i>``) owns the replica's :class:`~rlserve.engine.core.engine_core.EngineCore`
and runs its step loop; *every* call into the engine (add, abort, step, utility calls) runs on
that thread between two steps, so the engine needs no locking. It shares the GIL with the HTTP
server; the default, :mod:`rlserve.engine.front.core_client`, does not.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from typing import Any, Callable

from rlserve.engine.core.engine_core import EngineCore
from rlserve.engine.front.replica import Replica, failed_future
from rlserve.errors import EngineDeadError

logger = logging.getLogger(__name__)

_IDLE_POLL_S = 1.0  # an idle engine thread wakes at least this often (seconds)


class ThreadReplica(Replica):
    """One engine replica and the thread that owns it.

    Args:
        front: the AsyncEngine.
        index: replica index.
        factory: ``factory() -> engine`` (runs on the thread).
        weight_version: initial version stamped on outputs.
    """

    def __init__(self, front, index: int, factory: Callable[[], Any], weight_version: str):
        super().__init__(front, index)
        self.core: EngineCore | None = None
        self._factory = factory
        self._version = weight_version
        self._cmds: collections.deque = collections.deque()
        self._wakeup = threading.Event()
        self._stopping = False
        self._drain_waiters: list[concurrent.futures.Future] = []
        self.ready: concurrent.futures.Future = concurrent.futures.Future()
        self.thread = threading.Thread(target=self._main, name=f"rlserve-engine-{index}", daemon=True)

    @property
    def engine(self):
        return None if self.core is None else self.core.engine

    def start(self) -> None:
        self.thread.start()

    def wait_ready(self, timeout_s: float) -> None:
        try:
            self.ready.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"engine replica {self.index} did not start in {timeout_s}s") from None

    # ---- posting work onto the thread ------------------------------------------------
    def post(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn()`` on the engine thread between steps; returns a concurrent Future."""
        if not self.alive:
            return failed_future(self.dead_error())
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.append((fn, fut))
        self._wakeup.set()
        return fut

    def submit(self, req) -> None:
        self.reqs[req.request_id] = req
        fut = self.post(lambda: self._add(req))
        if fut.done() and fut.exception() is not None:  # the replica died meanwhile
            self.reqs.pop(req.request_id, None)
            raise fut.exception()

    def _add(self, req) -> None:
        try:
            self.core.add(req.request_id, req.prompt, req.params, req.stream, req.arrival_time)
        except Exception as e:  # noqa: BLE001 - InvalidRequestError and bugs alike: this request only
            self.route(errors=[(req.request_id, e)])

    def abort(self, request_ids) -> concurrent.futures.Future:
        return self.post(lambda: self.route(self.core.abort(request_ids)))

    def abort_all(self, lift_quarantine: bool = False) -> concurrent.futures.Future:
        def run() -> int:
            outs = self.core.abort_all()
            self.route(outs)
            if lift_quarantine:
                self.core.lift_quarantine()
            return len(outs)
        return self.post(run)

    def route(self, outputs=(), errors=()) -> None:
        """:meth:`Replica.route`, after counting the tokens the engine made since the last route (the
        engine thread routes after every step: vLLM's per-step counters)."""
        if self.core is not None:
            self.count_tokens(*self.core.take_token_counts())
        super().route(outputs, errors)

    def set_quarantined(self, quarantined: bool) -> None:
        if not quarantined and self.core is not None:
            self.core.lift_quarantine()  # one attribute store

    def set_frozen(self, frozen: bool) -> concurrent.futures.Future:
        def run() -> None:
            self.core.frozen = frozen
            if frozen:  # stats() as of the freeze
                self.core.snapshot_stats(force=True)
                self.stats = dict(self.core.stats)
        return self.post(run)

    def wait_drained(self) -> concurrent.futures.Future:
        drained: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            self.core.frozen = False  # a replica frozen by an earlier keep-pause steps to drain
            self._drain_waiters.append(drained)
        posted = self.post(run)
        if posted.done() and posted.exception() is not None:
            return posted
        return drained

    def reset_prefix_cache(self) -> concurrent.futures.Future:
        return self.post(lambda: self.core.reset_prefix_cache())

    def call(self, target: str, *args) -> concurrent.futures.Future:
        return self.post(lambda: self.core.call(target, *args))

    def run(self, fn) -> concurrent.futures.Future:
        return self.post(lambda: fn(self.core.engine))

    def set_weight_version(self, version: str) -> None:
        self._version = version
        if self.core is not None:
            self.core.weight_version = version  # one attribute store: atomic for the engine thread

    def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()

    def join(self, timeout_s: float) -> None:
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout_s)

    # ---- thread body ------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.core = EngineCore(self._factory(), self.index, self._version)
        except BaseException as e:  # noqa: BLE001 - reported to the constructor
            self.ready.set_exception(e)
            return
        core = self.core
        self.alive = True
        self.ready.set_result(core.engine)
        step_failures = 0
        was_busy = True
        try:
            while True:
                self._wakeup.clear()
                self._run_commands()
                if self._stopping:
                    break
                busy = core.busy()
                halted = core.halted
                if halted or not busy:
                    if core.snapshot_stats(force=was_busy):  # fresh numbers as soon as it goes idle
                        self.stats = dict(core.stats)
                    was_busy = False
                if not busy:
                    self._resolve_drain_waiters()
                if halted or not busy:
                    self._wakeup.wait(_IDLE_POLL_S)
                    continue
                try:
                    outs = core.step()
                    step_failures = 0
                except Exception as e:  # noqa: BLE001 - must not kill the loop
                    step_failures += 1
                    ids, err = core.fail_all(e)
                    self.route(errors=[(r, err) for r in ids])
                    if step_failures > 1:
                        time.sleep(min(0.05 * step_failures, 1.0))  # do not spin on a broken engine
                    continue
                # a request that finished leaves with numbers that no longer count it
                if core.snapshot_stats(force=any(o.finished for o in outs)):
                    self.stats = dict(core.stats)
                self.route(outs)
                was_busy = True
        except BaseException as e:  # noqa: BLE001 - a bug in this loop itself
            logger.exception("engine replica %d loop crashed", self.index)
            ids, err = core.fail_all(e)
            self.route(errors=[(r, err) for r in ids])
        finally:
            self.alive = False
            dead = EngineDeadError(f"engine replica {self.index} stopped")
            while self._cmds:
                _fn, fut = self._cmds.popleft()
                fut.set_exception(dead)
            for fut in self._drain_waiters:
                if not fut.done():
                    fut.set_exception(dead)
            core.fail_all(dead, abort_in_engine=False)
            self.fail_routed(dead)
            core.shutdown()

    def _run_commands(self) -> None:
        while self._cmds:
            fn, fut = self._cmds.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - delivered to the caller
                fut.set_exception(e)

    def _resolve_drain_waiters(self) -> None:
        if self._drain_waiters:
            waiters, self._drain_waiters = self._drain_waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)
