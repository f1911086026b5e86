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
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.tool_parse_cases import scrub_ids  # noqa: E402


def main() -> None:
    from transformers import AutoTokenizer

    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.parser_manager import ParserManager

    tok = AutoTokenizer.from_pretrained(sys.argv[1])
    results = []
    for case in json.load(sys.stdin):
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
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
