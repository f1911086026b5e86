"""Tokens of a request whose client went away are counted (issue 37's noticed list): vLLM counts every
token the engine made (``vllm:generation_tokens_total`` per step), so a client that disconnects from a
non-streamed request (or a stream) leaves its tokens in the counters, and ``vllm:request_generation_tokens``
observes them (it observed 0 for a non-streamed one: its generator never saw an output).

How the test knows the number: the engine core freezes itself right after the step that gave the
request its second token (``freeze_at``, through ``call_engines``: keep-pause's ``frozen``, no step runs
after it, so the count cannot move however fast or slow the machine), then the engine's own sequences
are read in the core (``output_counts``: ``len(seq.output_token_ids)``, the tokens the engine made:
2); the client's connection is then closed and the abort's output must carry exactly that many. Every wait is on a state (the engine's token count,
``/metrics``); their time bounds only catch hangs. Also :func:`~rlserve.engine.front.front_request.abandon`'s
three cases directly (final item there already, later, an exception).

The same freeze shows the counters follow the engine's steps (vLLM's ``iteration_stats``), not the
request's end: a request frozen after its 5th token, streamed or not, has its 5 tokens and its prompt
in ``vllm:generation_tokens_total`` / ``vllm:prompt_tokens_total`` (and the ``rlserve_`` twins) while it
is unfinished (counted 0 before session 25: the counters rose at the request's end), and all 12 once it
finished; its histograms (``vllm:request_generation_tokens``) observe it only then. Exact, not a bound:
no step runs while frozen, and a keep-pause's freeze sends every request's tokens to the API process
before it answers (``EngineCore.progress``).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from rlserve.engine.front.front_request import FrontRequest, Wakeup, abandon, put
from rlserve.engine.outputs import CompletionOutput, RequestOutput
from tests.transfer_harness import InProcessServer

T = 120.0  # bound on every wait (seconds): a hang, not a speed limit
HERE = "tests.test_metrics_abandoned"
PROMPT = [5, 6, 7]
MAX_TOKENS = 100  # far more than the request makes before the freeze (max_model_len 128)


def output_counts(core) -> dict:
    """In the engine core (``call_engines``): ``{request id: [tokens the engine made, per sample]}``."""
    return {rid: [len(s.output_token_ids) for s in core.engine.requests[rid].seqs]
            for rid in core.requests if rid in core.engine.requests}


def freeze_at(core, k: int) -> None:
    """In the engine core (``call_engines``): freeze it (keep-pause's ``frozen``: no step, messages
    still handled) right after the first step that leaves a sample with ``k`` tokens, once."""
    real = core.step

    def step():
        out = real()
        if any(len(s.output_token_ids) >= k for r in core.engine.requests.values() for s in r.seqs):
            core.frozen, core.step = True, real
        return out
    core.step = step


def on_loop(srv, make_coro):
    return asyncio.run_coroutine_threadsafe(make_coro(), srv.aengine.loop).result(T)


def counts(srv) -> dict:
    (got,) = on_loop(srv, lambda: srv.aengine.call_engines(f"{HERE}:output_counts"))
    return got


def metrics(srv) -> dict[str, float]:
    """``{series name: value summed over its label sets}`` of ``/metrics`` (``NAME{abort}``: those with
    ``finished_reason="abort"``)."""
    text = httpx.get(srv.url + "/metrics", timeout=T).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, v = line.rpartition(" ")
            name = key.split("{")[0] + ("{abort}" if 'finished_reason="abort"' in key else "")
            out[name] = out.get(name, 0.0) + float(v)
    return out


def until(cond, what: str):
    end = time.monotonic() + T
    while not (got := cond()):
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)
    return got


def open_request(srv, stream: bool, max_tokens: int = MAX_TOKENS) -> socket.socket:
    """POST a completion on a raw connection (closed by the caller: the client going away)."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                       "stream": stream}).encode()
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=T)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


@pytest.fixture(scope="module", params=["process", "thread"])
def server(request, tiny_model):
    with InProcessServer(tiny_model("llama"), engine_mode=request.param) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, timeout=T)
        assert r.status_code == 200, r.text  # (the front knows its event loop once a request came: on_loop)
        yield srv


@pytest.mark.parametrize("stream", [False, True])
def test_tokens_of_a_request_whose_client_left_are_counted(server, stream):
    srv = server
    before = metrics(srv)
    (_,) = on_loop(srv, lambda: srv.aengine.call_engines(f"{HERE}:freeze_at", 2))
    sock = open_request(srv, stream)
    try:
        until(lambda: any(k >= 2 for ks in counts(srv).values() for k in ks), "the request's first tokens")
        # frozen by freeze_at in the step that made them (calls run between steps); the keep-pause
        # makes the front know it (its /resume unfreezes)
        assert httpx.post(srv.url + "/pause", params={"mode": "keep"}, timeout=T).status_code == 200
        (made,) = counts(srv).values()  # what the engine made, and all it makes: a prefill step, a decode step
        assert made == [2]
    finally:
        sock.close()  # the client goes away (the server sees it within its disconnect poll)
    try:
        until(lambda: metrics(srv).get("rlserve_requests_total", 0) == before.get("rlserve_requests_total", 0) + 1,
              "the aborted request's record")
        assert counts(srv) == {}  # aborted in the engine
    finally:
        assert httpx.post(srv.url + "/resume", timeout=T).status_code == 200
    after = metrics(srv)

    def delta(name):
        return after[name] - before.get(name, 0.0)

    assert delta("vllm:generation_tokens_total") == made[0]
    assert delta("rlserve_generation_tokens_total") == made[0]
    assert delta("vllm:request_generation_tokens_sum") == made[0]
    assert delta("vllm:request_generation_tokens_count") == 1
    assert delta("vllm:request_success_total{abort}") == 1
    assert delta("vllm:prompt_tokens_total") == len(PROMPT)


@pytest.mark.parametrize("stream", [False, True])
def test_tokens_are_counted_as_the_engine_makes_them(server, stream):
    srv = server
    before = metrics(srv)

    def delta(now, name):
        return now.get(name, 0.0) - before.get(name, 0.0)

    (_,) = on_loop(srv, lambda: srv.aengine.call_engines(f"{HERE}:freeze_at", 5))
    sock = open_request(srv, stream, max_tokens=12)
    try:
        try:
            until(lambda: any(k >= 5 for ks in counts(srv).values() for k in ks), "the request's 5th token")
            assert httpx.post(srv.url + "/pause", params={"mode": "keep"}, timeout=T).status_code == 200
            (made,) = counts(srv).values()  # frozen in the step that made the 5th: no other step runs
            assert made == [5]
            mid = metrics(srv)
        finally:
            assert httpx.post(srv.url + "/resume", timeout=T).status_code == 200
        for name in ("vllm:generation_tokens_total", "rlserve_generation_tokens_total"):
            assert delta(mid, name) == 5, name
        for name in ("vllm:prompt_tokens_total", "rlserve_prompt_tokens_total"):
            assert delta(mid, name) == len(PROMPT), name
        # unfinished: not yet in the per-request series
        assert delta(mid, "rlserve_requests_total") == 0 and delta(mid, "vllm:request_generation_tokens_count") == 0
        until(lambda: metrics(srv).get("rlserve_requests_total", 0) == before.get("rlserve_requests_total", 0) + 1,
              "the finished request's record")
    finally:
        sock.close()
    after = metrics(srv)
    assert delta(after, "vllm:generation_tokens_total") == delta(after, "rlserve_generation_tokens_total") == 12
    assert delta(after, "vllm:prompt_tokens_total") == delta(after, "rlserve_prompt_tokens_total") == len(PROMPT)
    assert delta(after, "vllm:request_generation_tokens_sum") == 12
    assert delta(after, "vllm:request_generation_tokens_count") == 1


def _front_request(loop) -> FrontRequest:
    return FrontRequest("r", [1, 2], None, loop, Wakeup(loop), 0.0, stream=False)


def _output(tokens: list[int], finished: bool) -> RequestOutput:
    reason = "abort" if finished else None
    return RequestOutput("r", None, [1, 2], None, [CompletionOutput(0, "", tokens, finish_reason=reason)], finished)


def test_abandon_hands_over_the_final_item_once():
    loop = asyncio.new_event_loop()
    try:
        got = []
        # the final output came before the consumer left (unread): handed over at once
        req = _front_request(loop)
        put(req, _output([4, 5], True))
        abandon(req, got.append)
        assert [o.outputs[0].token_ids for o in got] == [[4, 5]] and req.slot is None
        # later: unfinished outputs are dropped, the final one is handed over, once
        got.clear()
        req = _front_request(loop)
        put(req, _output([4], False))
        abandon(req, got.append)
        assert got == []
        put(req, _output([4, 5, 6], False))
        put(req, _output([4, 5, 6, 7], True))
        put(req, _output([4, 5, 6, 7, 8], True))  # nothing follows a final item
        assert [o.outputs[0].token_ids for o in got] == [[4, 5, 6, 7]]
        # an exception ends it: handed over as it is; no callback: nothing happens
        got.clear()
        req = _front_request(loop)
        abandon(req, got.append)
        err = RuntimeError("engine died")
        put(req, err)
        assert got == [err]
        req = _front_request(loop)
        abandon(req, None)
        put(req, _output([1], True))
        assert req.slot.finished
    finally:
        loop.close()
