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
