"""Sleep mode (vLLM's ``--enable-sleep-mode``): one engine replica's state machine.

``engine.sleep(level)`` gives the GPU memory of the weights and the KV cache back while a
colocated trainer trains; ``engine.wake_up(tags)`` takes it back (both only with
``EngineConfig.enable_sleep_mode``; the memory itself is handled on every TP worker by
:mod:`rlserve.engine.worker.sleep_memory`). Semantics are vLLM's:

* level 1: weights copied to (pinned) host memory, KV cache discarded; ``wake_up`` restores the
  weights exactly;
* level 2: weights and KV cache discarded. They must be refilled before generating: by a weight
  sync (``wake_up(tags=["weights"])`` maps the memory, the sync fills it, then
  ``wake_up(tags=["kv_cache"])``), or, when the engine becomes fully awake and no weights were
  loaded since the sleep, by reloading the checkpoint it started with (``--load-format dummy``:
  the same seeded random weights). So a level-2 engine never generates from garbage (vLLM
  leaves that to a separate ``reload_weights`` call);
* ``tags`` (``"weights"``, ``"kv_cache"``; default both) wake the regions separately; the
  engine generates only once both are awake.

Out-of-order calls raise :class:`~rlserve.errors.SleepStateError` (HTTP 409) and change
nothing: ``wake_up`` when none of its tags sleeps, ``sleep`` while asleep or with requests in
flight, loading weights into weights that are not in device memory. Adding a request while
asleep raises :class:`~rlserve.errors.ModelSleepingError` (503).

The functions ``core_*`` run in the replica (``AsyncEngine.call_engines``); the server's half
(pause, 503s, the routes) is :mod:`rlserve.engine.front.async_sleep`.
"""

from __future__ import annotations

import logging
import time

from rlserve.engine.worker.sleep_memory import KV_CACHE, TAGS, WEIGHTS
from rlserve.errors import InvalidRequestError, ModelSleepingError, SleepMemoryError, SleepStateError

logger = logging.getLogger(__name__)

_MEM = "rlserve.engine.worker.sleep_memory:"


def check_level(level) -> int:
    """1 or 2. Raises InvalidRequestError (400) otherwise."""
    if isinstance(level, bool) or level not in (1, 2):
        raise InvalidRequestError(f"sleep level must be 1 or 2, got {level!r}")
    return int(level)


def check_tags(tags) -> list[str]:
    """``None`` (or empty) → both tags; else a list of known tags, in canonical order.
    Raises InvalidRequestError (400) for an unknown tag."""
    if not tags:
        return list(TAGS)
    bad = sorted({str(t) for t in tags} - set(TAGS))
    if bad:
        raise InvalidRequestError(f"unknown wake_up tag(s) {bad}; known: {list(TAGS)}")
    return [t for t in TAGS if t in tags]


class EngineSleep:
    """Sleep state of one :class:`~rlserve.engine.core.llm_engine.LLMEngine` (all its TP workers).

    Attributes:
        state: ``{"weights" | "kv_cache": None (awake) | "offloaded" | "discarded"}``.
        level: the level of the sleep in force (0: fully awake).
        needs_weights: level-2 weights not yet refilled (a reload happens at the full wake).
        stats: counters and the last operation's numbers (see :meth:`info`).
    """

    def __init__(self, engine):
        self.engine = engine
        self.state: dict[str, str | None] = {t: None for t in TAGS}
        self.level = 0
        self.needs_weights = False
        self.stats = {"sleeps": 0, "wake_ups": 0, "reloads": 0, "last_sleep_bytes": 0, "last_sleep_copied_bytes": 0,
                      "last_sleep_s": None, "last_wake_up_s": None, "last_reload_s": None}
        sizes = engine.collective_rpc(_MEM + "worker_region_bytes")
        self.region_bytes = {t: sum(int(s[t]) for s in sizes) for t in TAGS}  # over TP ranks
        # CUDA: a sleeping region's pages go back to the driver; CPU: they stay allocated
        self.releases_memory = all(engine.collective_rpc(_MEM + "worker_releases_memory"))

    # ---- queries -------------------------------------------------------------------
    def is_sleeping(self) -> bool:
        """True while any region sleeps (the engine generates only when this is False)."""
        return any(v is not None for v in self.state.values())

    def check_generate(self) -> None:
        """Raises ModelSleepingError (503) while asleep."""
        if self.is_sleeping():
            raise ModelSleepingError(f"the model is sleeping (level {self.level}; asleep: "
                                     f"{', '.join(t for t in TAGS if self.state[t])}): POST /wake_up first")

    def check_weights_writable(self) -> None:
        """Raises SleepStateError (409) when the weights are not in device memory (a load
        would write into released pages)."""
        s = self.state[WEIGHTS]
        if s == "offloaded":
            raise SleepStateError("the weights are offloaded to host memory by a level-1 sleep: wake_up first "
                                  "(a weight sync would be overwritten by the wake's copy-back)",
                                  code="weights_offloaded")
        if s == "discarded":
            raise SleepStateError("the weights' memory is released by a level-2 sleep: wake_up(tags=weights) "
                                  "before loading weights", code="weights_asleep")

    def info(self) -> dict:
        """JSON-ready state: ``is_sleeping``, ``level``, ``tags`` (per tag: ``awake`` /
        ``offloaded`` / ``discarded``), ``bytes`` (device bytes of each region, all TP ranks),
        ``bytes_discarded`` (bytes of the sleeping regions: their contents are gone from the
        device, offloaded or dropped), ``bytes_released`` (of those, the bytes given back to
        the driver now: all of them on CUDA, 0 on the CPU, where the memory stays allocated),
        counters, ``last_sleep_copied_bytes`` (bytes the last sleep copied to host memory: a
        level-1 sleep's weights on CUDA; 0 on the CPU, whose weights are only set aside) and the
        last times in seconds."""
        asleep = sum(self.region_bytes[t] for t in TAGS if self.state[t])
        return {"is_sleeping": self.is_sleeping(), "level": self.level, "needs_weights": self.needs_weights,
                "tags": {t: self.state[t] or "awake" for t in TAGS}, "bytes": dict(self.region_bytes),
                "bytes_discarded": asleep, "bytes_released": asleep if self.releases_memory else 0, **self.stats}

    # ---- transitions -----------------------------------------------------------------
    def sleep(self, level: int = 1) -> dict:
        """Release the memory (see the module docstring). Resets the prefix cache (its KV is
        gone). Returns :meth:`info`.

        Raises:
            InvalidRequestError: level not 1 or 2. SleepStateError: already asleep, or requests
                in flight (the server aborts or drains them first).
        """
        level = check_level(level)
        if self.is_sleeping():
            raise SleepStateError(f"already sleeping (level {self.level}): wake_up first", code="already_sleeping")
        if self.engine.has_unfinished_requests():
            raise SleepStateError("requests are in flight: abort or finish them before sleeping",
                                  code="requests_in_flight")
        self.engine.reset_prefix_cache()
        t0 = time.perf_counter()
        res = self.engine.collective_rpc(_MEM + "worker_sleep", level)
        released = sum(int(r["released"]) for r in res)
        copied = sum(int(r["copied"]) for r in res)
        self.state = {WEIGHTS: "offloaded" if level == 1 else "discarded", KV_CACHE: "discarded"}
        self.level = level
        self.needs_weights = level == 2
        self.stats.update(sleeps=self.stats["sleeps"] + 1, last_sleep_bytes=released,
                          last_sleep_copied_bytes=copied, last_sleep_s=time.perf_counter() - t0)
        logger.info("sleep level %d: %.1f MiB released, %.1f MiB copied to host memory in %.3f s", level,
                    released / 2**20, copied / 2**20, self.stats["last_sleep_s"])
        return self.info()

    def wake_up(self, tags=None, weights_refilled: bool = False) -> dict:
        """Take the memory of ``tags`` back (default both). ``weights_refilled``: do not reload
        the checkpoint: weights were written since a level-2 sleep (the server passes it whenever
        a sync wrote, complete or not: its ``AsyncEngine.weights`` decides what is served). When
        this leaves the engine fully awake with level-2 weights nobody refilled, they are
        reloaded from the checkpoint.
        Returns :meth:`info`.

        Raises:
            InvalidRequestError: unknown tag. SleepStateError: none of ``tags`` sleeps.
            SleepMemoryError: the memory is not free (the regions stay asleep).
        """
        tags = check_tags(tags)
        asleep = [t for t in tags if self.state[t]]
        if not asleep:
            raise SleepStateError(f"not sleeping ({', '.join(tags)} already awake): nothing to wake up",
                                  code="not_sleeping")
        if weights_refilled:
            self.needs_weights = False
        t0 = time.perf_counter()
        try:
            self.engine.collective_rpc(_MEM + "worker_wake_up", asleep)
        except Exception as e:
            self._back_to_sleep(asleep)
            from rlserve.engine.worker.cuda_vmm import CUDADriverError

            if isinstance(e, CUDADriverError) and e.out_of_memory:
                raise SleepMemoryError(f"wake_up({', '.join(asleep)}): the GPU memory is not free ({e}); "
                                       "the engine stays asleep, retry once the other process released it") from e
            raise
        for t in asleep:
            self.state[t] = None
        if not self.is_sleeping():
            self.level = 0
            if self.needs_weights:
                self._reload()
        self.stats.update(wake_ups=self.stats["wake_ups"] + 1, last_wake_up_s=time.perf_counter() - t0)
        logger.info("wake_up(%s) in %.3f s", ", ".join(asleep), self.stats["last_wake_up_s"])
        return self.info()

    def note_weights_loaded(self) -> None:
        """Weights were written (a weight sync, ``engine.load_weights``): level-2 weights are
        refilled and need no reload."""
        if self.state[WEIGHTS] is None:
            self.needs_weights = False

    def _reload(self) -> None:
        t0 = time.perf_counter()
        self.engine.collective_rpc(_MEM + "worker_reload_weights")
        self.engine.reset_prefix_cache()
        self.needs_weights = False
        self.stats.update(reloads=self.stats["reloads"] + 1, last_reload_s=time.perf_counter() - t0)
        logger.info("level-2 weights were not refilled by a weight sync: reloaded from %s (%s) in %.2f s",
                    self.engine.config.model, self.engine.config.load_format, self.stats["last_reload_s"])

    def _back_to_sleep(self, tags: list) -> None:
        """After a failed wake of ``tags``: release again whatever some TP rank did get back
        (regions still asleep are skipped), so every rank agrees with :attr:`state`."""
        try:
            self.engine.collective_rpc(_MEM + "worker_sleep", max(self.level, 1), list(tags))
        except Exception:  # noqa: BLE001 - the original error is what the caller needs
            logger.exception("releasing memory again after a failed wake_up failed")


# ---- engine-side targets of AsyncEngine.call_engines ---------------------------------------
def _sleep_of(core) -> EngineSleep:
    s = getattr(core.engine, "sleep_mode", None)
    if s is None:
        raise SleepStateError("sleep mode is off: start the server with --enable-sleep-mode",
                              code="sleep_mode_disabled")
    return s


def core_sleep(core, level: int) -> dict:
    """``call_engines`` target: :meth:`EngineSleep.sleep` of this replica."""
    return _sleep_of(core).sleep(level)


def core_wake_up(core, tags: list, weights_refilled: bool) -> dict:
    """``call_engines`` target: :meth:`EngineSleep.wake_up` of this replica."""
    return _sleep_of(core).wake_up(tags, weights_refilled=weights_refilled)


def core_info(core) -> dict:
    """``call_engines`` target: :meth:`EngineSleep.info` of this replica."""
    return _sleep_of(core).info()
