"""Nothing a client sends may kill the engine or answer 500 (issue 33, findings 1, 5, 7 and
xgrammar's messages): the API -> engine-core boundary has one schema, enforced in the API process
(a bad value is a 400 naming the field); the core's input loop fails a message it cannot decode
alone; a lone surrogate anywhere in a body is a 400; TRL's ``/init_communicator/`` checks its
world size as ``/init_weight_transfer_engine`` does. After every refusal the same server still
generates the same greedy tokens, ``/health`` is 200 and the engine-core process is the same."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.transfer_harness import InProcessServer

PROMPT = [[5, 6, 7, 8]]
GREEDY = {"prompt_ids": PROMPT, "max_tokens": 6, "temperature": 0.0}


@pytest.fixture(scope="module")
def srv(tiny_model):
    with InProcessServer(tiny_model("llama")) as s:
        s.core_pid = s.aengine.core_pids()
        assert len(s.core_pid) == 1  # the engine runs in its own engine-core process
        s.greedy = _post(s, "/generate/", GREEDY).json()["completion_ids"]
        yield s


def _post(srv, route, body):
    # json.dumps writes a lone surrogate as the escape "\ud800", as any client would send it
    return httpx.post(srv.url + route, content=json.dumps(body), headers={"Content-Type": "application/json"},
                      timeout=60)


def _error(r, status=400):
    assert r.status_code == status, r.text
    return r.json()["error"]


def _still_serving(srv):
    """The server answers as before the bad request: same greedy ids, /health 200, same core."""
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    assert srv.aengine.core_pids() == srv.core_pid
    r = _post(srv, "/generate/", GREEDY)
    assert r.status_code == 200, r.text
    assert r.json()["completion_ids"] == srv.greedy


# ---- finding 1: typed values in TRL's generation_kwargs ------------------------------------------
@pytest.mark.parametrize("kwargs,param,says", [
    ({"top_k": 2.5}, "generation_kwargs.top_k", "expected int, got float (2.5)"),
    ({"ignore_eos": "yes"}, "generation_kwargs.ignore_eos", 'expected bool, got str ("yes")'),
    ({"n": "2"}, "generation_kwargs.n", 'expected int, got str ("2")'),
    ({"max_tokens": "x"}, "generation_kwargs.max_tokens", "expected int | null, got str"),
    ({"min_p": True}, "generation_kwargs.min_p", "expected float, got bool"),
    ({"stop": [1]}, "generation_kwargs.stop.0", "expected str, got int (1)"),
    ({"stop_token_ids": [1.5]}, "generation_kwargs.stop_token_ids", "must be integers, got [1.5]"),
    ({"stop_token_ids": [10 ** 9]}, "generation_kwargs.stop_token_ids", "out of the vocabulary"),
    ({"seed": 2 ** 70}, "generation_kwargs.seed", "must be in [-2**63, 2**64 - 1]"),
    ({"top_p": 7}, "generation_kwargs.top_p", "generation_kwargs.top_p must be in (0, 1], got 7"),
    ({"skip_special_tokens": None}, "generation_kwargs.skip_special_tokens", "expected bool, got null"),
])
def test_trl_generation_kwargs_are_typed(srv, kwargs, param, says):
    err = _error(_post(srv, "/generate/", {**GREEDY, "generation_kwargs": kwargs}))
    assert err["param"] == param, err
    assert says in err["message"] and err["message"].startswith(param), err
    _still_serving(srv)


#: (field, a value of the wrong type, a value out of range): TRL 1.16's VLLMClient sends its
#: generation_kwargs as /v1/completions fields, so one bad value must read the same in both places
#: (vLLM 0.32 answers code 400 for either kind on /v1/completions: tests/vllm_request_facts.py-style
#: probe of its CompletionRequest + create_error_response, run in session 16)
BAD_VALUES = [("temperature", "hot", -1), ("top_k", 2.5, -7), ("seed", "x", 2 ** 64), ("n", 1.5, 0)]


@pytest.mark.parametrize("field,wrong_type,out_of_range", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_generation_kwargs_codes_match_the_top_level(srv, field, wrong_type, out_of_range):
    """A value of the wrong type is ``invalid_value`` whether it comes as a /v1/completions field
    (pydantic) or in /generate/'s generation_kwargs (the core's schema; it was ``invalid_request``,
    a non-dict generation_kwargs ``invalid_value``); one out of range ``invalid_request`` in both."""
    for value, code in ((wrong_type, "invalid_value"), (out_of_range, "invalid_request")):
        top = _error(_post(srv, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2, field: value}))
        kw = _error(_post(srv, "/generate/", {**GREEDY, "generation_kwargs": {field: value}}))
        assert (top["param"], kw["param"]) == (field, f"generation_kwargs.{field}"), (top, kw)
        assert (top["code"], kw["code"]) == (code, code), (value, top, kw)
    assert _error(_post(srv, "/generate/", {**GREEDY, "generation_kwargs": [1]}))["code"] == "invalid_value"
    unknown = _error(_post(srv, "/generate/", {**GREEDY, "generation_kwargs": {"temprature": 1}}))
    assert (unknown["param"], unknown["code"]) == ("generation_kwargs.temprature", "unknown_field"), unknown
    top = _error(_post(srv, "/v1/completions", {"prompt": [5, 6], "temprature": 1}))
    assert (top["param"], top["code"]) == ("temprature", "unknown_field"), top
    _still_serving(srv)


def test_trl_generate_logprobs_is_0_or_null(srv):
    """TRL's /generate/ answers the sampled token's logprob (``logprobs`` 0, its default) or none
    (null); any other value was accepted and answered the same one logprob per token (top-k
    silently dropped): now a 400 naming the field, in the body or in generation_kwargs."""
    one = _post(srv, "/generate/", {**GREEDY, "logprobs": 0}).json()
    ref = _post(srv, "/v1/completions", {"prompt": PROMPT[0], "max_tokens": 6, "temperature": 0.0,
                                         "logprobs": 0}).json()["choices"][0]["logprobs"]["token_logprobs"]
    assert one["completion_ids"] == srv.greedy and len(one["logprobs"][0]) == 6
    assert one["logprobs"][0] == pytest.approx(ref, abs=1e-6)  # the same engine and request: float32 equal
    assert _post(srv, "/generate/", {**GREEDY, "logprobs": None}).json()["logprobs"] is None
    off = _post(srv, "/generate/", {**GREEDY, "generation_kwargs": {"logprobs": None}}).json()
    assert off["logprobs"] is None and off["completion_ids"] == srv.greedy
    for bad in (2, -1, 20, "3", True):
        err = _error(_post(srv, "/generate/", {**GREEDY, "logprobs": bad}))
        assert err["param"] == "logprobs" and "must be 0" in err["message"], (bad, err)
    err = _error(_post(srv, "/generate/", {**GREEDY, "generation_kwargs": {"logprobs": 3}}))
    assert err["param"] == "generation_kwargs.logprobs" and "must be 0" in err["message"], err
    _still_serving(srv)


def test_wire_limits_on_openai_routes(srv):
    """An integer MessagePack cannot carry is a 400 naming it (it was a 500 from the core client)."""
    err = _error(_post(srv, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "seed": 2 ** 64}))
    assert err["param"] == "seed" and "got 18446744073709551616" in err["message"], err
    assert _post(srv, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "seed": 2 ** 64 - 1}).status_code == 200
    _still_serving(srv)


# ---- the core's loop: a message it cannot decode fails alone ------------------------------------
def test_core_refuses_an_undecodable_add_alone(srv):
    """Parameters the API's schema would have refused, sent straight to the core (a SamplingParams
    built without the check): that request fails with a 400-class error, the core lives on."""
    from rlserve.engine.sampling_params import SamplingParams
    from rlserve.errors import InvalidRequestError

    async def run(params):
        return [o async for o in srv.aengine.generate([5, 6, 7], params, "bad-add-1", stream=False)]

    with pytest.raises(InvalidRequestError, match=r"could not decode.*Expected `int`, got `float` - at `\$\.params\.top_k`"):
        asyncio.run(run(SamplingParams(top_k=2.5, max_tokens=3)))
    with pytest.raises(InvalidRequestError, match=r"could not decode.*Expected `bool`, got `str`"):
        asyncio.run(run(SamplingParams(ignore_eos="yes", max_tokens=3)))
    _still_serving(srv)


def test_core_survives_garbage_on_its_socket(srv):
    """Bytes that are not a message, a message of an unknown kind, an add and a utility call of
    the wrong shape, written straight into the core's input socket: each is refused alone; a
    utility call that can be answered is answered with its error."""
    import msgspec

    rep = srv.aengine._replicas[0]
    enc = msgspec.msgpack.encode
    for raw in (b"\x00\x01 not messagepack", enc({"type": "nope"}), enc([1, 2, 3]),
                enc({"type": "add", "request_id": "ghost", "prompt": [5], "params": {"top_k": "x"}, "stream": False,
                     "arrival_time": 0.0}),
                enc({"type": "abort", "request_ids": "not-a-list"})):
        with rep._send_lock:
            rep._in.send(raw)
    fut = rep._call("stats")  # a real call after the garbage: the loop is still there
    assert isinstance(fut.result(timeout=30), dict)
    # a call with its id but a malformed body gets its own error back
    import concurrent.futures

    bad = concurrent.futures.Future()
    rep._calls[987654] = bad
    with rep._send_lock:
        rep._in.send(enc({"type": "call", "call_id": 987654, "method": 5}))
    with pytest.raises(Exception, match="could not decode.*Expected `str`, got `int`"):
        bad.result(timeout=30)
    _still_serving(srv)


# ---- finding 5: lone surrogates anywhere --------------------------------------------------------
S = "a\ud800b"


@pytest.mark.parametrize("route,body,param", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": [S]}, "stop.0"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": S}, "stop"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "model": S}, "model"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "user": S}, "user"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "suffix": S}, "suffix"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": S}], "max_tokens": 2},
     "messages.0.name"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": S}]}],
                              "max_tokens": 2}, "messages.0.content.0.text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "tools": [{"type": "function", "function": {"name": S}}], "tool_choice": "none"},
     "tools.0.function.name"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "chat_template_kwargs": {S: 1}}, "chat_template_kwargs.a\\ud800b"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "instructions": S}, "instructions"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "metadata": {"k": S}}, "metadata.k"),
    ("/generate/", {**GREEDY, "generation_kwargs": {"stop": [S]}}, "generation_kwargs.stop.0"),
    ("/tokenize", {"prompt": S}, "prompt"),
    ("/init_communicator/", {"host": S, "port": 29500}, "host"),
    ("/update_weights", {"update_info": {"names": [S], "dtype_names": ["float32"], "shapes": [[1]]}},
     "update_info.names.0"),
])
def test_lone_surrogate_anywhere_is_a_400(srv, route, body, param):
    err = _error(_post(srv, route, body))
    assert err["code"] == "invalid_text" and err["param"] == param, err
    assert "lone UTF-16 surrogate (U+D800)" in err["message"], err
    _still_serving(srv)


def test_valid_text_passes_the_check(srv):
    """A surrogate pair (an emoji, escaped by json.dumps as two halves) and the text \\ud800 (a
    backslash: not a surrogate) are fine."""
    for stop in (["\U0001F600"], ["\\ud800"], ["\U0010FFFF"]):
        r = _post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": stop})
        assert r.status_code == 200, r.text


def test_raw_surrogate_bytes_are_a_400(srv):
    """A body with the UTF-8-style bytes of a surrogate (Python's json reads them with
    surrogatepass) is refused the same way."""
    body = b'{"prompt": "hi", "max_tokens": 2, "stop": ["\xed\xa0\x80"]}'
    r = httpx.post(srv.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"},
                   timeout=60)
    err = _error(r)
    assert err["param"] == "stop.0" and err["code"] == "invalid_text", err


def test_error_answers_are_always_encodable():
    """An error whose message quotes a client's lone surrogate still renders (it was a 500 from
    building the 404 of an unknown model)."""
    from fastapi.responses import JSONResponse

    from rlserve.server.errors import APIError, error_body

    e = APIError(404, "The model `\ud800` does not exist", param="model\udfff", code="model_not_found")
    for body in (e.body(), error_body(404, e.message, e.param, e.code)):
        rendered = json.loads(JSONResponse(body).body)
        assert rendered["error"]["message"] == "The model `\\ud800` does not exist"
        assert rendered["error"]["param"] == "model\\udfff"


# ---- finding 7: TRL's world size ----------------------------------------------------------------
@pytest.mark.parametrize("world_size", [-5, 1e9, 0, 3])
def test_trl_init_communicator_checks_world_size(srv, world_size):
    """The same check as /init_weight_transfer_engine: this server's workers + 1 (here 2)."""
    err = _error(_post(srv, "/init_communicator/", {"host": "127.0.0.1", "port": 29500, "world_size": world_size}))
    assert err["message"] == f"world_size must be 2 (this server's 1 worker(s) + 1 trainer), got {int(world_size)}"
    assert err["code"] == "weight_update_refused"
    r = _post(srv, "/close_communicator/", {})  # nothing was opened: nothing fails later
    assert r.status_code == 200, r.text
    assert httpx.get(srv.url + "/weight_info", timeout=10).json()["state"] == "uninitialized"
    _still_serving(srv)


@pytest.mark.parametrize("port,says", [(70000, "port must be <= 65535, got 70000"),
                                       (-1, "port must be >= 0, got -1"),
                                       (0, "port must be set (1..65535) for gloo/nccl")])
def test_trl_init_communicator_names_its_port(srv, port, says):
    err = _error(_post(srv, "/init_communicator/", {"host": "127.0.0.1", "port": port, "world_size": 2}))
    assert err["message"] == says, err


def test_chunked_bodies_are_checked_whole(srv):
    """A body sent in chunks (Transfer-Encoding: chunked) is checked once whole: an escape split
    across two chunks is still found, and a clean chunked body is served."""
    def chunks(text):
        data = text.encode()
        cut = data.index(b"\\ud800") + 3  # inside the escape
        yield data[:cut]
        yield data[cut:]

    body = json.dumps({"prompt": "hi", "max_tokens": 2, "stop": ["x\ud800"]})
    r = httpx.post(srv.url + "/v1/completions", content=chunks(body), headers={"Content-Type": "application/json"},
                   timeout=60)
    assert _error(r)["param"] == "stop.0"
    clean = json.dumps(GREEDY)
    r = httpx.post(srv.url + "/generate/", content=(p for p in (clean[:7].encode(), clean[7:].encode())),
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 200 and r.json()["completion_ids"] == srv.greedy, r.text


# ---- xgrammar's messages ------------------------------------------------------------------------
@pytest.mark.parametrize("so,says", [
    ({"regex": "a("}, "structured_outputs.regex is not valid: Regex parsing error at position 3: "
                      "The parenthesis is not closed."),
    ({"json": "{bad"}, "structured_outputs.json is not valid: Failed to parse JSON: syntax error at line 1 near: bad."),
    ({"grammar": "root ::= foo"}, 'structured_outputs.grammar is not valid: EBNF parser error at line 1, column 10: '
                                  'Rule "foo" is not defined'),
])
def test_grammar_errors_carry_no_source_paths(srv, so, says):
    err = _error(_post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "structured_outputs": so}))
    assert err["message"] == says, err
    assert err["param"] == "structured_outputs"
