"""The SSE chunk path of the streamed routes after issue 37's trims (a stream's chunks go out as
msgspec's bytes, a request's single generator is iterated directly): every token arrives once and in
order (the streamed ids and text are the non-streamed answer's, greedy), the usage chunk counts
them, one generator per prompt or several (merged) alike, and a client that leaves a chat stream has
its request aborted."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from rlserve.server.openai_stream import sse, sse_bytes
from tests.test_tokenizer_microbatch import srv  # noqa: F401 - the same module-scoped tiny server fixture

T = 120.0  # bound on every wait (seconds)


def test_sse_bytes_is_sse_encoded():
    for obj in ({"id": "x", "choices": [{"text": "é 世界 \u2028", "logprobs": None, "n": -9999.0}]},
                {"text": "a\ud800b"}):  # a lone surrogate: msgspec refuses it, json.dumps escapes it
        assert sse_bytes(obj) == sse(obj).encode()
    assert sse_bytes({"a": [1, None]}) == b'data: {"a":[1,null]}\n\n'


def _events(r: httpx.Response) -> list:
    out = []
    for line in r.text.splitlines():
        if line.startswith("data: "):
            out.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return out


@pytest.mark.parametrize("prompts,n", [(["Hello there"], 1), (["Hello there", "The sky is"], 2)])
def test_completion_stream_tokens_in_order_and_usage(srv, prompts, n):
    body = {"model": srv.model_path, "prompt": prompts if len(prompts) > 1 else prompts[0], "max_tokens": 12,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True, "n": n}
    full = httpx.post(srv.url + "/v1/completions", json=body, timeout=T)
    assert full.status_code == 200, full.text
    r = httpx.post(srv.url + "/v1/completions", json=dict(body, stream=True, stream_options={"include_usage": True}),
                   timeout=T)
    assert r.status_code == 200, r.text
    events = _events(r)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    ids: dict = {}
    text: dict = {}
    for ch in chunks:
        (c,) = ch["choices"]
        assert c["index"] not in ids or ids[c["index"]][-1:] != [None]  # nothing after a choice's finish
        ids.setdefault(c["index"], []).extend(c["token_ids"])
        text[c["index"]] = text.get(c["index"], "") + c["text"]
    want = {c["index"]: c for c in full.json()["choices"]}
    assert sorted(ids) == sorted(want) == list(range(len(prompts) * n))
    for i, c in want.items():
        assert ids[i] == c["token_ids"] and len(ids[i]) == 12, i
        assert text[i] == c["text"], i
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12 * len(prompts) * n
    assert _counts(usage["usage"]) == _counts(full.json()["usage"])


def _counts(usage: dict) -> tuple:
    """The usage's three counts (the stream's usage chunk leaves out null keys, as vLLM's)."""
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


def test_chat_stream_tokens_in_order_and_usage(srv):
    body = {"model": srv.model_path, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    full = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=T)
    assert full.status_code == 200, full.text
    r = httpx.post(srv.url + "/v1/chat/completions",
                   json=dict(body, stream=True, stream_options={"include_usage": True}), timeout=T)
    events = _events(r)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    chunks = events[1:-2]  # after the role chunk
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    ids = [t for ch in chunks for t in ch["choices"][0]["token_ids"]]
    content = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks)
    want = full.json()["choices"][0]
    assert ids == want["token_ids"] and len(ids) == 10
    assert content == want["message"]["content"]
    assert _counts(usage["usage"]) == _counts(full.json()["usage"])


def _aborted(text: str) -> float:
    return sum(float(ln.split()[-1]) for ln in text.splitlines()
               if ln.startswith('rlserve_sequences_finished_total{finish_reason="abort"'))


def test_leaving_a_chat_stream_aborts_its_request(srv):
    async def scenario():
        async with httpx.AsyncClient(base_url=srv.url, timeout=T) as client:
            before = _aborted((await client.get("/metrics")).text)
            body = {"model": srv.model_path, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 100,
                    "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break  # leave after the first chunk: the connection closes
            deadline = time.monotonic() + T  # bounds a hang only
            while _aborted((await client.get("/metrics")).text) - before < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert _aborted((await client.get("/metrics")).text) - before == 1
            assert (await client.get("/health")).status_code == 200

    asyncio.run(scenario())
