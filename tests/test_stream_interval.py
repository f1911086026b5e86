"""vLLM's ``--stream-interval`` / ``stream_interval``: which outputs wake a streamed request's
consumer (:func:`rlserve.engine.front.front_request.put`), and the chunks ``rlserve serve`` sends."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import pytest

from rlserve.engine.front.front_request import FrontRequest, mark_delivered, put
from rlserve.engine.outputs import CompletionOutput, RequestOutput
from rlserve.engine.sampling_params import SamplingParams
from rlserve.errors import InvalidRequestError
from rlserve.server.testing import ServerProcess

TIMEOUT = 60.0


def _out(*samples, finished=False) -> RequestOutput:
    """An output whose sample i has ``samples[i] = (tokens, finish_reason)``."""
    return RequestOutput("r", None, [1], None, [CompletionOutput(i, "", list(range(k)), finish_reason=r)
                                               for i, (k, r) in enumerate(samples)], finished)


def _deliveries(interval: int, outputs: list[RequestOutput]) -> list[int]:
    """Feed ``outputs`` one by one, taking the slot whenever the event is set (a consumer that
    keeps up); returns the indices of the outputs taken."""
    loop = asyncio.new_event_loop()
    try:
        req = FrontRequest("r", [1], None, loop, asyncio.Event(), 0.0, interval=interval)
        taken = []
        for i, o in enumerate(outputs):
            put(req, o)
            if req.event.is_set():
                req.event.clear()
                item, req.slot = req.slot, None
                assert item is o
                mark_delivered(req, item)
                taken.append(i)
        return taken
    finally:
        loop.close()


def test_interval_one_delivers_every_output():
    outs = [_out((k, None)) for k in range(1, 6)] + [_out((6, "length"), finished=True)]
    assert _deliveries(1, outs) == [0, 1, 2, 3, 4, 5]


def test_interval_four_delivers_first_every_fourth_and_last():
    # tokens 1..10, one per step: vLLM's rule sends at 1, 5, 9 and the final 10
    outs = [_out((k, None)) for k in range(1, 10)] + [_out((10, "length"), finished=True)]
    assert _deliveries(4, outs) == [0, 4, 8, 9]


def test_a_sample_finishing_is_delivered_at_once():
    # n=2: sample 1 stops at 3 tokens while sample 0 goes on
    outs = [_out((1, None), (1, None)), _out((2, None), (2, None)), _out((3, None), (3, "stop")),
            _out((4, None), (3, "stop")), _out((5, None), (3, "stop")), _out((6, "length"), (3, "stop"), finished=True)]
    assert _deliveries(4, outs) == [0, 2, 5]


def test_held_output_is_replaced_and_an_error_always_wakes():
    loop = asyncio.new_event_loop()
    try:
        req = FrontRequest("r", [1], None, loop, asyncio.Event(), 0.0, interval=8)
        put(req, _out((1, None)))
        req.event.clear()
        mark_delivered(req, req.slot)
        req.slot = None
        put(req, _out((2, None)))
        put(req, _out((3, None)))
        assert not req.event.is_set() and len(req.slot.outputs[0].token_ids) == 3  # the newest waits
        err = RuntimeError("engine died")
        put(req, err)
        assert req.event.is_set() and req.slot is err
    finally:
        loop.close()


def test_sampling_params_refuses_a_zero_interval():
    with pytest.raises(InvalidRequestError, match="stream_interval must be >= 1"):
        SamplingParams(stream_interval=0)


def test_serve_refuses_a_zero_interval_flag():
    p = subprocess.run([sys.executable, "-m", "rlserve", "serve", "unused-model", "--stream-interval", "0"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--stream-interval: must be an integer >= 1, got '0'" in p.stderr


@pytest.fixture(scope="module")
def server(tiny_model):
    with ServerProcess(tiny_model("llama"), "--max-model-len", "128", "--disable-access-log", "--device", "cpu",
                       "--stream-interval", "3") as srv:
        yield srv


def _stream(server, route: str, body: dict) -> list[list[int]]:
    """The token ids of each streamed chunk that carries a choice."""
    chunks = []
    with httpx.stream("POST", server.url + route, json=dict(body, stream=True, return_token_ids=True),
                      timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                obj = json.loads(line[6:])
                for c in obj["choices"]:
                    if c.get("token_ids") is not None:
                        chunks.append(c["token_ids"])
    return chunks


@pytest.mark.parametrize("asked, floor", [(None, 3), (2, 3), (5, 5)])
def test_completion_chunks_hold_at_least_the_interval(server, asked, floor):
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 17, "ignore_eos": True, "temperature": 0}
    if asked is not None:
        body["stream_interval"] = asked
    chunks = _stream(server, "/v1/completions", body)
    assert sum(len(c) for c in chunks) == 17
    # every chunk between the first and the last carries at least `floor` new tokens (a slow
    # reader can get more, never fewer), so there are at most 2 + (17 - 1) // floor chunks
    assert all(len(c) >= floor for c in chunks[1:-1]), chunks
    assert len(chunks) <= 2 + 16 // floor


def test_chat_chunks_hold_at_least_the_interval(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 13, "ignore_eos": True,
            "temperature": 0, "stream_interval": 4}
    chunks = [c for c in _stream(server, "/v1/chat/completions", body) if c]
    assert sum(len(c) for c in chunks) == 13
    assert all(len(c) >= 4 for c in chunks[1:-1]), chunks


def test_bad_request_interval_is_a_400(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "stream": True,
                                                         "stream_interval": 0}, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_interval"
