"""The streamed routes' byte templates (issue 37, ``rlserve/server/sse_template.py``): a stream built
with templates (the default) is byte for byte the stream built with every chunk a dict encoded whole
(``RLSERVE_SSE_TEMPLATES=0``), for completions and chat, on the same engine outputs: tokens
that split a character, a stop string, a weight version that changes mid-stream, finish reasons
``length`` / ``stop`` / ``abort``, logprobs, echo, ``return_token_ids``, usage chunks, several
choices, a lone surrogate (msgspec refuses it: the general encoder's ``json.dumps``). Also: a
request's last chunks and ``[DONE]`` end the body in one message."""

from __future__ import annotations

import asyncio

import pytest

from rlserve.engine import core_protocol as proto
from rlserve.engine.front.output_processor import OutputProcessor
from rlserve.engine.outputs import CompletionOutput, RequestOutput
from rlserve.engine.sampling_params import SamplingParams
from rlserve.server import sse_template, stream_chunks
from rlserve.server.openai_stream import LastChunk, stream_chat, stream_completions, usage_options
from rlserve.server.protocol import ChatCompletionRequest, CompletionRequest
from rlserve.server.state import ServerState
from tests.tiny_models import build_tokenizer

PROMPT = [5, 6, 7]


class _State:
    """The parts of ``ServerState`` the chunk encoders use (token texts and logprobs objects)."""

    token_text = ServerState.token_text
    token_text_after = ServerState.token_text_after
    token_label = ServerState.token_label
    _context = staticmethod(ServerState._context)
    completion_logprobs = ServerState.completion_logprobs
    chat_logprobs = ServerState.chat_logprobs
    prompt_logprobs_json = ServerState.prompt_logprobs_json

    def __init__(self, tok):
        self.tokenizer, self._token_text = tok, {}


def _outputs(tok, ids, n=1, stop=None, reason="length", versions=("v1",), logprobs=False) -> list:
    """The cumulative outputs of a request whose ``n`` samples each gain one of ``ids`` a step (sample
    k the ids rotated by k), through the front's output processor (detokenizer, stop strings); the
    weight version is ``versions[step * len(versions) // len(ids)]``; the last step ends every sample
    with ``reason`` (None: the request is aborted)."""
    params = SamplingParams(max_tokens=len(ids), n=n, stop=stop, logprobs=2 if logprobs else None)
    req = type("R", (), {"params": params, "stream": True, "prompt": PROMPT, "arrival_time": 1.0})()
    proc = OutputProcessor(tok)
    outs = []
    last = len(ids) - 1
    for k in range(len(ids)):
        samples = []
        for s in range(n):
            t = ids[(k + s) % len(ids)]
            top = [{t: -0.5, 3: -1.5, 4: -2.0}] if logprobs else None
            samples.append(proto.SampleDelta(s, [t], [-0.5], top, reason if k == last else None, None))
        d = proto.RequestDelta("r", samples, k == last, [versions[k * len(versions) // len(ids)]], 2.0,
                               proto.RequestStart(PROMPT) if k == 0 else None)
        outs.extend(proc.process([d], {"r": req})[0])
        if outs and outs[-1].finished:  # a stop string ended it
            break
    return outs


def _lone_surrogate_outputs() -> list:
    """Hand-made outputs whose middle text holds a lone surrogate (the detokenizer never makes one)."""
    texts = ["a", "ab", "ab\ud800", "ab\ud800c", "ab\ud800cd"]
    return [RequestOutput("r", None, PROMPT, None,
                          [CompletionOutput(0, t, list(range(10, 11 + k)),
                                            finish_reason="length" if k == len(texts) - 1 else None)],
                          k == len(texts) - 1, weight_version="v1")
            for k, t in enumerate(texts)]


async def _agen(outs):
    for o in outs:
        yield o


def _drain(gen) -> list:
    async def run():
        return [c async for c in gen]
    return asyncio.run(run())


def _completions(state, body: dict, outs_per_prompt: list) -> list:
    body = CompletionRequest(model="m", prompt=PROMPT, stream=True, **body)
    items = [(None, PROMPT, None)] * len(outs_per_prompt)
    return _drain(stream_completions(state, body, items, "cmpl-1", 7, "m", body.n, usage_options(body.stream_options),
                                     lambda i: "the prompt", [_agen(o) for o in outs_per_prompt]))


def _chat(state, body: dict, outs: list) -> list:
    body = ChatCompletionRequest(**{"model": "m", "messages": [{"role": "user", "content": "Hi"}], "stream": True,
                                    **body})
    return _drain(stream_chat(state, body, PROMPT, "chatcmpl-1", 7, "m", usage_options(body.stream_options),
                              _agen(outs), top_k=body.top_logprobs or 0))


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture
def both(monkeypatch, tok):
    """``run(encode)``: ``encode(state)``'s chunks with templates on and off, and the number of
    chunks the templates made (a case the templates take must show some)."""
    monkeypatch.setattr(stream_chunks, "system_fingerprint", lambda state: "fp-test")
    fills = []
    real_fill = sse_template.ChunkTemplate.fill

    def counting_fill(self, values):
        out = real_fill(self, values)
        fills.append(out is not None)
        return out

    monkeypatch.setattr(sse_template.ChunkTemplate, "fill", counting_fill)

    def run(encode):
        monkeypatch.setenv("RLSERVE_SSE_TEMPLATES", "0")
        off = encode(_State(tok))
        assert not fills
        monkeypatch.setenv("RLSERVE_SSE_TEMPLATES", "1")
        on = encode(_State(tok))
        made = sum(fills)
        fills.clear()
        return on, off, made
    return run


def _ids(tok, text: str) -> list:
    return tok.encode(text, add_special_tokens=False)


CASES = [  # (body, outputs kwargs, the templates take some chunks)
    ({}, {}, True),
    ({"return_token_ids": True}, {"versions": ("v1", "v2")}, True),
    ({"stream_options": {"include_usage": True}}, {"reason": "stop"}, True),
    ({"stream_options": {"include_usage": True, "continuous_usage_stats": True}}, {}, False),
    ({"logprobs": 2}, {"logprobs": True}, False),
    ({"echo": True, "max_tokens": 16}, {}, False),
    ({"stop": ["k, "]}, {"stop": ["k, "]}, True),
    ({}, {"reason": None}, True),
]


@pytest.mark.parametrize("body,kw,templated", CASES)
def test_completions_stream_is_byte_equal(both, tok, body, kw, templated):
    ids = _ids(tok, "Hello wé 世界 ok, ünï") + [0, 1, 2]
    outs = _outputs(tok, ids, **kw)
    on, off, made = both(lambda st: _completions(st, body, [outs]))
    assert b"".join(on) == b"".join(off)
    assert (made > 0) == templated
    assert "世".encode() in b"".join(on) and "é".encode() in b"".join(on)  # characters split over tokens, whole
    assert type(on[-1]) is LastChunk and on[-1].endswith(b"data: [DONE]\n\n")
    assert on[-1].count(b"data: ") >= 2  # the finish chunk goes with [DONE]


def test_completions_several_prompts_and_choices_are_byte_equal(both, tok):
    ids = _ids(tok, "ab é 世界 cd")
    a, b = _outputs(tok, ids, n=2), _outputs(tok, ids[::-1], n=2, versions=("v1", "v2"))
    body = {"n": 2, "return_token_ids": True, "stream_options": {"include_usage": True}}
    on, off, made = both(lambda st: _completions(st, body, [a, b]))
    assert b"".join(on) == b"".join(off) and made > 0
    assert all(b'"index":%d' % i in b"".join(on) for i in range(4))


@pytest.mark.parametrize("body,kw,templated", [
    ({}, {}, True),
    ({"return_token_ids": True, "n": 2}, {"n": 2, "versions": ("v1", "v2")}, True),
    ({"stream_options": {"include_usage": True}}, {"reason": "stop"}, True),
    ({"stream_options": {"include_usage": True, "continuous_usage_stats": True}}, {}, False),
    ({"logprobs": True, "top_logprobs": 2}, {"logprobs": True}, False),
    ({"echo": True, "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Su"}],
      "add_generation_prompt": False}, {}, True),
    ({}, {"reason": None}, True),
])
def test_chat_stream_is_byte_equal(both, tok, body, kw, templated):
    ids = _ids(tok, "Hello wé 世界 ok, ünï") + [0, 1]
    outs = _outputs(tok, ids, **kw)
    on, off, made = both(lambda st: _chat(st, body, outs))
    assert b"".join(on) == b"".join(off)
    assert (made > 0) == templated
    assert '{"content":"世"}'.encode() in b"".join(on)  # a character split over tokens, whole
    # the first write: the role chunks (and echo chunks) with the first content chunks
    assert on[0].count(b"data: ") > body.get("n", 1) * (2 if body.get("echo") else 1)
    assert type(on[-1]) is LastChunk and on[-1].endswith(b"data: [DONE]\n\n")


def test_a_lone_surrogate_takes_the_general_encoder(both):
    outs = _lone_surrogate_outputs()
    on, off, made = both(lambda st: _completions(st, {}, [outs]))
    assert b"".join(on) == b"".join(off)
    assert b'"text":"\\ud800"' in b"".join(on) and b'"text":"b"' in b"".join(on)
    assert made == 2  # "b" and "c" through the template; "a" (first), "\ud800", "d" (last) the general way
    on, off, made = both(lambda st: _chat(st, {}, outs))
    assert b"".join(on) == b"".join(off)


def test_a_template_refuses_a_sentinel_it_finds_twice():
    s = sse_template.sentinel("text")
    assert sse_template.ChunkTemplate.build(lambda v: {"a": v["text"], "b": s}, ("text",)) is None
    t = sse_template.ChunkTemplate.build(lambda v: {"b": [1, v["x"]], "a": v["text"]}, ("text", "x"))
    assert t.fill(("é\n", None)) == b'data: {"b":[1,null],"a":"\xc3\xa9\\n"}\n\n'
    assert t.fill(("\ud800", 1)) is None
