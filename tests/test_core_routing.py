"""The engine core's per-API-process routing (``rlserve serve --api-server-count``,
rlserve/engine/core/core_proc.py): each request's deltas and errors reach the process that added it
(``AddRequest.client_index``), stats every process, utility answers process 0; the admission state of
process 0 is relayed to the others and answered once each acked. A fake engine core on real ZMQ
sockets (inproc) drives ``CoreServer``'s handlers directly (no loop, no process). And with one API
process an ``AddRequest`` is the bytes it was before the field (``client_index`` left off)."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from rlserve.engine import core_protocol as proto
from rlserve.engine.core.core_proc import CoreServer
from rlserve.engine.sampling_params import SamplingParams
from rlserve.errors import InvalidRequestError


class FakeCore:
    """Adds requests (``bad`` ids refused), ``step`` gives every request one token (finished ones end)."""

    def __init__(self):
        self.reqs: list[str] = []

    def add(self, rid, prompt, params, stream, arrival_time):
        if rid.startswith("bad"):
            raise InvalidRequestError(f"refused {rid}")
        self.reqs.append(rid)

    def step(self, finish=()):
        out = [proto.RequestDelta(r, [proto.SampleDelta(0, [7], [])], r in finish, ["0"]) for r in self.reqs]
        self.reqs = [r for r in self.reqs if r not in finish]
        return out


@pytest.fixture
def wired():
    """``(server, [client 0's PULL, client 1's PULL, client 2's PULL])`` over inproc sockets."""
    ctx = zmq.Context()
    pulls, pushes = [], []
    for i in range(3):
        pull = ctx.socket(zmq.PULL)
        pull.bind(f"inproc://out-{i}")
        push = ctx.socket(zmq.PUSH)
        push.connect(f"inproc://out-{i}")
        pulls.append(pull)
        pushes.append(push)
    server = CoreServer(FakeCore(), None, pushes)
    yield server, pulls
    for s in pulls + pushes:
        s.close(linger=0)
    ctx.term()


def _recv(sock) -> list:
    """Every message waiting on ``sock``, decoded."""
    dec, out = proto.output_decoder(), []
    while sock.poll(0):
        out.append(dec.decode(sock.recv()))
    return out


def _add(server, rid: str, client: int) -> None:
    server._handle(proto.AddRequest(rid, [1, 2], SamplingParams(max_tokens=4), True, 0.0, client))


def test_outputs_errors_and_stats_reach_their_api_process(wired):
    server, pulls = wired
    _add(server, "a", 0)
    _add(server, "b", 1)
    _add(server, "c", 2)
    _add(server, "bad-1", 1)
    server._outs.extend(server.core.step(finish=("b",)))
    server.flush({"num_running": 3})
    got = [_recv(p) for p in pulls]
    assert [[d.request_id for d in m.deltas] for ms in got for m in ms] == [["a"], ["b"], ["c"]]
    assert [[(e.request_id, e.error.type) for e in m.errors] for ms in got for m in ms] == \
        [[], [("bad-1", "InvalidRequestError")], []]
    assert [m.stats for ms in got for m in ms] == [{"num_running": 3}] * 3
    assert server._client_of == {"c": 2}  # b finished, bad-1 failed: forgotten; a is process 0's (the default)
    server._outs.extend(server.core.step(finish=("a", "c")))
    server.flush()  # no stats: process 1, with nothing of its own, gets no message
    got = [_recv(p) for p in pulls]
    assert [[(d.request_id, d.finished) for m in ms for d in m.deltas] for ms in got] == \
        [[("a", True)], [], [("c", True)]]
    assert server._client_of == {}


def test_the_admission_state_is_answered_once_every_api_process_acked(wired):
    server, pulls = wired
    server._handle(proto.UtilityCall(5, "front_state", [True, "keep", None, "v3"]))
    assert _recv(pulls[0]) == []  # not answered before the acks
    relayed = [_recv(p) for p in pulls[1:]]
    assert relayed == [[proto.FrontState(1, True, "keep", None, "v3")]] * 2
    server._handle(proto.FrontStateAck(1, 2, 3))
    server._handle(proto.FrontStateAck(1, 2, 3))  # (twice: counted once)
    assert _recv(pulls[0]) == []
    server._handle(proto.FrontStateAck(1, 1, 1))
    assert _recv(pulls[0]) == [proto.UtilityResult(5, 4)]  # the requests the processes' acks say they aborted
    server._handle(proto.FrontStateAck(1, 1, 5))  # a late one: nothing more
    assert _recv(pulls[0]) == []


def test_one_api_process_answers_at_once_and_keeps_the_old_bytes():
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://one")
    push.connect("inproc://one")
    try:
        server = CoreServer(FakeCore(), None, push)
        server._handle(proto.UtilityCall(9, "front_state", [False, None, None, "0"]))
        assert _recv(pull) == [proto.UtilityResult(9, 0)]  # (no other process: none of theirs aborted)
        _add(server, "x", 0)
        server._outs.extend(server.core.step())
        server.flush()
        assert [d.request_id for m in _recv(pull) for d in m.deltas] == ["x"]
        assert server._client_of == {}
    finally:
        pull.close(linger=0)
        push.close(linger=0)
        ctx.term()
    wire = msgspec.msgpack.decode(proto.input_encoder().encode(
        proto.AddRequest("r", [1], SamplingParams(max_tokens=2), False, 1.5)))
    assert sorted(wire) == ["arrival_time", "params", "prompt", "request_id", "stream", "type"]
    assert proto.input_decoder().decode(proto.input_encoder().encode(
        proto.AddRequest("r", [1], SamplingParams(max_tokens=2), False, 1.5, 3))).client_index == 3
