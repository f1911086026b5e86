"""Sleep mode's routes, with vLLM's names: ``POST /sleep?level=1|2``, ``POST /wake_up`` (optional
``tags=weights`` / ``tags=kv_cache``, repeatable), ``GET /is_sleeping``.

``/sleep`` and ``/wake_up`` are control routes (``--admin-key``, or a loopback bind);
``/is_sleeping`` is open. Answers: 200 with the sleep state (:meth:`AsyncSleep.info`; vLLM
answers an empty 200, so clients ignore the body); 400 for a bad level, mode or tag, or a server
started without ``--enable-sleep-mode`` (``sleep_mode_disabled``); 409 for a call out of order,
nothing changed (``not_sleeping``, ``already_sleeping``, ``weight_update_in_progress``); 503
``wake_up_out_of_memory`` when another process holds the memory a wake needs (still asleep).
Semantics: :mod:`rlserve.engine.front.async_sleep`.
"""

from __future__ import annotations

from typing import List, Optional

from fastapi import APIRouter, Query

from rlserve.errors import SleepStateError
from rlserve.server.request_body import FastJSONRoute
from rlserve.server.state import ServerState


def _sleep_of(state: ServerState):
    sleep = getattr(state.aengine, "sleep_mode", None)
    if sleep is None:
        raise SleepStateError("sleep mode is off: start the server with --enable-sleep-mode",
                              code="sleep_mode_disabled")
    return sleep


async def sleep_info(state: ServerState) -> dict | None:
    """The sleep state for ``/server_info`` and ``/metrics`` (None without sleep mode); reads
    the replicas' region sizes the first time."""
    sleep = getattr(state.aengine, "sleep_mode", None)
    if sleep is None:
        return None
    if not sleep.replicas and state.aengine.is_alive():
        await sleep.refresh()
    return sleep.info()


def make_sleep_routers(state: ServerState, admin_dependencies: list) -> tuple[APIRouter, APIRouter]:
    """``(public, admin)`` routers: ``/is_sleeping``; ``/sleep`` and ``/wake_up``."""
    public = APIRouter()
    admin = APIRouter(dependencies=admin_dependencies, route_class=FastJSONRoute)

    @public.get("/is_sleeping")
    async def is_sleeping():
        """``{"is_sleeping": bool}`` (vLLM's answer): true while any memory region sleeps."""
        return {"is_sleeping": state.aengine.is_sleeping() if hasattr(state.aengine, "is_sleeping") else False}

    @admin.post("/sleep")
    async def sleep(level: int = Query(1, description="1: weights to host memory, KV cache discarded; "
                                                       "2: both discarded"),
                    mode: str = Query("abort", description="abort (vLLM's default: requests in flight end "
                                                           "with finish_reason abort) | wait (they finish first)")):
        """Free the GPU memory of the weights and the KV cache; new requests get 503 until
        ``/wake_up``."""
        try:
            return await _sleep_of(state).sleep(level, mode)
        finally:  # (--api-server-count N: the other processes' scrapes read the gauges process 0 wrote)
            await _sleep_gauges(state)

    @admin.post("/wake_up")
    async def wake_up(tags: Optional[List[str]] = Query(None, description="weights | kv_cache (repeatable); "
                                                                           "default both")):
        """Take the memory back (``tags`` separately: ``weights`` first lets a weight sync land
        before the KV cache is re-allocated); generation resumes once both are awake."""
        try:
            return await _sleep_of(state).wake_up(tags)
        finally:
            await _sleep_gauges(state)

    return public, admin


async def _sleep_gauges(state: ServerState) -> None:
    """The sleep-mode gauges set now (after a sleep / wake_up), not only at this process's next scrape."""
    info = await sleep_info(state)
    if info is not None:
        state.metrics.set_sleep(info)


def connect_weight_manager(state: ServerState) -> None:
    """Sleep mode and weight sync meet here: a sleep is refused while the manager has an update
    open (its ``sleep_blocker()``), and the manager asks sleep mode before writing weights (its
    ``sleep_mode`` attribute: 409 at level 1, the memory mapped first at level 2)."""
    sleep, manager = getattr(state.aengine, "sleep_mode", None), state.weight_manager
    if sleep is None or manager is None:
        return
    blocker = getattr(manager, "sleep_blocker", None)
    if callable(blocker):
        sleep.busy = blocker
    manager.sleep_mode = sleep
