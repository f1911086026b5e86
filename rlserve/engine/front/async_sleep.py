"""The server's half of sleep mode: :class:`AsyncSleep` drives every replica's
:class:`~rlserve.engine.core.sleep_mode.EngineSleep` from the API process, around generation.

``sleep(level, mode)``:

1. refused with 409 (:class:`~rlserve.errors.SleepStateError`, nothing changed) while asleep or
   while a weight update is open (``busy()``, the weight-sync manager's check);
2. new requests get 503 ``model_sleeping`` from here on;
3. generation pauses (``mode="abort"``, vLLM's default: requests in flight end with
   ``finish_reason == "abort"``; ``"wait"``: they finish first); requests held by an earlier
   pause are aborted too (nothing could run them until the wake);
4. every replica releases its memory (``core_sleep``).

An engine core restarted while asleep is put to the same sleep before it serves
(:meth:`AsyncSleep.adopt_restarted`).

``wake_up(tags)`` takes the tags' memory back on every replica; once nothing sleeps, requests
are accepted again and generation resumes (unless it was paused before the sleep: that pause
stays). The weights after a level-2 sleep (``AsyncEngine.weights``,
:mod:`rlserve.engine.front.weight_state`) are either a complete refill by syncs (served under the
version of the sync that completed it), or, when nothing was written since the sleep, the
checkpoint reloaded at the full wake (served under the checkpoint's own version label), or
neither: a partial or failed refill is never served, generation answers 503 ``weights_lost``
until syncs have written every parameter.

Requests while asleep get **503, not held**. Why: a sleep lasts a training step (minutes, with
no bound the server knows of), far beyond the hold a pause gives (``--pause-hold-timeout``) and
most HTTP clients' timeouts; with the KV cache gone, nothing could run them anyway; the trainer
that put the server to sleep knows when it wakes it, and a rollout client that did not know
gets an immediate, explicit answer it can retry on. vLLM's sleep mode also answers 503 for the
routes that need the weights. ``/health`` stays 200 (the server is healthy, just asleep).
"""

from __future__ import annotations

import asyncio
import logging
import time

from rlserve.engine.worker.sleep_memory import TAGS, WEIGHTS
from rlserve.engine.core.sleep_mode import check_level, check_tags
from rlserve.engine.front.weight_state import WEIGHTS_LOST
from rlserve.errors import InvalidRequestError, ModelSleepingError, SleepStateError

logger = logging.getLogger(__name__)

_CALL = "rlserve.engine.core.sleep_mode:"
SLEEP_MODES = ("abort", "wait")
#: why generation answers 503 ``weights_lost`` after a level-2 sleep whose refill is incomplete
LEVEL2_LOST = ("a level-2 sleep discarded the weights and the weight syncs since did not write every parameter (or "
               "one failed): generation answers 503 until syncs have written all of them")


class AsyncSleep:
    """Sleep state of an :class:`~rlserve.engine.front.async_engine.AsyncEngine` (all replicas).

    Args:
        aengine: the async engine (built with ``enable_sleep_mode``).
        busy: ``busy() -> str | None``: why a sleep must wait (an open weight update), set by
            the server once the weight-sync manager exists.
    """

    def __init__(self, aengine, busy=None):
        self.aengine = aengine
        self.busy = busy or (lambda: None)
        self.state: dict[str, str | None] = {t: None for t in TAGS}
        self.level = 0
        self.replicas: list[dict] = []  # the replicas' EngineSleep.info() after the last call
        self._lock: asyncio.Lock | None = None
        self._paused_before = False
        self.totals = {"sleeps": 0, "wake_ups": 0, "last_sleep_s": None, "last_wake_up_s": None}

    # ---- queries -------------------------------------------------------------------
    def is_sleeping(self) -> bool:
        return any(v is not None for v in self.state.values())

    def check_generate(self) -> None:
        """Raises ModelSleepingError (503) while asleep or falling asleep."""
        if self.is_sleeping():
            raise ModelSleepingError(f"the model is sleeping (level {self.level}): POST /wake_up first; "
                                     "requests are not held while asleep")

    def check_weight_sync(self) -> list[str]:
        """Before a weight update: raises SleepStateError (409, ``weights_offloaded``) when a
        level-1 sleep holds the weights in host memory (the wake would copy the old ones back
        over the update). Returns the tags to wake first: ``["weights"]`` when a level-2 sleep
        released them (the sync then fills fresh memory), else ``[]``."""
        s = self.state[WEIGHTS]
        if s == "offloaded":
            raise SleepStateError("the server sleeps at level 1 (weights offloaded to host memory): wake_up before "
                                  "a weight sync, or sleep at level 2 to have the sync refill them",
                                  code="weights_offloaded")
        return [WEIGHTS] if s == "discarded" else []

    def info(self) -> dict:
        """JSON-ready: ``is_sleeping``, ``level``, ``tags`` (per tag ``awake`` / ``offloaded``
        / ``discarded``), ``bytes`` (device bytes of each region, all replicas and TP ranks),
        ``bytes_discarded`` (bytes of the sleeping regions) and ``bytes_released`` (of those,
        given back to the driver: 0 on the CPU), ``sleeps`` / ``wake_ups`` / ``reloads`` counts,
        ``last_sleep_copied_bytes`` (what the last sleep copied to host memory: level-1 weights on
        CUDA, 0 on the CPU) and the last ``sleep`` / ``wake_up`` times in seconds (server side,
        pause included)."""
        reps = self.replicas
        return {
            "is_sleeping": self.is_sleeping(), "level": self.level,
            "tags": {t: self.state[t] or "awake" for t in TAGS},
            "bytes": {t: sum(int(r["bytes"][t]) for r in reps) for t in TAGS},
            "bytes_discarded": sum(int(r["bytes_discarded"]) for r in reps),
            "bytes_released": sum(int(r["bytes_released"]) for r in reps),
            "reloads": sum(int(r["reloads"]) for r in reps),
            "last_sleep_copied_bytes": sum(int(r.get("last_sleep_copied_bytes", 0)) for r in reps), **self.totals,
        }

    async def refresh(self) -> dict:
        """Read every replica's state (at start-up: the region sizes). Returns :meth:`info`."""
        self.replicas = list(await self.aengine.call_engines(_CALL + "core_info"))
        return self.info()

    # ---- transitions -----------------------------------------------------------------
    def _get_lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def sleep(self, level: int = 1, mode: str = "abort") -> dict:
        """Pause, abort or drain, release (see the module docstring). Returns :meth:`info`.

        Raises:
            InvalidRequestError: bad level or mode. SleepStateError: asleep already, a weight
                update is open. Whatever a replica raised (generation is resumed then, as it was).
        """
        level = check_level(level)
        if mode not in SLEEP_MODES:
            raise InvalidRequestError(f"sleep mode must be one of {', '.join(SLEEP_MODES)}, got {mode!r}")
        async with self._get_lock():
            if self.is_sleeping():
                raise SleepStateError(f"already sleeping (level {self.level}): wake_up first", code="already_sleeping")
            why = self.busy()
            if why:
                raise SleepStateError(f"cannot sleep now: {why}", code="weight_update_in_progress")
            t0 = time.perf_counter()
            aeng = self.aengine
            paused_before = aeng.is_paused()
            self.state = {t: "falling_asleep" for t in TAGS}  # new requests: 503 from now on
            self.level = level
            try:
                await aeng.pause(mode=mode)
                await aeng.abort_all()  # held by an earlier pause: nothing runs them until the wake
                self.replicas = list(await aeng.call_engines(_CALL + "core_sleep", level))
            except BaseException:
                await self._undo_sleep(paused_before)
                raise
            self._paused_before = paused_before
            if level == 2:
                aeng.lose_weights(LEVEL2_LOST, WEIGHTS_LOST, reload_ok=True)
            self.state = dict(self.replicas[0]["tags"])
            self.state = {t: (None if v == "awake" else v) for t, v in self.state.items()}
            self.totals.update(sleeps=self.totals["sleeps"] + 1, last_sleep_s=time.perf_counter() - t0)
        info = self.info()
        logger.info("asleep (level %d): %.1f MiB discarded, %.1f MiB released in %.2f s", level,
                    info["bytes_discarded"] / 2**20, info["bytes_released"] / 2**20, self.totals["last_sleep_s"])
        return info

    async def _undo_sleep(self, paused_before: bool) -> None:
        """A sleep that failed: back to what every replica reports, generation as before."""
        try:
            self.replicas = list(await self.aengine.call_engines(_CALL + "core_info"))
            tags = self.replicas[0]["tags"] if self.replicas else {}
        except Exception:  # noqa: BLE001 - keep the original error
            logger.exception("reading the sleep state after a failed sleep failed")
            tags = {}
        self.state = {t: (None if tags.get(t, "awake") == "awake" else tags[t]) for t in TAGS}
        if not self.is_sleeping():
            self.level = 0
            if not paused_before and self.aengine.is_paused():
                await self.aengine.resume()

    async def wake_up(self, tags=None) -> dict:
        """Take the memory of ``tags`` (default both) back on every replica; generation resumes
        once nothing sleeps. Returns :meth:`info`.

        Raises:
            InvalidRequestError: unknown tag. SleepStateError: none of ``tags`` sleeps.
            SleepMemoryError: the GPU memory is taken (the regions stay asleep).
        """
        tags = check_tags(tags)
        async with self._get_lock():
            return await self._wake_locked(tags)

    async def _wake_locked(self, tags: list[str]) -> dict:
        asleep = [t for t in tags if self.state[t]]
        if not asleep:
            raise SleepStateError(f"not sleeping ({', '.join(tags)} already awake): nothing to wake up",
                                  code="not_sleeping")
        t0 = time.perf_counter()
        # the checkpoint is reloaded (at the full wake) only while nothing was written since a
        # level-2 sleep discarded the weights; a sync (partial or failed) leaves the refill to syncs,
        # and so does one still open: it may have written in place already (WeightState learns of
        # its writes only at its commit) and a reload now would serve a mix under its version
        reload = self.aengine.weights.reload_ok and not self.busy()
        try:
            self.replicas = list(await self.aengine.call_engines(_CALL + "core_wake_up", asleep, not reload))
        except BaseException:
            await self._undo_sleep(True)  # whatever the replicas say now; stays paused
            raise
        for t in asleep:
            self.state[t] = None
        if reload and not self.is_sleeping():
            self.aengine.checkpoint_reloaded()  # served under the checkpoint's own label
        self.totals.update(wake_ups=self.totals["wake_ups"] + 1, last_wake_up_s=time.perf_counter() - t0)
        if not self.is_sleeping():
            self.level = 0
            if not self._paused_before:
                await self.aengine.resume()
            else:  # still paused (an earlier pause): the other API processes hold instead of refusing
                await self.aengine.front_sync.publish()
        logger.info("wake_up(%s) in %.2f s%s", ", ".join(asleep), self.totals["last_wake_up_s"],
                    "" if self.is_sleeping() else ": awake")
        return self.info()

    async def adopt_restarted(self, index: int, new, swap) -> None:
        """An engine-core restart (:class:`~rlserve.engine.front.core_restart.CoreRestarter`)
        while asleep: the new core (awake, the checkpoint loaded) is put to the sleep in force
        -- the same level, the tags the server woke already woken -- before ``swap()`` puts it
        in service, so the server stays asleep as its clients were told (a trainer that put it
        to sleep for the GPU memory gets it back once the restart loaded). Awake: just
        ``swap()``. What the wake serves: a level-1 wake copies the new core's offloaded
        checkpoint back; a level-2 wake reloads it only where nothing was written since the
        sleep (:attr:`WeightState.reload_ok`); the weight state decides the label or the 503.

        Raises:
            what the new core's ``core_sleep`` / ``core_wake_up`` raised (the restart then fails).
        """
        async with self._get_lock():
            if self.is_sleeping():
                level = self.level or 1
                info = await asyncio.wrap_future(new.call(_CALL + "core_sleep", level))
                awake = [t for t in TAGS if self.state[t] is None]
                if awake:  # level 2: the weights stay "needing a refill" on the core, as the others'
                    info = await asyncio.wrap_future(new.call(_CALL + "core_wake_up", awake, False))
                if index < len(self.replicas):
                    self.replicas[index] = info
            swap()
            if self.is_sleeping() and self.level == 2 and self.aengine.weights.valid:
                # the new core's checkpoint was discarded by its sleep: as after sleep(level=2)
                self.aengine.lose_weights(LEVEL2_LOST, WEIGHTS_LOST, reload_ok=True)

    async def before_weight_sync(self) -> None:
        """Called by the weight-sync manager before an update may write weights (with its own
        busy flag set, so no sleep starts after this): waits for a sleep in progress, then 409
        at level 1 (see :meth:`check_weight_sync`); at level 2 the weights' memory is mapped
        first (``wake_up(tags=["weights"])``, contents undefined until the update fills them).

        Raises:
            SleepStateError: ``weights_offloaded``. SleepMemoryError: the memory is taken.
        """
        async with self._get_lock():
            tags = self.check_weight_sync()
            if tags:
                await self._wake_locked(tags)
