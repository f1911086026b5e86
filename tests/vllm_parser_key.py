"""vLLM's own answer to a tool-call / reasoning parse, run under a Python that has vLLM
(``tests/test_tool_parsers_vllm.py`` starts it as ``python tests/vllm_parser_key.py TOKENIZER``
with a JSON list of cases on stdin; it prints a JSON list of results).

A case: ``{"tool_parser", "reasoning_parser", "tools", "tool_choice", "chat_template_kwargs",
"prompt_ids", "ids"}``; ``ids`` are the generated token ids. For each case this builds the
parser vLLM's chat serving builds (``ParserManager.get_parser`` with ``enable_auto_tools``, one
parser per stream), then:

* ``full``: ``parser.parse`` of the whole text (``tokenizer.decode(ids)``, special tokens kept)
  as ``{"reasoning", "content", "tool_calls": [{"name", "arguments"}] | None, "reasoning_tokens"}``
  (``count_reasoning_tokens`` after the parse, as the serving code counts; None without a
  reasoning parser);
* ``deltas``: ``parser.parse_delta`` fed one token at a time (the text each token adds to the
  decode of the ids before it), each result as vLLM serializes it into a chunk
  (``model_dump(exclude_unset=True)``; ``None`` where vLLM sends no delta), tool-call ids
  replaced by ``"<id>"`` (random) after checking their form (``chatcmpl-tool-`` + 16 hex).

Run with no argument, it reads one JSON object of jobs instead (one vLLM import for all of
``tests/test_tool_parsers_vllm.py``'s questions): ``{"parse": [[TOKENIZER, CASES], ...], "tags":
[[FORMAT, TOOLS, TOOL_CHOICE, PARALLEL], ...], "mistral_schema": TOOLS}`` and prints ``{"parse":
[RESULTS, ...], "tags": [vLLM's structural tag (xgrammar's JSON) or None, ...], "mistral_schema":
[named, required]}`` (the forcing tags as ``DelegatingParser._apply_structural_tag`` builds them;
the mistral parser's guided schemas of ``_build_guided_schema_pre_v11``).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.tool_parse_cases import scrub_ids  # noqa: E402


def parse_results(tokenizer_path: str, cases: list[dict]) -> list[dict]:
    """vLLM's ``full`` / ``deltas`` answers to ``cases`` (the module docstring) with the tokenizer
    at ``tokenizer_path``."""
    from transformers import AutoTokenizer

    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.parser_manager import ParserManager

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    results = []
    for case in cases:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        if case.get("tools"):
            body["tools"] = case["tools"]
        if case.get("tool_choice") is not None:
            body["tool_choice"] = case["tool_choice"]
        if case.get("chat_template_kwargs"):
            body["chat_template_kwargs"] = case["chat_template_kwargs"]
        req = ChatCompletionRequest(**body)
        cls = ParserManager.get_parser(tool_parser_name=case.get("tool_parser"),
                                       reasoning_parser_name=case.get("reasoning_parser"),
                                       enable_auto_tools=True, tokenizer=tok)
        kw = {"chat_template_kwargs": case.get("chat_template_kwargs") or {}}
        ids = case["ids"]
        text = tok.decode(ids, skip_special_tokens=False)
        p = cls(tok, req.tools, **kw)
        p.set_prompt_token_ids(case["prompt_ids"])
        reasoning, content, calls = p.parse(text, req, enable_auto_tools=True, model_output_token_ids=ids)
        full = {"reasoning": reasoning, "content": content,
                "tool_calls": None if calls is None else [{"name": c.name, "arguments": c.arguments}
                                                          for c in calls],
                "reasoning_tokens": p.count_reasoning_tokens(ids) if case.get("reasoning_parser") else None}
        p = cls(tok, req.tools, **kw)
        deltas, prev = [], ""
        for k in range(len(ids)):
            cur = tok.decode(ids[:k + 1], skip_special_tokens=False)
            d = p.parse_delta(cur[len(prev):], [ids[k]], req, prompt_token_ids=case["prompt_ids"],
                              finished=k == len(ids) - 1)
            prev = cur
            deltas.append(None if d is None else scrub_ids(d.model_dump(exclude_unset=True)))
        results.append({"full": full, "deltas": deltas})
    return results


def structural_tags(cases: list) -> list:
    """vLLM's forcing structural tag of each ``[format, tools, tool_choice, parallel_tool_calls]``."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.structural_tag_registry import get_model_structural_tag, limit_to_single_tool_call
    from vllm.tool_parsers.tool_strict_level import ToolStrictLevel

    out = []
    for fmt, tools, choice, parallel in cases:
        r = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=tools,
                                  tool_choice=choice)
        # DelegatingParser._apply_structural_tag: parallel_tool_calls false raises the level to FUNCTION
        level = ToolStrictLevel.FUNCTION if parallel is False else ToolStrictLevel.AUTO
        tag = get_model_structural_tag(fmt, r.tools, r.tool_choice, reasoning=False, strict_level=level)
        if tag is not None and parallel is False:
            limit_to_single_tool_call(tag)
        out.append(None if tag is None else tag.model_dump(mode="json"))
    return out


def mistral_schemas(tools: list) -> list:
    """The mistral parser's guided schemas for a named (``get_weather``) and a required choice."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.mistral import MistralParser

    out = []
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        r = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=tools,
                                  tool_choice=choice)
        out.append(MistralParser._build_guided_schema_pre_v11(None, r))
    return out


def main() -> None:
    jobs = json.load(sys.stdin)
    if len(sys.argv) > 1:
        json.dump(parse_results(sys.argv[1], jobs), sys.stdout)
        return
    json.dump({"parse": [parse_results(tok, cases) for tok, cases in jobs.get("parse", [])],
               "tags": structural_tags(jobs.get("tags", [])),
               "mistral_schema": mistral_schemas(jobs["mistral_schema"]) if "mistral_schema" in jobs else None},
              sys.stdout)


if __name__ == "__main__":
    main()
