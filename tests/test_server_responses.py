"""``POST /v1/responses`` (OpenAI's Responses API) on a real ``rlserve serve`` process with a tiny
random Llama, driven by the official ``openai`` client: greedy text and token counts equal
``/v1/chat/completions`` on the same messages, ``incomplete`` at ``max_output_tokens``, the
streamed events in OpenAI's order parsed by the client's own event types, ``text.format``
through structured outputs, and a 400 naming the field for every unsupported feature."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseCompletedEvent, ResponseContentPartAddedEvent, \
    ResponseContentPartDoneEvent, ResponseCreatedEvent, ResponseInProgressEvent, ResponseOutputItemAddedEvent, \
    ResponseOutputItemDoneEvent, ResponseTextDeltaEvent, ResponseTextDoneEvent

from rlserve.server.testing import ServerProcess

TIMEOUT = 60.0
MODEL = "tiny"
SYSTEM, USER = "You are terse.", "Name three colors."
BASE = {"model": MODEL, "input": USER, "max_output_tokens": 4}


@pytest.fixture(scope="module")
def server(tiny_model):
    with ServerProcess(tiny_model("llama"), "--served-model-name", MODEL, "--max-model-len", "128",
                       "--weight-version", "v0", "--disable-access-log", "--device", "cpu") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


def _chat(client, messages, max_tokens, **extra):
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                       extra_body=dict(return_token_ids=True, **extra))
    return r.choices[0], r.usage


def test_greedy_equals_chat_and_incomplete_at_max_output_tokens(server, client):
    choice, usage = _chat(client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}], 8,
                          ignore_eos=True)
    r = client.responses.create(model=MODEL, instructions=SYSTEM, input=USER, max_output_tokens=8, temperature=0,
                                extra_body={"ignore_eos": True})
    assert r.output_text == choice.message.content and len(r.output_text) > 0
    assert r.usage.input_tokens == usage.prompt_tokens and r.usage.output_tokens == 8 == usage.completion_tokens
    assert r.usage.total_tokens == usage.prompt_tokens + 8
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.max_output_tokens == 8 and r.temperature == 0.0 and r.model == MODEL and r.instructions == SYSTEM
    assert r.model_extra["weight_version"] == "v0" and r.model_extra["weight_versions"] == ["v0"]
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "incomplete"
    assert [p.type for p in item.content] == ["output_text"] and r.id.startswith("resp_")
    # the raw answer validates against the openai package's own model (the client only constructs)
    raw = httpx.post(server.url + "/v1/responses", timeout=TIMEOUT, json={
        "model": MODEL, "instructions": SYSTEM, "input": USER, "max_output_tokens": 8, "temperature": 0,
        "ignore_eos": True})
    assert raw.status_code == 200
    assert Response.model_validate(raw.json()).output_text == choice.message.content


def test_message_items_and_completed(client):
    """List input with typed items and text parts (an assistant turn from a previous answer)
    renders as the same chat; a stop token ends it ``completed`` with the same token count."""
    messages = [{"role": "developer", "content": SYSTEM}, {"role": "user", "content": USER},
                {"role": "assistant", "content": "Red, blue"}, {"role": "user", "content": "More."}]
    probe, _ = _chat(client, messages, 6, ignore_eos=True)
    stop_id = probe.model_extra["token_ids"][2]
    choice, usage = _chat(client, messages, 6, ignore_eos=True, stop_token_ids=[stop_id])
    assert choice.finish_reason == "stop"
    items = [{"role": "developer", "content": [{"type": "input_text", "text": SYSTEM}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name three "},
                                                             {"type": "input_text", "text": "colors."}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Red, blue", "annotations": []}]},
             {"role": "user", "content": "More."}]
    r = client.responses.create(model=MODEL, input=items, max_output_tokens=6, temperature=0,
                                extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    assert r.status == "completed" and r.incomplete_details is None and r.output[0].status == "completed"
    assert r.output_text == choice.message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)


def test_partial_assistant_item_is_continued(client):
    """As vLLM: a last assistant item with status ``incomplete`` is continued (chat's
    ``continue_final_message``), not answered in a new turn."""
    messages = [{"role": "user", "content": USER}, {"role": "assistant", "content": "Red,"}]
    choice, usage = _chat(client, messages, 5, ignore_eos=True, continue_final_message=True,
                          add_generation_prompt=False)
    fresh, fresh_usage = _chat(client, messages, 5, ignore_eos=True)
    assert usage.prompt_tokens < fresh_usage.prompt_tokens  # the open turn: no end-of-turn, no new turn
    items = [{"role": "user", "content": USER},
             {"type": "message", "role": "assistant", "status": "incomplete",
              "content": [{"type": "output_text", "text": "Red,", "annotations": []}]}]
    r = client.responses.create(model=MODEL, input=items, max_output_tokens=5, temperature=0,
                                extra_body={"ignore_eos": True})
    assert r.output_text == choice.message.content and r.usage.input_tokens == usage.prompt_tokens
    items[-1]["status"] = "completed"
    done = client.responses.create(model=MODEL, input=items, max_output_tokens=5, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert done.output_text == fresh.message.content and done.usage.input_tokens == fresh_usage.prompt_tokens


def test_stream_events_in_order(client):
    kw = dict(model=MODEL, instructions=SYSTEM, input=USER, max_output_tokens=8, temperature=0,
              extra_body={"ignore_eos": True})
    ref = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    types = [type(e) for e in events]
    assert types[:4] == [ResponseCreatedEvent, ResponseInProgressEvent, ResponseOutputItemAddedEvent,
                         ResponseContentPartAddedEvent]
    assert types[-4:] == [ResponseTextDoneEvent, ResponseContentPartDoneEvent, ResponseOutputItemDoneEvent,
                          ResponseCompletedEvent]
    deltas = events[4:-4]
    assert 1 <= len(deltas) <= 8 and all(isinstance(e, ResponseTextDeltaEvent) for e in deltas)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in deltas)
    assert text == ref.output_text == events[-4].text == events[-3].part.text
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events[3:-2]) and events[-2].item.id == item_id
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.output_text == text and final.output[0].id == item_id
    assert (final.usage.input_tokens, final.usage.output_tokens) == (ref.usage.input_tokens, 8)
    assert final.model_extra["weight_version"] == "v0"
    # the client's higher-level helper reaches the final response too
    with client.responses.stream(**kw) as stream:
        assert stream.get_final_response().output_text == text


def test_aborted_request_is_cancelled(server):
    """A request aborted by ``/abort_requests`` with the response's id ends ``cancelled`` (and
    its stream still closes with ``response.completed``). A pause in mode ``keep`` holds it, so
    the abort lands before it runs, however fast the machine."""
    assert httpx.post(server.url + "/pause", params={"mode": "keep"}, timeout=TIMEOUT).status_code == 200
    events, aborted = [], 0
    try:
        with httpx.stream("POST", server.url + "/v1/responses", json=dict(BASE, stream=True), timeout=TIMEOUT) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(json.loads(line[6:]))
                if events[-1]["type"] == "response.in_progress":
                    rid, deadline = events[-1]["response"]["id"], time.monotonic() + TIMEOUT
                    while not aborted:  # until the request is held (a bound on a hang, not a speed limit)
                        assert time.monotonic() < deadline, "the request was never held"
                        aborted = httpx.post(server.url + "/abort_requests", json={"request_ids": [rid]},
                                             timeout=TIMEOUT).json()["aborted"]
    finally:
        httpx.post(server.url + "/resume", timeout=TIMEOUT)
    assert aborted == 1 and [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]
    assert final["type"] == "response.completed", events
    resp = Response.model_validate(final["response"])
    assert resp.status == "cancelled" and resp.incomplete_details is None and resp.usage.output_tokens == 0
    assert resp.output[0].status == "incomplete" and resp.output_text == ""


def test_text_format_json_schema(client):
    """``text.format`` json_schema constrains the output through the structured-outputs path."""
    pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (pip install 'rlserve[structured]')")
    r = client.responses.create(model=MODEL, input=USER, max_output_tokens=16, temperature=0,
                                text={"format": {"type": "json_schema", "name": "yn",
                                                 "schema": {"type": "string", "enum": ["yes", "no"]}}})
    assert json.loads(r.output_text) in ("yes", "no") and r.status == "completed"
    assert r.text.format.type == "json_schema"


@pytest.mark.parametrize("extra,param", [
    ({"store": True}, "store"),
    ({"background": True}, "background"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"truncation": "auto"}, "truncation"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                             {"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input.0.content.1"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input.0.type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({"input": [{"role": "user", "content": "x", "name": "bob"}]}, "input.0.name"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"model": "other"}, "model"),
])
def test_refused_fields_are_400_naming_them(server, extra, param):
    r = httpx.post(server.url + "/v1/responses", json=dict(BASE, **extra), timeout=TIMEOUT)
    want = 404 if param == "model" else 400
    assert r.status_code == want, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"] in ("invalid_request_error", "not_found_error")


def test_noop_values_accepted_and_client_error(client):
    r = client.responses.create(model=MODEL, input=USER, max_output_tokens=2, store=False, background=False,
                                tools=[], tool_choice="none", parallel_tool_calls=True, truncation="disabled",
                                include=[], top_logprobs=0, service_tier="auto", text={"format": {"type": "text"}},
                                metadata={"k": "v"}, user="u", extra_body={"ignore_eos": True})
    assert r.usage.output_tokens == 2 and r.metadata == {"k": "v"}
    assert "store" not in r.model_extra  # vLLM 0.32 sends no store key (nor does the client model have one)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input=USER, previous_response_id="resp_x")
    assert e.value.body["param"] == "previous_response_id"
