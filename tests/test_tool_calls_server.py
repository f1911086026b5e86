"""Tool calling and reasoning through a real ``rlserve serve --enable-auto-tool-choice
--tool-call-parser hermes --reasoning-parser qwen3`` on a tiny random Qwen3-style model
(:mod:`tests.tool_models`): ``tool_choice`` required / named forced through the hermes grammar,
``auto`` and reasoning on outputs pinned with ``structured_outputs``, streamed and not, the
token ids whole (the markup the parsers remove is in them), vLLM's refusals, and a multi-turn
conversation with ``tool_calls`` / ``tool`` messages rendered as vLLM renders it.
The parsers themselves are compared with vLLM's in ``tests/test_tool_parsers_vllm.py``."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from rlserve.server.chat_output import ChatOutputConfig
from rlserve.server.chat_tools import check_tools
from rlserve.server.errors import APIError
from rlserve.server.protocol import ChatCompletionRequest
from rlserve.server.testing import ServerProcess
from rlserve.server.tool_parsers.hermes import HermesToolParser
from tests.tiny_models import build_tokenizer
from tests.tool_models import make_tool_model, tool_tokenizer
from tests.tool_parse_cases import TOOLS

pytest.importorskip("xgrammar")

# strict tools (their arguments follow the schema) whose arguments are one of two exact objects:
# xgrammar lets an object schema take any whitespace, which a random model may emit forever
CITY = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "enum": [{"city": "Paris"}, {"city": "Rome"}]}}}
ZONE = {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
    "enum": [{"zone": "CET"}, {"zone": "UTC"}]}}}
STRICT_TOOLS = [CITY, ZONE]
MSGS = [{"role": "user", "content": "weather?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tool_model(tmp_path_factory.mktemp("toolmodel"))
    # enable_in_reasoning: constraints apply from the first token, so structured_outputs can pin a
    # whole answer, reasoning included (the default waits for </think>: tests/test_vllm_tool_calls.py)
    with ServerProcess(model, "--device", "cpu", "--max-model-len", "1024", "--enable-auto-tool-choice",
                       "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                       "--structured-outputs-config", '{"enable_in_reasoning": true}') as srv:
        yield srv


def _post(server, body: dict, status: int = 200) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == status, r.text
    return r.json()


def _stream(server, body: dict) -> list[dict]:
    r = httpx.post(server.url + "/v1/chat/completions", json=dict(body, stream=True), timeout=300)
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def _merge(chunks: list[dict]) -> tuple[dict, str | None, list[int]]:
    """A stream's deltas merged into ``{"content", "reasoning", "tool_calls"}``, its finish
    reason and its token ids; checks vLLM's shape of each tool-call delta on the way."""
    content, reasoning, calls, finish, ids = None, None, {}, None, []
    for ch in chunks:
        for c in ch["choices"]:
            d = c["delta"]
            ids += c.get("token_ids") or []
            if d.get("content") is not None and d.get("role") is None:
                content = (content or "") + d["content"]
            if d.get("reasoning") is not None:
                reasoning = (reasoning or "") + d["reasoning"]
            for tc in d.get("tool_calls") or []:
                if tc["index"] not in calls:  # a call's first delta: id, type, name
                    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", tc["id"]) and tc["type"] == "function", tc
                    calls[tc["index"]] = {"name": tc["function"]["name"], "arguments": ""}
                else:
                    assert "id" not in tc and "name" not in tc["function"], tc
                calls[tc["index"]]["arguments"] += tc["function"].get("arguments") or ""
            finish = c["finish_reason"] or finish
    return {"content": content, "reasoning": reasoning,
            "tool_calls": [calls[i] for i in sorted(calls)]}, finish, ids


def _calls(message: dict) -> list[dict]:
    calls = message.get("tool_calls") or []
    for tc in calls:
        assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", tc["id"]) and tc["type"] == "function", tc
    return [tc["function"] for tc in calls]


@pytest.mark.parametrize("choice, finish", [("required", "tool_calls"),
                                            ({"type": "function", "function": {"name": "get_time"}}, "stop")])
def test_forced_call_is_parsed_and_its_tokens_kept(server, choice, finish):
    body = {"messages": MSGS, "tools": STRICT_TOOLS, "tool_choice": choice, "parallel_tool_calls": False,
            "max_tokens": 200, "temperature": 0, "return_token_ids": True}
    ans = _post(server, body)
    c = ans["choices"][0]
    assert c["finish_reason"] == finish, c
    calls = _calls(c["message"])
    assert len(calls) == 1 and c["message"]["content"] == ""
    args = json.loads(calls[0]["arguments"])
    if isinstance(choice, dict):
        assert calls[0]["name"] == "get_time" and args["zone"] in ("CET", "UTC")
    else:
        assert calls[0]["name"] in ("get_weather", "get_time") and set(args) <= {"city", "zone"} and len(args) == 1
    # token-in/token-out: the ids are the whole output, the <tool_call> markup included
    text = tool_tokenizer().decode(c["token_ids"], skip_special_tokens=True)
    assert text.startswith("<tool_call>")
    assert HermesToolParser({}).extract(text)[1] == [(calls[0]["name"], calls[0]["arguments"])]
    # the same request streamed: the same call, arguments as string fragments of the raw text
    # (vLLM's: the whole answer re-serializes them, so only their JSON values are equal), same ids
    merged, sfinish, ids = _merge(_stream(server, body))
    assert sfinish == finish and ids == c["token_ids"]
    assert [(t["name"], json.loads(t["arguments"])) for t in merged["tool_calls"]] == [(calls[0]["name"], args)]
    assert merged["reasoning"] is None


def test_auto_call_and_content(server):
    out = 'Sure <tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    body = {"messages": MSGS, "tools": TOOLS, "max_tokens": 100, "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": False}, "return_token_ids": True,
            "structured_outputs": {"regex": re.escape(out)}}
    c = _post(server, body)["choices"][0]
    assert c["finish_reason"] == "tool_calls"
    assert c["message"]["content"] == "Sure " and c["message"]["reasoning"] is None
    assert _calls(c["message"]) == [{"name": "get_time", "arguments": '{"zone": "CET"}'}]
    assert tool_tokenizer().decode(c["token_ids"], skip_special_tokens=True) == out
    merged, finish, _ = _merge(_stream(server, body))
    assert finish == "tool_calls" and merged == {"content": "Sure ", "reasoning": None,
                                                 "tool_calls": [{"name": "get_time", "arguments": '{"zone": "CET"}'}]}
    # tool_choice none: the same text stays content
    c = _post(server, dict(body, tool_choice="none"))["choices"][0]
    assert c["message"]["content"] == out and "tool_calls" not in c["message"] and c["finish_reason"] == "stop"


def test_reasoning_split_and_counted(server):
    out = "<think>\nabc\n</think>\n\nhello"
    body = {"messages": MSGS, "max_tokens": 60, "temperature": 0, "return_token_ids": True,
            "structured_outputs": {"regex": re.escape(out)}}
    ans = _post(server, body)
    c = ans["choices"][0]
    assert c["message"]["reasoning"] == "\nabc\n" and c["message"]["content"] == "\n\nhello"
    assert "reasoning_content" not in c["message"]  # vLLM 0.32 sends `reasoning` only
    tok = tool_tokenizer()
    assert tok.decode(c["token_ids"], skip_special_tokens=True) == out
    # usage counts the reasoning tokens as the parser does (compared with vLLM's count in
    # tests/test_tool_parsers_vllm.py): at least those of "\nabc\n", fewer than all
    n = ChatOutputConfig(None, "qwen3", False, tok).parser(None, None, None).reasoning_tokens(c["token_ids"])
    assert len(tok.encode("\nabc\n")) <= n < len(c["token_ids"])
    assert ans["usage"]["completion_tokens_details"] == {"reasoning_tokens": n}
    chunks = _stream(server, dict(body, stream_options={"include_usage": True}))
    merged, finish, _ = _merge(chunks)
    assert merged == {"content": "\n\nhello", "reasoning": "\nabc\n", "tool_calls": []} and finish == "stop"
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": n}
    # include_reasoning false: no reasoning, and (vLLM's rule) no token ids or logprobs that show it
    hidden = dict(body, include_reasoning=False, logprobs=True)
    c = _post(server, hidden)["choices"][0]
    assert c["message"]["reasoning"] is None and c["message"]["content"] == "\n\nhello"
    assert c["token_ids"] is None and c["logprobs"] is None
    chunks = _stream(server, hidden)
    assert all(ch["choices"][0].get("token_ids") is None and ch["choices"][0]["logprobs"] is None for ch in chunks)
    assert _merge(chunks)[0] == {"content": "\n\nhello", "reasoning": None, "tool_calls": []}


@pytest.mark.parametrize("case", ["thinking", "thinking_off", "include_reasoning_false", "in_reasoning", "deepseek"])
def test_constraint_waits_for_the_reasoning_end(case):
    """vLLM's gate, API side (``ChatOutputConfig.reasoning_gate``): under a reasoning parser a
    constraint gets the ids that end the reasoning (qwen3: after ``</think>``, or with
    ``<tool_call>``), unless the prompt already ended it (thinking off), ``include_reasoning`` is
    false or ``enable_in_reasoning`` is set; the engine side is tests/test_sampler_modes.py."""
    from rlserve.engine.sampling_params import StructuredOutputsParams
    from tests.tool_models import THINK_END_ID, TOOL_CALL_ID

    tok = tool_tokenizer()
    spec = StructuredOutputsParams(regex="a")
    cfg = ChatOutputConfig("hermes", "deepseek_r1" if case == "deepseek" else "qwen3", True, tok,
                           structured_in_reasoning=case == "in_reasoning")
    kwargs = {"enable_thinking": False} if case == "thinking_off" else None
    prompt = tok.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=True, **(kwargs or {}))
    prompt = prompt["input_ids"] if isinstance(prompt, dict) else prompt
    gated = cfg.reasoning_gate(spec, prompt, kwargs, include_reasoning=case != "include_reasoning_false")
    assert gated.regex == "a"
    if case == "thinking":
        assert (gated.reasoning_end_ids, gated.reasoning_implicit_end_ids) == ((THINK_END_ID,), (TOOL_CALL_ID,))
    elif case == "deepseek":
        assert (gated.reasoning_end_ids, gated.reasoning_implicit_end_ids) == ((THINK_END_ID,), ())
    else:
        assert gated is spec  # constrained from the first token
    assert cfg.reasoning_gate(None, prompt, kwargs) is None
    assert ChatOutputConfig("hermes", None, True, tok).reasoning_gate(spec, prompt, None) is spec


def test_vllms_refusals(server):
    named = {"type": "function", "function": {"name": "nope"}}
    cases = [({"tools": [], "tool_choice": "auto"}, "tools", "must not be an empty array"),
             ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
             ({"tools": TOOLS, "tool_choice": named}, "tool_choice", "does not match any of the specified `tools`"),
             ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function", "Invalid value"),
             ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0", "name")]
    for extra, param, msg in cases:
        err = _post(server, {"messages": MSGS, "max_tokens": 1, **extra}, 400)["error"]
        assert err["param"] == param and msg in err["message"], (extra, err)


@pytest.mark.parametrize("flags, choice, msg", [
    ((None, None, False), "auto", '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser'),
    ((None, "qwen3", False), "required", 'tool_choice="required" requires --tool-call-parser to be set'),
    ((None, None, False), {"type": "function", "function": {"name": "get_time"}},
     'tool_choice=function "get_time" requires --tool-call-parser to be set')])
def test_tool_choice_needs_the_flags(flags, choice, msg):
    cfg = ChatOutputConfig(*flags, tool_tokenizer())
    body = ChatCompletionRequest(messages=MSGS, tools=TOOLS, tool_choice=choice)
    with pytest.raises(APIError, match=re.escape(msg)):
        check_tools(body, cfg)
    assert check_tools(ChatCompletionRequest(messages=MSGS, tools=TOOLS, tool_choice="none"), cfg) == "none"


def test_parsers_need_their_tokens_at_startup():
    with pytest.raises(ValueError, match="--reasoning-parser deepseek_r1: .*'<think>'"):
        ChatOutputConfig(None, "deepseek_r1", False, build_tokenizer())
    with pytest.raises(ValueError, match=r"--tool-call-parser llama3_json: .*'<\|python_tag\|>'"):
        ChatOutputConfig("llama3_json", None, True, build_tokenizer())
    with pytest.raises(ValueError, match="--tool-call-parser nope: unknown"):
        ChatOutputConfig("nope", None, True, build_tokenizer())


def test_multi_turn_renders_tool_calls_and_results(server):
    """An assistant turn with ``tool_calls`` (arguments as the JSON string OpenAI clients send)
    and ``tool`` results render as the template renders the dict arguments vLLM passes it."""
    history = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "12:00"},
                                                               {"type": "text", "text": "CET"}]},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}]
    r = httpx.post(server.url + "/tokenize", json={"messages": history, "tools": TOOLS}, timeout=60)
    assert r.status_code == 200, r.text
    want_msgs = MSGS + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "CET"}}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00\nCET"},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}]
    tok = tool_tokenizer()
    # vLLM hands the template each tool as its pydantic dump: a missing description is null
    tools = [{"type": "function", "function": {"name": t["function"]["name"],
                                               "description": t["function"].get("description"),
                                               "parameters": t["function"]["parameters"]}} for t in TOOLS]
    want = tok.apply_chat_template(want_msgs, tools=tools, add_generation_prompt=True, tokenize=False)
    assert '"description": null' in want
    assert '{"name": "get_time", "arguments":{"zone": "CET"}}' in want and "12:00\nCET" in want
    assert r.json()["tokens"] == tok.encode(want, add_special_tokens=False)
