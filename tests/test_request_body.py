"""The generation routes' msgspec body decoding and token-id fast paths (issue 37, admission) change no
answer: :func:`rlserve.server.request_body.loads` returns what ``json.loads`` returns (or raises what it
raises), a route of :class:`~rlserve.server.request_body.FastJSONRoute` answers every body -- malformed,
wrong types, extra fields, other content types -- byte for byte as FastAPI's own route does, and the
prompt's token-id check (``CompletionRequest``) and ``check_token_ids`` accept and refuse exactly what
pydantic's union and the loops did."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Optional

import pytest
from fastapi import APIRouter, FastAPI, Request
from fastapi.testclient import TestClient
from pydantic import ValidationError, create_model

from rlserve.server import request_body
from rlserve.server.errors import APIError, install_error_handlers
from rlserve.server.limits import check_token_ids
from rlserve.server.protocol import ChatCompletionRequest, CompletionRequest, TRLGenerateRequest
from rlserve.server.request_body import FastJSONRoute, loads

DEEP = 300  # nesting levels: over request_body.MAX_BRACKETS, under the recursion limit
#: bodies where msgspec and json.loads differ (json.loads must decide) and where they agree
BODIES = [
    b'{"a":1,"a":2}', b'{"a":123456789012345678901234567890}', b'{"a":1e400}', b'{"a":-1e400}', b'{"a":-0.0}',
    b'{"a":NaN}', b'{"a":Infinity}', b'{"a":"\\ud800"}', b'{"a":"\\ud83d\\ude00"}', b'{"a":"x\ty"}', b'{"a":"\x01"}',
    b'\xef\xbb\xbf{"a":1}', '{"a":1}'.encode("utf-16"), '{"a":1}'.encode("utf-32"), b' {"a":1}\n', b'{"a":1} x',
    b'{"a":"\xff"}', b'{"a":"\xed\xa0\x80"}', b'{"a":01}', b'{"a":[1,2,]}', b'{"a":' + b'9' * 4301 + b'}',
    b'{"a":' + b'9' * 4300 + b'}', b'{"a":1.' + b'9' * 5000 + b'}', b'{"a":5e-324}', b'{"\\u00e9":"\\/\\b"}',
    b'[' * DEEP + b']' * DEEP, b'[' * 5000 + b']' * 5000, b'', b'   ', b'null', b'"text"', b'[1,2,3]', b'{"a":tru}',
    b'{"prompt": [1, 2', json.dumps({"prompt": list(range(512)), "max_tokens": 1}).encode(),
]


def _outcome(fn, body):
    try:
        return "value", repr(fn(body))
    except Exception as e:  # noqa: BLE001 - the exception is the outcome compared
        return type(e).__name__, str(e), getattr(e, "pos", None)


@pytest.mark.parametrize("body", BODIES)
def test_loads_is_json_loads(body):
    assert _outcome(loads, body) == _outcome(json.loads, body)


def test_loads_takes_msgspec_for_plain_bodies(monkeypatch):
    """The fast path is taken for an ordinary body (and not for a deeply nested one)."""
    calls = []
    decode = request_body._decode
    monkeypatch.setattr(request_body, "_decode", lambda b: calls.append(b) or decode(b))
    assert loads(b'{"prompt": [1, 2, 3]}') == {"prompt": [1, 2, 3]}
    assert loads(b'[' * DEEP + b']' * DEEP) is not None and len(calls) == 1


def _app() -> FastAPI:
    """One body model behind FastAPI's own route and behind FastJSONRoute, with the server's error answers."""
    app = FastAPI()
    install_error_handlers(app)
    plain, fast = APIRouter(), APIRouter(route_class=FastJSONRoute)
    for router, prefix in ((plain, "/plain"), (fast, "/fast")):
        @router.post(prefix + "/completions")
        async def completions(body: CompletionRequest, raw: Request):
            return {"prompt": body.prompt, "extra": body.model_extra, "set": sorted(body.model_fields_set)}

        @router.post(prefix + "/chat")
        async def chat(body: ChatCompletionRequest):
            return body.model_dump(mode="json", exclude_unset=True)

        app.include_router(router)
    return app


REQUESTS = [  # (route, body bytes, content type)
    ("completions", b'{"prompt": [1, 2, 3], "max_tokens": 1}', "application/json"),
    ("completions", b'{"prompt": "hello", "temperature": NaN}', "application/json"),
    ("completions", b'{"prompt": "hello", "temperature": 1e400}', "application/json"),
    ("completions", b'{"prompt": [1, 2', "application/json"),  # malformed
    ("completions", b'{"prompt": [1, 2,]}', "application/json"),
    ("completions", b'{"prompt": "a\\ud800"}', "application/json"),
    ("completions", b'\xef\xbb\xbf{"prompt": "bom"}', "application/json"),
    ("completions", '{"prompt": "utf16"}'.encode("utf-16"), "application/json"),
    ("completions", b'{"prompt": "\xff"}', "application/json"),
    ("completions", b'{"prompt": [1, true, 3]}', "application/json"),  # wrong types
    ("completions", b'{"prompt": [1, 2.0]}', "application/json"),
    ("completions", b'{"prompt": [1, "2"]}', "application/json"),
    ("completions", b'{"prompt": [[1, 2], [3, true]]}', "application/json"),
    ("completions", b'{"prompt": [1, [2]]}', "application/json"),
    ("completions", b'{"prompt": 5}', "application/json"),
    ("completions", b'{"prompt": []}', "application/json"),
    ("completions", b'{"prompt": [1], "max_tokens": "many"}', "application/json"),
    ("completions", b'{"prompt": [1], "n": true, "stream_options": {"include_usage": true}}', "application/json"),
    ("completions", b'{"prompt": [1], "frobnicate": 1, "metadata": {"a": "b"}}', "application/json"),  # extra fields
    ("completions", b'{"prompt": [1], "stream_options": {"bogus": 1}, "stream": true}', "application/json"),
    ("completions", b'{"max_tokens": 1}', "application/json"),  # missing prompt
    ("completions", b'[1, 2]', "application/json"),
    ("completions", b'', "application/json"),
    ("completions", b'{"prompt": [1]}', "text/plain"),
    ("completions", b'prompt=1', "application/x-www-form-urlencoded"),
    ("completions", b'{"prompt": [1]}', "application/vnd.api+json"),
    ("completions", b'{"prompt": [1]}', None),
    ("completions", b'{"prompt":' + b'[' * DEEP + b']' * DEEP + b'}', "application/json"),
    ("completions", b'{"prompt":' + b'[' * 5000 + b']' * 5000 + b'}', "application/json"),
    ("completions", b'{"prompt": [' + b'9' * 4301 + b']}', "application/json"),
    ("chat", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}', "application/json"),
    ("chat", b'{"messages": [{"role": "user", "content": 5}]}', "application/json"),
    ("chat", b'{"messages": "hi", "bogus": true}', "application/json"),
]


@pytest.mark.parametrize("route,body,ctype", REQUESTS)
def test_fast_route_answers_as_fastapi(route, body, ctype):
    client = TestClient(_app(), raise_server_exceptions=False)
    headers = {} if ctype is None else {"Content-Type": ctype}
    plain = client.post(f"/plain/{route}", content=body, headers=headers)
    fast = client.post(f"/fast/{route}", content=body, headers=headers)
    assert (fast.status_code, fast.content) == (plain.status_code, plain.content)


#: bodies the lone-surrogate check parses before the route (an escaped surrogate pair: json.dumps' default for an
#: emoji), each with the parser that takes it: msgspec, or json.loads after msgspec refused (NaN, duplicate keys' rule)
PAIR_BODIES = [
    (json.dumps({"prompt": "hi \U0001F600", "max_tokens": 1}).encode(), "msgspec"),
    (b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1, "temperature": NaN}', "json"),
    (b'{"prompt": [1], "stop": ["\\ud83d\\ude00"], "max_tokens": 1' + b', "x": [[]]' * 300 + b'}', "json"),  # deep
]


def count_parses(monkeypatch) -> dict[str, int]:
    """The JSON parses of request bodies from now on, by parser: :func:`request_body.loads`' msgspec
    (``msgspec``) and ``json.loads`` (``json``) calls, and Starlette's ``Request.json`` (``starlette``: FastAPI's
    own routes). A dict updated as they happen."""
    import starlette.requests

    calls = {"msgspec": 0, "json": 0, "starlette": 0}

    def counted(name, fn):
        def run(b):
            calls[name] += 1
            return fn(b)
        return run

    monkeypatch.setattr(request_body, "_decode", counted("msgspec", _DECODE))
    monkeypatch.setattr(request_body, "json", SimpleNamespace(loads=counted("json", json.loads)))
    monkeypatch.setattr(starlette.requests, "json", SimpleNamespace(loads=counted("starlette", json.loads)))
    return calls


_DECODE = request_body._decode  # (count_parses wraps the module's own, not a wrapper of an earlier call)


@pytest.mark.parametrize("body,parser", PAIR_BODIES)
def test_a_body_the_surrogate_check_parsed_is_parsed_once(monkeypatch, body, parser):
    """Behind :class:`~rlserve.server.text_check.LoneSurrogateCheck` (which parses every body with a surrogate's
    escape, a pair's too), a FastJSONRoute takes the value the check parsed: one parse per request (two before:
    the check's, then the route's), and the same answer as FastAPI's own route behind the same check."""
    from rlserve.server.text_check import LoneSurrogateCheck

    app = _app()
    app.add_middleware(LoneSurrogateCheck)
    client = TestClient(app, raise_server_exceptions=False)
    headers = {"Content-Type": "application/json"}
    plain = client.post("/plain/completions", content=body, headers=headers)
    calls = count_parses(monkeypatch)
    fast = client.post("/fast/completions", content=body, headers=headers)
    assert (fast.status_code, fast.content) == (plain.status_code, plain.content)
    deep = body.count(b"[") + body.count(b"{") >= request_body.MAX_BRACKETS  # json.loads alone, msgspec not asked
    assert calls == {"msgspec": 0 if deep else 1, "json": 1 if parser == "json" else 0, "starlette": 0}, calls
    if parser == "msgspec":
        assert fast.json()["prompt"] == "hi \U0001F600"


def test_a_remembered_value_is_taken_only_for_the_same_body():
    """:class:`FastJSONRequest` takes the value a middleware left (:func:`request_body.remember`) for a body equal
    to the one it parsed, and parses a different body itself."""
    import asyncio

    from rlserve.server.request_body import FastJSONRequest, remember

    async def read(remembered: bytes, sent: bytes):
        scope = {"type": "http", "method": "POST", "path": "/", "headers": []}
        remember(scope, remembered, {"a": "remembered"})

        async def receive():
            return {"type": "http.request", "body": sent, "more_body": False}

        return await FastJSONRequest(scope, receive).json()

    assert asyncio.run(read(b'{"a": 1}', b'{"a": 1}')) == {"a": "remembered"}
    assert asyncio.run(read(b'{"a": 1}', b'{"a": 2}')) == {"a": 2}


def test_fast_route_errors_are_openai_shaped():
    """What the comparison above compares is the server's answer, not two equal crashes."""
    client = TestClient(_app(), raise_server_exceptions=False)
    r = client.post("/fast/completions", content=b'{"prompt": [1, 2', headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    e = json.JSONDecodeError
    try:
        json.loads(b'{"prompt": [1, 2')
    except e as exc:
        assert r.json()["error"]["message"] == f"request body is not valid JSON: {exc.msg}"
    r = client.post("/fast/completions", content=b'{"prompt": [1, true]}', headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "as list[int]: prompt.1" in r.json()["error"]["message"], r.text
    ok = client.post("/fast/completions", content=b'{"prompt": [5, 6], "foo": 1}', headers={"Content-Type": "application/json"})
    assert ok.status_code == 200 and ok.json() == {"prompt": [5, 6], "extra": {"foo": 1}, "set": ["foo", "prompt"]}


def _bare(model, field: str):
    """``model`` with only ``field``, of its type without the fast path's validator (pydantic alone)."""
    info = model.model_fields[field]
    return create_model(f"Bare{model.__name__}", **{field: (info.annotation, ...)}, other=(Optional[int], None))


def _validated(model, field, value):
    try:
        return "ok", getattr(model.model_validate({field: value}), field)
    except ValidationError as e:
        return "error", [{k: err[k] for k in ("type", "loc", "msg", "input")} for err in e.errors()
                         if err["loc"][0] == field]


PROMPTS = [
    [1, 2, 3], list(range(512)), [0], [2 ** 70], [-1, 5], [1, True], [True, 1], [1, 2.0], [1.0, 2], [1, "2"], [1, None],
    [1, [2]], [[1, 2], [3]], [[1, 2], []], [[]], [[1], [True]], [[1], [2.0]], [[1], 2], [[1], ["a"]], [[1, "a"]],
    [list(range(512))] * 64, [["a"]], ["a", "b"], ["a", 1], "text", "", [], 5, None, [1] * 10 + [False],
]


@pytest.mark.parametrize("model,field", [(CompletionRequest, "prompt"), (TRLGenerateRequest, "prompts"),
                                         (TRLGenerateRequest, "prompt_ids")])
@pytest.mark.parametrize("prompt", PROMPTS, ids=range(len(PROMPTS)))
def test_prompt_ids_check_is_pydantics(model, field, prompt):
    """The fast path accepts what pydantic's validation of the field's type accepts, with an equal
    value (ints, not bools), and hands everything else to it (the same errors)."""
    got, ref = _validated(model, field, prompt), _validated(_bare(model, field), field, prompt)
    assert got == ref
    if got[0] == "ok" and isinstance(got[1], list):
        assert json.dumps(got[1]) == json.dumps(ref[1])  # (a True would dump as true)


@pytest.mark.parametrize("ids,vocab", [
    ([1, 2, 3], 10), ([0, 9], 10), ([10], 10), ([-1], 10), ([1, True], 10), ([1, 2.0], 10), ([1, "a"], 10),
    ((1, 2), 10), ([2 ** 70], 10), (list(range(512)), 512), (list(range(513)), 512), ([], 10),
])
def test_check_token_ids(ids, vocab):
    """Accepts an all-int list in the vocabulary; else the loops' message (non-ints first, then the range)."""
    def reference():
        if any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
            return f"token ids must be integers, got {[t for t in ids if not isinstance(t, int) or isinstance(t, bool)][:5]}"
        bad = [t for t in ids if not 0 <= t < vocab]
        return f"token ids out of the vocabulary [0, {vocab}): {bad[:5]}" if bad else None

    try:
        check_token_ids(ids, vocab, "token ids", param="prompt")
        got = None
    except APIError as e:
        assert (e.status, e.param, e.code) == (400, "prompt", "invalid_token_id")
        got = e.message
    assert got == reference()
