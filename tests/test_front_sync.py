"""How an API process > 0 applies API process 0's admission state (``--api-server-count``,
rlserve/engine/front/front_sync.py), on a stand-in front (the real ``PauseControl`` and ``WeightState``;
submission recorded): a pause holds new requests and its end submits them; lost weights set this
process's own 503 (``weights.reason`` / ``code``) and valid ones clear it; a sleep refuses with
``model_sleeping``; ``abort_held`` ends the held ones; process 0's own side sends nothing with one
process; an abort counted once over every core's relay. The whole path (two processes, the core's relay and acks) is
tests/test_api_server_count.py's."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rlserve.engine import core_protocol as proto
from rlserve.engine.front.async_pause import PauseControl
from rlserve.engine.front.front_sync import FrontSync
from rlserve.engine.front.weight_state import WeightState
from rlserve.errors import ModelSleepingError


class Front(PauseControl):
    """The attributes ``FrontSync.apply`` and ``PauseControl`` use; ``_submit`` records."""

    def __init__(self):
        self.weights = WeightState("0")
        self._paused, self._pause_mode, self._paused_since, self._paused_total_s = False, None, None, 0.0
        self._held: list = []
        self.submitted: list = []
        self.aborted: list = []
        self.loop = None
        self.sleep_mode = None

    def _submit(self, req) -> None:
        self.submitted.append(req)

    def abort_held(self) -> int:
        held, self._held = self._held, []
        self.aborted += held
        return len(held)


def test_pause_holds_then_releases_and_refusals_follow_process_0():
    front = Front()
    sync = FrontSync(front, 2, 1)
    sync.apply(proto.FrontState(1, True, "keep", None, "0"))
    assert front.is_paused() and front.pause_mode == "keep"
    front._held += ["r1", "r2"]  # (generate holds while _paused)
    sync.apply(proto.FrontState(2, True, "abort", None, "0"))
    assert front.pause_mode == "abort" and front.submitted == []
    sync.apply(proto.FrontState(3, False, None, {"type": "unavailable", "message": "half-loaded", "code":
                                                 "model_unavailable"}, "7"))
    assert not front.is_paused() and front.submitted == ["r1", "r2"] and front._held == []
    assert (front.weights.reason, front.weights.code, front.weights.version) == ("half-loaded", "model_unavailable",
                                                                                 "7")
    assert sync.refusal is None  # (generate's own weights check answers the 503)
    sync.apply(proto.FrontState(4, False, None, {"type": "sleeping", "message": "asleep (level 2)",
                                                 "code": "model_sleeping"}, "7"))
    assert front.weights.reason is None
    with pytest.raises(ModelSleepingError, match=r"asleep \(level 2\)"):
        raise sync.refusal()
    front._held.append("r3")
    sync.apply(proto.FrontState(5, True, "abort", None, "8", abort_held=True))
    assert front.aborted == ["r3"] and sync.refusal is None and front.weights.version == "8"
    assert sync.applied == 5


def test_process_0_of_one_sends_nothing():
    front = Front()
    front._replicas = []  # (would be asked for front_state: none is)
    sync = FrontSync(front, 1, 0)
    asyncio.run(sync.publish())
    sync.notify()
    assert sync.state() == [False, None, None, "0", False, None, 0]
    assert asyncio.run(sync.publish(abort_held=True)) == 0  # (none of another process's to count)


def test_an_abort_is_counted_once_over_every_cores_relay():
    """With data parallelism every core relays process 0's state: the requests this process's abort ended
    are counted (its ack's ``aborted``) at the first relay of an ``abort_seq`` only, so the route's sum over
    the cores counts each once; ids abort at every relay (a repeated abort is a no-op in the core)."""
    front = Front()
    mine = ["cmpl-a-0", "cmpl-a-1", "cmpl-b-0"]
    front.ids_matching = lambda wanted: [r for r in mine if r in wanted or r.rsplit("-", 1)[0] in wanted]
    aborts: list = []

    async def abort(ids):
        aborts.append(list(ids))

    front.abort = abort
    front.loop = asyncio.new_event_loop()
    thread = threading.Thread(target=front.loop.run_forever, daemon=True)
    thread.start()
    try:
        sync = FrontSync(front, 2, 1)
        by_id = dict(paused=False, pause_mode=None, refusal=None, weight_version="0", abort_ids=["cmpl-a"])
        assert sync.apply(proto.FrontState(1, abort_seq=1, **by_id)) == 2  # core 0's relay
        assert sync.apply(proto.FrontState(1, abort_seq=1, **by_id)) == 0  # core 1's (its own epoch count)
        assert sync.apply(proto.FrontState(2, abort_seq=2, **{**by_id, "abort_ids": ["cmpl-b-0", "x"]})) == 1
        front._held += ["h1", "h2"]
        held = dict(paused=False, pause_mode=None, refusal=None, weight_version="0", abort_held=True)
        assert sync.apply(proto.FrontState(3, abort_seq=3, **held)) == 2
        front._held.append("h3")  # (held between two cores' relays: ended by the second, not counted)
        assert sync.apply(proto.FrontState(3, abort_seq=3, **held)) == 0
        assert front.aborted == ["h1", "h2", "h3"]
        assert sync.apply(proto.FrontState(4, False, None, None, "0")) == 0  # no abort
        # two aborts relayed by two cores, core 0's thread ahead: each counted at its first relay only
        front._held += ["h4"]
        assert sync.apply(proto.FrontState(5, abort_seq=4, **held)) == 1  # core 0
        assert sync.apply(proto.FrontState(6, abort_seq=5, **by_id)) == 2  # core 0
        assert sync.apply(proto.FrontState(5, abort_seq=4, **held)) == 0  # core 1
        assert sync.apply(proto.FrontState(6, abort_seq=5, **by_id)) == 0  # core 1
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), front.loop).result(10)  # (after the aborts' tasks)
        a_ids = ["cmpl-a-0", "cmpl-a-1"]
        assert aborts == [a_ids, a_ids, ["cmpl-b-0"], a_ids, a_ids]
    finally:
        front.loop.call_soon_threadsafe(front.loop.stop)
        thread.join(10)
        front.loop.close()
