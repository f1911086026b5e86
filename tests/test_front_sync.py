"""How an API process > 0 applies API process 0's admission state (``--api-server-count``,
rlserve/engine/front/front_sync.py), on a stand-in front (the real ``PauseControl`` and ``WeightState``;
submission recorded): a pause holds new requests and its end submits them; lost weights set this
process's own 503 (``weights.reason`` / ``code``) and valid ones clear it; a sleep refuses with
``model_sleeping``; ``abort_held`` ends the held ones; process 0's own side sends nothing with one
process. The whole path (two processes, the core's relay and acks) is tests/test_api_server_count.py's."""

from __future__ import annotations

import asyncio

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
    assert sync.state() == [False, None, None, "0", False, None]
