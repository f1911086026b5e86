"""Restarting an engine-core process that died (process mode): :class:`CoreRestarter`.

When a replica's engine-core process dies (a crash, an OOM kill, ``kill -9``), its reader
thread ends the requests in flight and held with ``EngineDeadError`` (HTTP 503 ``engine_dead``)
and calls :meth:`CoreRestarter.on_death`. The restarter then, on a thread of its own:

1. starts a new engine-core process for that replica (the same config: it loads the
   checkpoint again; ``/health`` answers 503 ``dead`` meanwhile, the reason names the restart);
2. tells the listeners on the event loop (the weight-sync manager leaves its transfer group,
   which included the dead core's workers, failing an open update);
3. hands the new core what the dead one held and it must hold before it serves (the
   :attr:`CoreRestarter.adopters`: LoRA adapters loaded from files are loaded again, under their ids;
   adapters pushed by adapter-only syncs died with the process and are dropped, 404 after);
4. sets what the new core serves (:class:`~rlserve.engine.front.weight_state.WeightState`): the
   trained weights died with the old process, so generation answers 503 ``weights_lost`` (the
   reason on ``/health`` and ``/weight_info``) until syncs have written every parameter; with
   ``serve_checkpoint`` (``--serve-checkpoint-after-restart``, one replica only) the reloaded
   checkpoint is served instead, under the checkpoint's own version label, never the lost one.
   A server that served the checkpoint anyway keeps serving it;
5. swaps the new replica in (frozen if generation is paused).

Bounded: at most ``max_restarts`` restarts within ``window_s`` seconds. The next death in the
window (a crash loop), or a restart that fails to start, leaves the replica dead: every request
then answers 503 ``engine_dead`` with :attr:`CoreRestarter.gave_up` as the reason.

A restart while asleep (sleep mode) keeps the server asleep: the new core is put to the same
sleep before it is swapped in (:meth:`~rlserve.engine.front.async_sleep.AsyncSleep.adopt_restarted`),
and ``/wake_up`` then wakes it as any other. The weights it serves after the wake: level 1, the
trained weights (offloaded in the dead process) are lost: 503 ``weights_lost`` until a complete
sync (or the checkpoint, opt-in); level 2 with nothing written since the sleep, the checkpoint
(the level-2 promise: the sleep, not the restart, discarded the trained weights); level 2 after
a partial refill, 503 ``weights_lost`` until a complete sync (the refill died with the process).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time

from rlserve.engine.front.weight_state import WEIGHTS_LOST

logger = logging.getLogger(__name__)

#: Seconds the restarter waits for a listener (the weight-sync manager's teardown) on the loop.
LISTENER_TIMEOUT_S = 60.0


class CoreRestarter:
    """Restart policy and state of an :class:`~rlserve.engine.front.async_engine.AsyncEngine`'s
    engine-core processes (see the module docstring).

    Args:
        aengine: the async engine (process mode).
        max_restarts: restarts allowed within ``window_s`` (>= 1).
        window_s: the window, seconds.
        serve_checkpoint: serve the reloaded checkpoint (its own label) instead of 503
            ``weights_lost``; taken only with one replica (others keep the trained weights).
        start_timeout_s: seconds a new core may take to load.
    """

    def __init__(self, aengine, max_restarts: int = 3, window_s: float = 60.0, serve_checkpoint: bool = False,
                 start_timeout_s: float = 3600.0):
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 1:
            raise ValueError(f"max_restarts must be an integer >= 1, got {max_restarts!r}")
        if not window_s > 0:
            raise ValueError(f"the restart window must be > 0 seconds, got {window_s!r}")
        self.aengine = aengine
        self.max_restarts = max_restarts
        self.window_s = float(window_s)
        self.serve_checkpoint = bool(serve_checkpoint)
        self.start_timeout_s = float(start_timeout_s)
        self.gave_up: str | None = None  # why a dead replica stays dead
        self.restarts = 0
        self.restarting: set[int] = set()  # replica indices being restarted
        self.last_restart_s: float | None = None  # death seen -> new core swapped in, seconds
        self._times: collections.deque = collections.deque()
        self._lock = threading.Lock()
        #: coroutine functions ``fn(replica_index)`` run on :attr:`AsyncEngine.loop` before the swap
        self.listeners: list = []
        #: coroutine functions ``fn(new_replica)`` run on the loop after the listeners, before the swap:
        #: state the dead process held that the new one must hold before it serves (LoRA adapters:
        #: :meth:`rlserve.lora.registry.LoRARegistry.restore`)
        self.adopters: list = []

    def info(self) -> dict:
        """JSON-ready: ``restarts``, ``restarting`` (indices), ``gave_up`` (reason or None),
        ``last_restart_s``, ``max_restarts``, ``window_s``, ``serve_checkpoint``."""
        return {"restarts": self.restarts, "restarting": sorted(self.restarting), "gave_up": self.gave_up,
                "last_restart_s": self.last_restart_s, "max_restarts": self.max_restarts,
                "window_s": self.window_s, "serve_checkpoint": self.serve_checkpoint}

    def on_death(self, replica) -> None:
        """A replica's core died (its reader thread, after ending its requests): restart it on a
        thread, unless the server is closing or the crash budget of the window is spent."""
        if self.aengine._closed is not None:
            return
        now = time.monotonic()
        with self._lock:
            while self._times and now - self._times[0] > self.window_s:
                self._times.popleft()
            if len(self._times) >= self.max_restarts:
                self.gave_up = (f"{replica.death or 'an engine-core process died'}; not restarted again: "
                                f"{len(self._times)} restart(s) within the last {self.window_s:g} s "
                                f"(--max-engine-restarts {self.max_restarts}, --engine-restart-window "
                                f"{self.window_s:g}): a crash loop; restart the server")
                logger.error("%s", self.gave_up)
                return
            self._times.append(now)
            self.restarting.add(replica.index)
        threading.Thread(target=self._restart, args=(replica, now), name=f"rlserve-core-restart-{replica.index}",
                         daemon=True).start()

    # ---- the restart (its own thread) -----------------------------------------------------
    def _restart(self, old, t0: float) -> None:
        from rlserve.engine.front.core_client import CoreProcReplica

        aeng = self.aengine
        logger.warning("restarting the engine-core process of replica %d", old.index)
        try:
            old.join(5.0)  # reaped; its sockets and socket directory go
        except Exception:  # noqa: BLE001 - the new core does not need them
            logger.exception("cleaning up the dead engine-core process failed")
        new = CoreProcReplica(aeng, old.index, old.config, aeng.weights.checkpoint_version, old._tokenizer_loader)
        try:
            new.start()
            new.wait_ready(self.start_timeout_s)
        except BaseException as e:  # noqa: BLE001
            self.gave_up = f"{old.death}; restarting it failed: {type(e).__name__}: {e}"
            logger.error("%s", self.gave_up)
            try:
                new.stop()
                new.join(1.0)
            except Exception:  # noqa: BLE001
                pass
            self.restarting.discard(old.index)
            return
        if aeng._closed is not None:  # the server stopped meanwhile
            new.stop()
            new.join(1.0)
            self.restarting.discard(old.index)
            return
        self._run_on_loop(self.listeners, old.index)
        self._run_on_loop(self.adopters, new)
        loop = getattr(aeng, "loop", None)
        if loop is not None and not loop.is_closed():  # on the loop: no weight-sync commit runs meanwhile
            try:
                asyncio.run_coroutine_threadsafe(self._swap_async(old, new), loop).result(LISTENER_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - e.g. the loop stopped: swap here
                logger.exception("swapping the restarted replica in on the event loop failed")
                self._swap(old, new)
        else:
            self._swap(old, new)
        self.restarts += 1
        self.restarting.discard(old.index)
        self.last_restart_s = time.monotonic() - t0
        logger.warning("engine-core process of replica %d restarted (pid %s) in %.2f s; weights: %s", old.index,
                       new.pid, self.last_restart_s,
                       "served" if aeng.weights.valid else f"503 {aeng.weights.code} until a complete sync")

    async def _swap_async(self, old, new) -> None:
        sleep = getattr(self.aengine, "sleep_mode", None)
        if sleep is None:
            self._swap(old, new)
        else:  # asleep: the new core sleeps too before it is swapped in
            await sleep.adopt_restarted(old.index, new, lambda: self._swap(old, new))

    def _swap(self, old, new) -> None:
        """The weights' state first (a request after the swap sees it), then the new replica in."""
        aeng = self.aengine
        if aeng._replicas[old.index] is new:
            return
        self._set_weights(old)
        if aeng.is_paused():
            new.set_frozen(True)
        aeng._replicas[old.index] = new

    def _run_on_loop(self, fns: list, arg) -> None:
        """``fn(arg)`` of each coroutine function of ``fns`` (the :attr:`listeners` with the dead replica's
        index, the :attr:`adopters` with the new replica), one after the other on the loop, each bounded by
        :data:`LISTENER_TIMEOUT_S`; a failure is logged."""
        loop = getattr(self.aengine, "loop", None)
        if loop is None or loop.is_closed():
            return
        for fn in list(fns):
            try:
                asyncio.run_coroutine_threadsafe(fn(arg), loop).result(LISTENER_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - a listener must not stop the restart
                logger.exception("an engine-restart listener failed")

    def _set_weights(self, old) -> None:
        """What the new core serves (module docstring, step 4)."""
        aeng = self.aengine
        w = aeng.weights
        if w.valid and w.version == w.checkpoint_version:
            return  # the checkpoint was served: the new core serves the same weights
        if not w.valid and w.reload_ok:
            return  # asleep at level 2, nothing written: the wake reloads the checkpoint, as promised
        if self.serve_checkpoint and aeng.num_replicas == 1:
            aeng.checkpoint_reloaded()
            logger.warning("serving the checkpoint after the restart, as version %s (--serve-checkpoint-after-restart)",
                           w.checkpoint_version)
            return
        cause = getattr(old, "exit_cause", None) or old.death  # not "... cannot generate until it is restarted"
        aeng.lose_weights(f"{cause}; it was restarted and the trained weights (version {w.version}) died with it: "
                          "generation answers 503 until a complete weight sync (or start the server with "
                          "--serve-checkpoint-after-restart to serve the checkpoint instead)", WEIGHTS_LOST)
