"""The async front's serving loop (``AsyncEngine.loop``) is not taken over by a second, short-lived
event loop: ``asyncio.run(aengine.call_engines(...))`` beside a running server (as several tests and
trainer scripts do) leaves the engine-core replica's outputs handled on the serving loop, not on
the replica's reader thread once that short loop closed (``CoreProcReplica._drain``'s fallback for
"no loop serving"), and a loop that stopped is replaced by the next one that calls in.

Deterministic: the request is held behind a ``keep`` pause while the short loop runs and closes,
so every one of its outputs is received after it closed (no step can run before the resume)."""

from __future__ import annotations

import asyncio
import threading

import pytest

T = 60.0  # bound on every wait in this module (seconds): catches hangs only
HERE = "tests.test_engine_loop_binding"  # this module as the engine-core process imports it


def core_request_ids(core) -> list[str]:
    """Engine call: the requests the core tracks."""
    return sorted(core.requests)


def set_stats_every(core, seconds: float) -> float:
    """Engine call: the core's stats period (``engine_core.STATS_EVERY_S``) set; returns the old one."""
    from rlserve.engine.core import engine_core

    old, engine_core.STATS_EVERY_S = engine_core.STATS_EVERY_S, seconds
    return old


@pytest.fixture(scope="module")
def aeng(tiny_model):
    from rlserve.config import EngineConfig
    from rlserve.engine.front.async_engine import AsyncEngine

    engine = AsyncEngine(EngineConfig(model=tiny_model("llama"), device="cpu", dtype="float32", max_model_len=256),
                         engine_mode="process")
    try:
        yield engine
    finally:
        engine.shutdown()


async def _tokens(aeng, request_id):
    from rlserve.engine.sampling_params import SamplingParams

    last = None
    async for out in aeng.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                   request_id):
        last = out
    return list(last.outputs[0].token_ids)


def test_a_short_lived_loop_does_not_take_the_serving_loop(aeng):
    serving = asyncio.new_event_loop()
    server_thread = threading.Thread(target=serving.run_forever, daemon=True)
    server_thread.start()

    def on_serving(coro):
        return asyncio.run_coroutine_threadsafe(coro, serving).result(T)

    replica = aeng._replicas[0]
    routed_on: list[str] = []  # the thread that handled each batch of outputs
    real_route = replica.route

    def route(outputs=(), errors=()):
        routed_on.append(threading.current_thread().name)
        real_route(outputs, errors)

    try:
        reference = on_serving(_tokens(aeng, "reference"))  # binds the serving loop
        assert aeng.loop is serving and len(reference) == 12
        replica.route = route
        on_serving(aeng.pause("keep"))
        held = asyncio.run_coroutine_threadsafe(_tokens(aeng, "held"), serving)
        on_serving(asyncio.sleep(0))  # (the request is submitted: held by the pause)
        assert aeng.num_held == 1

        # a second loop, closed when asyncio.run returns: the core tracks no request (it is held)
        assert asyncio.run(asyncio.wait_for(aeng.call_engines(f"{HERE}:core_request_ids"), T)) == [[]]
        assert aeng.loop is serving  # was the short loop (closed) on the old code

        on_serving(aeng.resume())
        assert held.result(T) == reference  # the same greedy tokens, every output received after the close
        assert routed_on and set(routed_on) == {server_thread.name}  # the old code: the reader thread
    finally:
        replica.route = real_route
        serving.call_soon_threadsafe(serving.stop)
        server_thread.join(T)
        serving.close()

    # the serving loop stopped: the next loop that calls in becomes the engine's loop
    async def call_and_loop():
        return await aeng.call_engines(f"{HERE}:core_request_ids"), asyncio.get_running_loop()

    tracked, loop = asyncio.run(asyncio.wait_for(call_and_loop(), T))
    assert tracked == [[]] and aeng.loop is loop


class _Lifespan:
    """The ASGI lifespan protocol as a server (uvicorn) drives it: the app's startup, later its shutdown."""

    def __init__(self, app):
        self.sent: list[str] = []
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._changed = asyncio.Event()
        self._task = asyncio.ensure_future(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
                                               self._inbox.get, self._send))

    async def _send(self, message):
        self.sent.append(message["type"])
        self._changed.set()

    async def _step(self, message: str) -> None:
        self._changed.clear()
        await self._inbox.put({"type": message})
        await self._changed.wait()

    async def stop(self) -> None:
        await self._step("lifespan.shutdown")
        await self._task


async def _lifespan(app) -> _Lifespan:
    lifespan = _Lifespan(app)
    await lifespan._step("lifespan.startup")
    return lifespan


def test_the_servers_startup_binds_its_loop_first(aeng, tiny_model):
    """The app's startup binds the server's loop, so a short-lived loop that calls in before the
    server's first request or control call does not become the engine's loop (nor after it)."""
    from rlserve.server.app import build_app
    from rlserve.server.state import ServerSettings

    app = build_app(aeng, ServerSettings(model=tiny_model("llama"), served_model_names=["tiny"]))
    serving = asyncio.new_event_loop()
    server_thread = threading.Thread(target=serving.run_forever, daemon=True)
    server_thread.start()
    try:
        lifespan = asyncio.run_coroutine_threadsafe(_lifespan(app), serving).result(T)
        assert lifespan.sent == ["lifespan.startup.complete"]
        assert aeng.loop is serving  # (the previous test left a closed loop bound)
        assert asyncio.run(asyncio.wait_for(aeng.call_engines(f"{HERE}:core_request_ids"), T)) == [[]]
        assert aeng.loop is serving
        asyncio.run_coroutine_threadsafe(lifespan.stop(), serving).result(T)
        assert lifespan.sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    finally:
        serving.call_soon_threadsafe(serving.stop)
        server_thread.join(T)
        serving.close()


class _WatchedLoop(asyncio.SelectorEventLoop):
    """An event loop that says when ``watched`` (a replica's ``_handle_pending``) was queued on it."""

    def __init__(self, watched):
        super().__init__()
        self.watched = watched
        self.queued = threading.Event()

    def call_soon_threadsafe(self, callback, *args, context=None):
        handle = super().call_soon_threadsafe(callback, *args, context=context)
        if callback == self.watched:
            self.queued.set()
        return handle


def test_frames_queued_for_a_loop_that_stops_are_handled(aeng):
    """The reader queued its ``_handle_pending`` callback on the engine's loop and the loop stopped
    before running it (as the server's does at shutdown; closing it then drops the callback): the
    frames are handled on the reader thread -- a call's answer arrives, a request in flight gets its
    last output and leaves the replica. On the old code they waited for the core's next frame: an
    idle or frozen core sends one (its stats) about every second; with that turned off here, none (the
    abort's answer: TimeoutError).

    Deterministic: the core is frozen (no step) and sends no stats, so the abort's two frames (the
    request's last output, then the answer) are the only ones; the loop is held in a callback of its
    own until the reader has queued its callback behind it with both received."""
    from rlserve.engine.sampling_params import SamplingParams
    from tests.scaleout_harness import wait_for

    replica = aeng._replicas[0]
    loop = _WatchedLoop(replica._handle_pending)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    release = threading.Event()
    outs = []

    async def consume():
        async for out in aeng.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                                       "stopped-loop"):
            outs.append(out)

    async def start():
        return asyncio.ensure_future(consume())

    def busy():
        busy_in.set()
        release.wait(600)  # set by the test (and its finally): bounds a hang only
        loop.stop()  # ends this iteration: the callback queued meanwhile stays queued, not run

    busy_in = threading.Event()
    stats_every = None
    try:
        task = asyncio.run_coroutine_threadsafe(start(), loop).result(T)
        wait_for(lambda: outs, "the request's first output", T)
        assert aeng.loop is loop
        replica.set_frozen(True).result(T)  # the core steps no more
        stats_every = replica.call(f"{HERE}:set_stats_every", 1e9).result(T)  # (after the freeze's stats)
        loop.call_soon_threadsafe(busy)
        assert busy_in.wait(T)
        loop.queued.clear()
        aborted = replica.abort(["stopped-loop"])  # the request's last output, then the answer
        wait_for(lambda: loop.queued.is_set() and len(replica._pending) >= 2, "both frames queued", T)
        release.set()
        thread.join(T)
        assert not thread.is_alive() and not loop.is_running()
        assert aborted.result(T) is None  # the old code: TimeoutError (the frames sat in _pending)
        assert "stopped-loop" not in replica.reqs and replica.load == 0 and not replica._pending
        loop.run_until_complete(asyncio.wait_for(task, T))  # the last output, delivered to its loop
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        assert 1 <= len(outs[-1].outputs[0].token_ids) < 200
    finally:
        release.set()
        if stats_every is not None:
            replica.call(f"{HERE}:set_stats_every", stats_every).result(T)
        replica.set_frozen(False).result(T)
        if thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
            thread.join(T)
        loop.close()
