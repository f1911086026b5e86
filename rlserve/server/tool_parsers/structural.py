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


_LISTS = ("triggered_tags", "tags_with_separator", "token_triggered_tags")


def _single_call(node) -> None:
    """vLLM's ``limit_to_single_tool_call``: every call list in the tag stops after one call."""
    if isinstance(node, dict):
        if node.get("type") in _LISTS:
            node["stop_after_first"] = True
        for v in node.values():
            _single_call(v)
    elif isinstance(node, list):
        for v in node:
            _single_call(v)


def structural_tag(fmt: str, tools: list[dict], tool_choice, parallel_tool_calls: bool | None) -> dict | None:
    """vLLM's structural tag (xgrammar's JSON form) forcing ``tool_choice`` in format ``fmt``:
    ``required`` / named always; ``auto`` when a tool is ``"strict": true`` or with
    ``parallel_tool_calls: false`` (calls, once started, follow the format; at most one: vLLM's
    rule); else None. ``hermes`` is built here as vLLM builds it; the other formats
    (``llama``, ``qwen_3_coder``) are xgrammar's builtin model tags, as vLLM takes them.

    Raises:
        ValueError: xgrammar has no such format.
    """
    single = parallel_tool_calls is False
    any_strict = any(t.get("function", {}).get("strict") is True for t in tools)
    if tool_choice == "auto" and not (single or any_strict) or tool_choice in (None, "none"):
        return None
    if fmt == "hermes":
        if isinstance(tool_choice, dict):
            name = tool_choice["function"]["name"]
            tools = [t for t in tools if t.get("function", {}).get("name") == name]
            fmt_ = {"type": "tags_with_separator", "tags": _hermes_tags(tools), "separator": "", "at_least_one": True,
                    "stop_after_first": True}
        elif tool_choice == "required":
            fmt_ = {"type": "tags_with_separator", "tags": _hermes_tags(tools), "separator": "", "at_least_one": True,
                    "stop_after_first": False}
        else:
            fmt_ = {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": _hermes_tags(tools),
                    "at_least_one": False, "stop_after_first": False}
        tag = {"type": "structural_tag", "format": fmt_}
    else:
        import xgrammar

        strict = [{"type": "function", "function": dict(t["function"], strict=t["function"].get("strict") is True)}
                  for t in tools]
        try:
            tag = xgrammar.get_model_structural_tag(fmt, tools=strict, tool_choice=tool_choice,
                                                    reasoning=False).model_dump(mode="json")
        except (KeyError, ValueError) as e:
            raise ValueError(f"no structural tag for tool-call format {fmt!r}: {e}") from None
    if single:
        _single_call(tag)
    return tag


def output_format(spec) -> dict:
    """A request's own constraint (a :class:`~rlserve.engine.sampling_params.StructuredOutputsParams`)
    as an xgrammar structural-tag format (vLLM's ``structured_outputs_to_format``)."""
    if spec.json_object:
        return {"type": "json_schema", "json_schema": {"type": "object"}}
    if spec.json is not None:
        return {"type": "json_schema", "json_schema": json.loads(spec.json)}
    if spec.regex is not None:
        return {"type": "regex", "pattern": spec.regex}
    if spec.choice is not None:
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in spec.choice]}
    return {"type": "grammar", "grammar": spec.grammar}


def auto_or_output(fmt: str, tools: list[dict], parallel_tool_calls: bool | None, spec) -> dict | None:
    """``tool_choice: auto`` with the request's own constraint ``spec``, as vLLM 0.32's
    ``DelegatingParser._apply_structural_tag``: when a tool is ``"strict": true``, the output is
    either calls in the parser's format (forced as for ``required``) or what ``spec`` asks for
    (an xgrammar ``or``); otherwise None (``spec`` alone applies: the calls are not constrained)."""
    if not any(t.get("function", {}).get("strict") is True for t in tools):
        return None
    tag = structural_tag(fmt, tools, "required", parallel_tool_calls)
    return {"type": "structural_tag", "format": {"type": "or", "elements": [tag["format"], output_format(spec)]}}


def structural_grammar(fmt: str, tools: list[dict], tool_choice, parallel_tool_calls: bool | None,
                       own=None) -> str | None:
    """:func:`structural_tag` as the EBNF grammar xgrammar compiles it to (None: no constraint);
    ``own``: the request's own constraint under ``auto`` (:func:`auto_or_output`).

    Raises:
        ValueError: xgrammar refuses the tag (e.g. a tool's ``parameters`` is not a schema).
        ImportError: xgrammar is not installed.
    """
    if tool_choice == "auto" and own is not None:
        tag = auto_or_output(fmt, tools, parallel_tool_calls, own)
    else:
        tag = structural_tag(fmt, tools, tool_choice, parallel_tool_calls)
    if tag is None:
        return None
    import xgrammar

    try:
        return str(xgrammar.Grammar.from_structural_tag(json.dumps(tag)))
    except (RuntimeError, TypeError, ValueError) as e:
        raise ValueError(f"the tools cannot be forced: {e}") from None
