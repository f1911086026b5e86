"""The grammar that forces ``tool_choice: "required"`` or a named ``tool_choice`` in a tool
parser's own call format, as vLLM 0.32 builds it for parsers with a structural tag
(``vllm/tool_parsers/structural_tag_registry.py``, on by default through
``VLLM_ENFORCE_STRICT_TOOL_CALLING``): an xgrammar structural tag, handed to the sampler as the
EBNF grammar xgrammar derives from it.

``hermes``: one or more (named, or ``parallel_tool_calls: false``: exactly one) back-to-back
``<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>`` (or the same without the
newlines), ``NAME`` one of the tools (the named one), ``ARGS`` any JSON value, or the tool's
``parameters`` schema when the tool says ``"strict": true`` (vLLM's strictness rule).
"""

from __future__ import annotations

import json


def _hermes_tags(tools: list[dict]) -> list[dict]:
    tags = []
    for t in tools:
        fn = t.get("function", {})
        schema = fn.get("parameters") if fn.get("strict") is True and fn.get("parameters") is not None else True
        for begin, end in (('<tool_call>\n{"name": "', "}\n</tool_call>"), ('<tool_call>{"name": "', "}</tool_call>")):
            tags.append({"type": "tag", "begin": begin + fn["name"] + '", "arguments": ',
                         "content": {"type": "json_schema", "json_schema": schema}, "end": end})
    return tags


def structural_tag(fmt: str, tools: list[dict], tool_choice, parallel_tool_calls: bool | None) -> dict | None:
    """vLLM's structural tag (xgrammar's JSON form) forcing ``tool_choice`` in format ``fmt``;
    None for ``auto`` / ``none``.

    Raises:
        ValueError: an unknown ``fmt``.
    """
    if fmt != "hermes":
        raise ValueError(f"no structural tag for tool-call format {fmt!r}")
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        tools = [t for t in tools if t.get("function", {}).get("name") == name]
        single = True
    elif tool_choice == "required":
        single = parallel_tool_calls is False
    else:
        return None
    return {"type": "structural_tag", "format": {"type": "tags_with_separator", "tags": _hermes_tags(tools),
                                                 "separator": "", "at_least_one": True, "stop_after_first": single}}


def structural_grammar(fmt: str, tools: list[dict], tool_choice, parallel_tool_calls: bool | None) -> str | None:
    """:func:`structural_tag` as the EBNF grammar xgrammar compiles it to (None: no constraint).

    Raises:
        ValueError: xgrammar refuses the tag (e.g. a tool's ``parameters`` is not a schema).
        ImportError: xgrammar is not installed.
    """
    tag = structural_tag(fmt, tools, tool_choice, parallel_tool_calls)
    if tag is None:
        return None
    import xgrammar

    try:
        return str(xgrammar.Grammar.from_structural_tag(json.dumps(tag)))
    except (RuntimeError, TypeError, ValueError) as e:
        raise ValueError(f"the tools cannot be forced: {e}") from None
