"""The fixed outputs on which rlserve's tool-call / reasoning parsers are compared with vLLM
0.32's (``tests/test_tool_parsers_vllm.py``): each case names the parsers, the request's tools /
tool_choice / chat_template_kwargs, and the generated text (tokenized with
:func:`tests.tool_models.tool_tokenizer`, so ``<think>``, ``</think>``, ``<tool_call>`` and
``</tool_call>`` are single tokens as in Qwen3). :func:`rlserve_answers` runs rlserve's parsers
the way ``tests/vllm_parser_key.py`` runs vLLM's."""

from __future__ import annotations

import re

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}},
                                                "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
    "zone": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
NAMED = {"type": "function", "function": {"name": "get_weather"}}
XML = ('<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n'
       '</parameter>\n</function>\n</tool_call>')
XML2 = '<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>'


def _case(text, tool_parser=None, reasoning_parser=None, tool_choice="auto", tools=TOOLS, kwargs=None,
          prompt="<|im_start|>assistant\n"):
    return {"text": text, "tool_parser": tool_parser, "reasoning_parser": reasoning_parser,
            "tools": tools if tool_parser else None, "tool_choice": tool_choice if tool_parser else None,
            "chat_template_kwargs": kwargs, "prompt": prompt}


CASES = [
    # hermes, auto
    _case("Hi there " + CALL, "hermes"),
    _case(CALL, "hermes"),
    _case(CALL + "\n" + CALL2, "hermes"),
    _case("no call at all, just text with a < sign", "hermes"),
    _case('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "hermes"),  # cut by max_tokens
    _case('<tool_call>\n{"name": "get_weather", "arguments": {"city": ', "hermes"),
    _case('<tool_call>\nnot json\n</tool_call>', "hermes"),
    _case("Hi " + CALL, "hermes", tool_choice="none"),
    # forced: required / named (the output a schema-constrained decode makes)
    _case('[{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}]', "hermes", tool_choice="required"),
    _case('[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": '
          '{"zone": "CET"}}]', "hermes", tool_choice="required"),
    _case('{"city": "Paris", "days": 3}', "hermes", tool_choice=NAMED),
    # reasoning
    _case("<think>\nLet me think.\n</think>\n\nThe answer is 4.", reasoning_parser="qwen3"),
    _case("Let me think.\n</think>\n\nThe answer is 4.", reasoning_parser="qwen3"),
    _case("Still thinking when cut", reasoning_parser="qwen3"),
    _case("The answer is 4.", reasoning_parser="qwen3", kwargs={"enable_thinking": False},
          prompt="<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    _case("<think>\nhmm</think>\n\nok", reasoning_parser="deepseek_r1"),
    _case("hmm, 1 < 2</think>\n\nok", reasoning_parser="deepseek_r1"),
    _case("all reasoning", reasoning_parser="deepseek_r1"),
    # reasoning + tools
    _case("<think>\nI need the weather.\n</think>\n\n" + CALL, "hermes", "qwen3"),
    _case("<think>\nI need the weather.\n</think>\n\nSure. " + CALL, "hermes", "qwen3"),
    _case("<think>\nhmm\n</think>\n\n" + '{"city": "Paris"}', "hermes", "qwen3", tool_choice=NAMED),
    _case("I need the weather.\n</think>\n\n" + CALL, "hermes", "deepseek_r1"),
    _case("I need the weather. " + CALL, "hermes", "qwen3"),  # a call ends the reasoning
    _case("a < b and </think> twice </think> done", reasoning_parser="qwen3"),
    _case("<think>x</think>y<think>z</think>w", reasoning_parser="deepseek_r1"),
    _case("Sure. " + CALL, "hermes", "qwen3", kwargs={"enable_thinking": False},
          prompt="<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    # llama3_json
    _case('{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', "llama3_json"),
    _case('<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}; '
          '{"name": "get_time", "parameters": {"zone": "CET"}}', "llama3_json"),
    _case('Hello, no call here', "llama3_json"),
    _case('Text first {"name": "get_time", "parameters": {"zone": "CET"}}', "llama3_json"),
    _case('{"name": "get_weather", "parameters": {"city": "Par', "llama3_json"),
    _case('{"nom": "x"}', "llama3_json"),
    # qwen3_xml (qwen3_coder)
    _case(XML, "qwen3_xml"),
    _case("Let me check. " + XML + "\n" + XML2, "qwen3_xml"),
    _case(XML[:60], "qwen3_xml"),
    _case("plain < text, no call", "qwen3_xml"),
    _case("Hi " + XML, "qwen3_xml", tool_choice="none"),
    _case('<tool_call>\n<function=get_time>\n<parameter=zone>\n"CET"\n</parameter>\n</function>', "qwen3_xml"),
    _case("<think>\nhmm\n</think>\n\n" + XML, "qwen3_xml", "qwen3"),
    _case("<think>\nhmm\n</think>\n\nSure. " + XML, "qwen3_xml", "qwen3"),
    _case("Sure. " + XML, "qwen3_xml", "qwen3", kwargs={"enable_thinking": False},
          prompt="<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    _case("hmm</think>\n\nSure. " + XML, "qwen3_xml", "deepseek_r1"),
]


# mistral (pre-v11: a Hugging Face tokenizer with [TOOL_CALLS], tests.tool_models.mistral_tool_tokenizer)
MCALL = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]'
MISTRAL_CASES = [_case(text, "mistral", tool_choice=choice, prompt="[INST] hi [/INST]") for text, choice in [
    ("Hi there " + MCALL, "auto"),
    (MCALL, "auto"),
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": '
     '{"zone": {"tz": ["CET", 1, -2.5e1, true, null]}}}] and after', "auto"),
    ('[TOOL_CALLS]{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"} tail', "auto"),  # bare, string args
    ('[TOOL_CALLS] [{"arguments": {"zone": "CET"}, "name": "get_time"}]', "auto"),  # arguments first
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par', "auto"),  # cut by max_tokens
    ('[TOOL_CALLS][{"name": "get_weather"', "auto"),
    ("[TOOL_CALLS]not json at all", "auto"),
    ('[TOOL_CALLS][{"nom": 1}]', "auto"),
    ("no call here, [just] {text}", "auto"),
    ("Hi " + MCALL, "none"),
    ('[{"name": "get_weather", "arguments": {"city": "Paris"}}]', "required"),  # forced: a bare array
    ('[{"name": "get_weather", "arguments": {"city": "Paris"}}]', NAMED),
    ("   ", "required"),
]]


def rlserve_answers(tokenizer, cases=CASES, enable_auto_tools=True) -> list[dict]:
    """rlserve's parse of each case, in the form of ``tests/vllm_parser_key.py``'s results
    (``full``: the whole output's reasoning / content / tool calls; ``deltas``: the stream
    deltas token by token, tool-call ids checked and replaced by ``"<id>"``)."""
    from rlserve.server.chat_output import ChatOutputConfig

    out = []
    for c in cases:
        cfg = ChatOutputConfig(c["tool_parser"], c["reasoning_parser"], enable_auto_tools, tokenizer)
        ids = tokenizer.encode(c["text"], add_special_tokens=False)
        prompt_ids = tokenizer.encode(c["prompt"], add_special_tokens=False)
        text = tokenizer.decode(ids, skip_special_tokens=False)
        p = cfg.parser(c["tools"], c["tool_choice"], c["chat_template_kwargs"])
        reasoning, content, calls = p.parse(text)
        full = {"reasoning": reasoning, "content": content,
                "tool_calls": None if calls is None else [{"name": n, "arguments": a} for n, a in calls],
                "reasoning_tokens": p.reasoning_tokens(ids) if c["reasoning_parser"] else None}
        p = cfg.parser(c["tools"], c["tool_choice"], c["chat_template_kwargs"])
        deltas, prev = [], ""
        for k in range(len(ids)):
            cur = tokenizer.decode(ids[:k + 1], skip_special_tokens=False)
            d = p.delta(cur[len(prev):], [ids[k]], prompt_ids, finished=k == len(ids) - 1)
            prev = cur
            deltas.append(None if d is None else scrub_ids(d))
        out.append({"full": full, "deltas": deltas})
    return out


def scrub_ids(obj):
    """``obj`` with every tool-call ``id`` checked and replaced: vLLM's ``chatcmpl-tool-`` + 16
    hex by ``"<id>"``, Mistral's 9 letters and digits by ``"<mistral-id>"``."""
    if isinstance(obj, dict):
        res = {}
        for k, v in obj.items():
            if k == "id" and isinstance(v, str):
                if re.fullmatch(r"[A-Za-z0-9]{9}", v):
                    v = "<mistral-id>"
                else:
                    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", v), v
                    v = "<id>"
            res[k] = scrub_ids(v)
        return res
    if isinstance(obj, list):
        return [scrub_ids(x) for x in obj]
    return obj


def vllm_cases(tokenizer, cases=CASES) -> list[dict]:
    """The cases as ``tests/vllm_parser_key.py`` reads them (token ids instead of text)."""
    return [{"tool_parser": c["tool_parser"], "reasoning_parser": c["reasoning_parser"], "tools": c["tools"],
             "tool_choice": c["tool_choice"], "chat_template_kwargs": c["chat_template_kwargs"],
             "prompt_ids": tokenizer.encode(c["prompt"], add_special_tokens=False),
             "ids": tokenizer.encode(c["text"], add_special_tokens=False)} for c in cases]
