"""Inputs the server used to accept or answer with internals (issue 25's list): a lone UTF-16
surrogate in a prompt is a clear 400, token ids must be JSON integers (no booleans, no floats),
an unexpected exception is a logged 500 that does not show its text, and the OpenAPI schema
lists the error answers of the routes. From a newcomer's walk through the README (2026-12-02):
a NaN / Infinity ``temperature`` or ``repetition_penalty`` (Python's json reads them) is a 400,
not a 200 of garbage or, on /v1/responses, a 500; ``stream_options`` without ``stream: true``
is a 400 as in vLLM."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from tests.transfer_harness import InProcessServer

SURROGATE = "a\ud800b"  # JSON "a\\ud800b": one half of a surrogate pair, alone


@pytest.fixture(scope="module")
def srv(tiny_model):
    with InProcessServer(tiny_model("llama")) as s:
        yield s


def _post(srv, route, body):
    # json.dumps escapes the surrogate ("\\ud800"), as a client in another language would send it
    return httpx.post(srv.url + route, content=json.dumps(body), headers={"Content-Type": "application/json"},
                      timeout=60)


def _error(r, status):
    assert r.status_code == status, r.text
    return r.json()["error"]


@pytest.mark.parametrize("route,body,param", [
    ("/v1/completions", {"prompt": SURROGATE, "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", SURROGATE], "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": SURROGATE}], "max_tokens": 2}, "messages"),
    ("/generate/", {"prompts": [SURROGATE], "max_tokens": 2}, "prompts"),
])
def test_lone_surrogate_is_a_clear_400(srv, caplog, route, body, param):
    with caplog.at_level(logging.ERROR):
        r = _post(srv, route, body)
        err = _error(r, 400)
    assert err["code"] == "invalid_text" and err["param"].startswith(param), err
    # encoded as every other error (the routes' JSONResponse: compact, no spaces); it had ", " and ": "
    assert r.content == json.dumps(r.json(), ensure_ascii=False, separators=(",", ":")).encode(), r.content
    assert "lone UTF-16 surrogate (U+D800) at character 1" in err["message"], err
    assert "TypeError" not in err["message"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text  # no traceback logged
    assert _post(srv, route, {**body, **({"prompt": "a\U0001F600b"} if "prompt" in body else {})}).status_code in (
        200, 400)  # (the server lives on)


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"prompt": [True], "max_tokens": 2}),
    ("/v1/completions", {"prompt": [1.0], "max_tokens": 2}),
    ("/v1/completions", {"prompt": [[5, False]], "max_tokens": 2}),
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "stop_token_ids": [True]}),
    ("/generate/", {"prompt_ids": [[False]], "max_tokens": 2}),
    ("/generate/", {"prompt_ids": [[5, 2.0]], "max_tokens": 2}),
    ("/generate/", {"prompts": [[True, 5]], "max_tokens": 2}),
])
def test_token_ids_must_be_integers(srv, route, body):
    err = _error(_post(srv, route, body), 400)
    assert err["param"].split(".")[0] in ("prompt", "prompt_ids", "prompts", "stop_token_ids"), err
    ok = {k: ([5, 6] if k == "prompt" else [[5, 6]] if k in ("prompt_ids", "prompts") else v)
          for k, v in body.items() if k != "stop_token_ids"}
    assert _post(srv, route, ok).status_code == 200  # the same request with integers works


@pytest.mark.parametrize("body,where", [
    ({"prompt": [1, True, 3]}, "as list[int]: prompt.1: Input should be a valid integer (got true)"),
    ({"prompt": [[1, 2], [3, True]]}, "as list[list[int]]: prompt.1.1: Input should be a valid integer (got true)"),
])
def test_union_error_names_the_element(srv, body, where):
    """A prompt no accepted shape matches: the message says which element of the closest shape
    is wrong (it used to say only "invalid type or value")."""
    err = _error(_post(srv, "/v1/completions", {**body, "max_tokens": 2}), 400)
    assert err["param"] == "prompt" and err["code"] == "invalid_value", err
    assert where in err["message"], err


@pytest.mark.parametrize("route,body,param", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": -1}, "max_output_tokens"),
])
def test_max_tokens_error_names_the_field_sent(srv, route, body, param):
    err = _error(_post(srv, route, body), 400)
    assert err["param"] == param and err["message"].startswith(f"{param} must be >= 1, got "), err


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", CHAT),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
])
@pytest.mark.parametrize("field,value", [("temperature", float("nan")), ("temperature", float("inf")),
                                         ("repetition_penalty", float("nan")), ("repetition_penalty", float("inf"))])
def test_non_finite_sampling_floats_are_a_400(srv, route, body, field, value):
    """``NaN`` passes every ``<`` check; it used to sample (an empty text, 200) and on
    /v1/responses failed to serialise its echo (500)."""
    err = _error(_post(srv, route, {**body, field: value}), 400)
    assert err["param"] == field and err["code"] == "invalid_request", err
    assert err["message"] == f"{field} must be a finite number {'>=' if field == 'temperature' else '>'} 0, " \
                             f"got {value}", err
    assert _post(srv, route, {**body, field: 1.0}).status_code == 200  # the server lives on


@pytest.mark.parametrize("route,body", [("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                                        ("/v1/chat/completions", CHAT)])
def test_stream_options_need_stream(srv, route, body):
    """vLLM's ``validate_stream_options``: options without ``stream: true`` are a 400; ``{}`` passes."""
    for extra in ({}, {"stream": False}):
        err = _error(_post(srv, route, {**body, **extra, "stream_options": {"include_usage": True}}), 400)
        assert err["param"] == "stream_options" and err["code"] == "invalid_value", err
        assert err["message"] == ('stream_options: stream_options can only be defined when stream=true '
                                  '(got {"include_usage": true})'), err
    assert _post(srv, route, {**body, "stream_options": {}}).status_code == 200
    r = _post(srv, route, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text


def test_body_without_json_content_type_says_so(srv):
    """``curl -d '{...}'`` without ``-H 'Content-Type: application/json'`` sends a form type:
    the 400 names the header (it used to say "Input should be a valid dictionary")."""
    r = httpx.post(srv.url + "/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}',
                   headers={"Content-Type": "application/x-www-form-urlencoded"}, timeout=60)
    err = _error(r, 400)
    assert err["param"] is None and err["code"] == "invalid_value", err
    assert err["message"] == ("the body must be sent as JSON with the header Content-Type: application/json "
                              "(curl: -H 'Content-Type: application/json'); got b'{\"prompt\": \"hi\", "
                              "\"max_tokens\": 2}'"), err


def test_unexpected_exception_is_a_logged_500_without_internals(srv, caplog, monkeypatch):
    state = srv.app.state.rlserve

    def broken(*a, **k):
        raise TypeError("secret internal detail")

    monkeypatch.setattr(state, "tokenize_many", broken)  # the completions route's prompt step
    with caplog.at_level(logging.ERROR, logger="rlserve.server.errors"):
        err = _error(_post(srv, "/v1/completions", {"prompt": "hello", "max_tokens": 2}), 500)
    assert err["code"] == "internal_error" and "secret" not in err["message"], err
    assert "secret internal detail" in caplog.text  # the log has it, with its traceback
    monkeypatch.undo()
    assert _post(srv, "/v1/completions", {"prompt": "hello", "max_tokens": 2}).status_code == 200


def test_openapi_lists_error_answers(srv):
    spec = httpx.get(srv.url + "/openapi.json", timeout=30).json()
    paths = spec["paths"]
    for route in ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update"):
        codes = set(paths[route]["post"]["responses"])
        assert {"400", "401", "409", "503", "504"} <= codes, (route, codes)
        err = paths[route]["post"]["responses"]["409"]["content"]["application/json"]["schema"]
        assert err == {"$ref": "#/components/schemas/ErrorResponse"}, err
    for route in ("/v1/completions", "/v1/chat/completions"):
        codes = set(paths[route]["post"]["responses"])
        assert {"400", "401", "503"} <= codes, (route, codes)
    props = spec["components"]["schemas"]["ErrorResponse"]["properties"]["error"]
    assert props  # {"message", "type", "param", "code"}


def test_chat_template_fields_are_defined_once():
    """``/v1/chat/completions`` and ``/tokenize`` take the same chat-template fields (vLLM's
    names), defined once (``protocol.ChatTemplateFields``): both bodies hand the same
    ``render_chat`` arguments on, with the same defaults; ``/tokenize`` refuses exactly these
    with ``prompt``."""
    from rlserve.server.protocol import (
        TOKENIZE_CHAT_FIELDS,
        ChatCompletionRequest,
        ChatTemplateFields,
        TokenizeRequest,
    )

    assert TOKENIZE_CHAT_FIELDS == ("add_generation_prompt", "continue_final_message", "chat_template",
                                    "chat_template_kwargs", "tools")
    assert issubclass(ChatCompletionRequest, ChatTemplateFields) and issubclass(TokenizeRequest, ChatTemplateFields)
    msgs = [{"role": "user", "content": "hi"}]
    args = {"add_generation_prompt": False, "continue_final_message": True, "chat_template": "{{ 1 }}",
            "chat_template_kwargs": {"k": 1}, "tools": [{"type": "function"}]}
    assert ChatCompletionRequest(messages=msgs, **args).chat_template_args() == args
    assert TokenizeRequest(messages=msgs, **args).chat_template_args() == args
    defaults = {"add_generation_prompt": True, "continue_final_message": False, "chat_template": None,
                "chat_template_kwargs": None, "tools": None}
    assert ChatCompletionRequest(messages=msgs).chat_template_args() == defaults
    assert TokenizeRequest(messages=msgs).chat_template_args() == defaults


def test_trl_generate_truncates_prompts_as_vllm(srv):
    """TRL's /generate/ passes truncate_prompt_tokens to vLLM's SamplingParams: k keeps the last
    k tokens, -1 means max_model_len, 0 and values below -1 are refused. rlserve's route cut only
    for k > 0 and silently ignored 0 and -5 (fails on the old code: 200)."""
    prompt = [5, 6, 7, 8, 9, 10]
    body = {"prompts": [prompt], "max_tokens": 1, "temperature": 0}
    for k, kept in ((3, prompt[-3:]), (-1, prompt)):
        r = _post(srv, "/generate/", dict(body, truncate_prompt_tokens=k))
        assert r.status_code == 200 and r.json()["prompt_ids"] == [kept], r.text
    for k in (0, -5):
        err = _error(_post(srv, "/generate/", dict(body, truncate_prompt_tokens=k)), 400)
        assert err["param"] == "truncate_prompt_tokens" and f"got {k}" in err["message"], err


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2}),
    ("/v1/chat/completions", CHAT),
])
def test_routed_experts_prompt_start_beyond_the_prompt_names_the_field(srv, route, body):
    """A start past the prompt's last token is a 400 that names the field (it came from the
    engine's own check with param null: fails on the old code). 0 and the prompt length pass."""
    err = _error(_post(srv, route, dict(body, routed_experts_prompt_start=10_000)), 400)
    assert err["param"] == "routed_experts_prompt_start", err
    assert "got 10000" in err["message"] and "prompt length" in err["message"], err
    if route == "/v1/completions":
        assert _post(srv, route, dict(body, routed_experts_prompt_start=3)).status_code == 200


@pytest.mark.parametrize("field", ["prompt_ids", "prompts"])
def test_trl_generate_errors_name_the_field_the_prompts_came_in(srv, field):
    """/generate/ takes token-id prompts as ``prompt_ids`` or ``prompts``: an error in the second
    prompt names ``<field>.1`` (pydantic's name for that element), not always ``prompts.1`` (fails
    on the old code for prompt_ids); a prompt that fills the context names its element too."""
    err = _error(_post(srv, "/generate/", {field: [[5, 6], [7, 10 ** 9]], "max_tokens": 2}), 400)
    assert err["param"] == f"{field}.1", err
    err = _error(_post(srv, "/generate/", {field: [[5, 6], [5] * 500], "max_tokens": 2}), 400)
    assert err["param"] == f"{field}.1" and err["code"] == "context_length_exceeded", err
    err = _error(_post(srv, "/generate/", {field: [], "max_tokens": 2}), 400)
    assert err["param"] == field, err
