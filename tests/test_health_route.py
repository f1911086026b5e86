"""``GET /health`` against a fake engine (no model): one reading of the replicas' flags per request
(``is_alive`` once; session 18 found two calls per request), and the answers of each state."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from rlserve.server.control_routes import make_public_router


class FakeEngine:
    """``is_alive`` / ``ended_now`` / ``dead_reason`` / ``is_restarting`` as AsyncEngine has them,
    counting the ``is_alive`` calls."""

    def __init__(self, alive=True, ended=None, restarting=False, unavailable=None):
        self.alive, self.ended, self.restarting = alive, ended, restarting
        self.unavailable_reason, self.unavailable_code = unavailable, "weights_lost" if unavailable else None
        self.is_alive_calls = 0

    def is_alive(self):
        self.is_alive_calls += 1
        return self.alive

    def ended_now(self):
        return self.ended

    def dead_reason(self):
        return None if self.alive else "replica 0 exited"

    def will_restart(self):
        return self.restarting

    def is_restarting(self):
        return self.restarting

    def is_sleeping(self):
        return False


def _health(aeng) -> tuple[int, dict]:
    router = make_public_router(SimpleNamespace(aengine=aeng))
    route = next(r for r in router.routes if r.path == "/health")
    out = asyncio.run(route.endpoint())
    if isinstance(out, dict):
        return 200, out
    return out.status_code, json.loads(out.body)


@pytest.mark.parametrize("kw,status,body", [
    ({}, 200, {"status": "ok"}),
    ({"alive": False}, 503, {"status": "dead", "reason": "replica 0 exited"}),
    ({"alive": False, "restarting": True}, 503, {"status": "restarting", "reason": "replica 0 exited"}),
    ({"ended": "the engine-core process of replica 0 (pid 7) was killed"}, 503,
     {"status": "dead", "reason": "the engine-core process of replica 0 (pid 7) was killed"}),
    ({"unavailable": "weights lost"}, 503, {"status": "unavailable", "reason": "weights lost", "code": "weights_lost"}),
])
def test_health_reads_is_alive_once(kw, status, body):
    aeng = FakeEngine(**kw)
    assert _health(aeng) == (status, body)
    assert aeng.is_alive_calls == 1
