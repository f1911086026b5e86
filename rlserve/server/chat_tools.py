"""A chat request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` checked and turned
into what generation needs, as vLLM 0.32 does (``ChatCompletionRequest.check_tool_usage``,
``OnlineRenderer``'s tool-choice refusals, ``ToolParser.adjust_request``): the effective
``tool_choice`` and the constraint that forces ``required`` / named calls. The answer side is
:mod:`rlserve.server.chat_output`."""

from __future__ import annotations

from rlserve.server.chat_output import ChatOutputConfig
from rlserve.server.errors import APIError
from rlserve.server.tool_parsers.structural import structural_grammar

_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def _check_tool_list(tools) -> None:
    if tools == []:
        raise APIError(400, "`tools` must not be an empty array. Either provide at least one tool or omit the field "
                            "entirely.", param="tools")
    for i, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"] \
                or not isinstance(fn.get("parameters", {}) or {}, dict):
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": str, "
                                "\"parameters\": object, ...}}", param=f"tools.{i}")


def check_tools(body, outputs: ChatOutputConfig) -> str | dict | None:
    """The request's effective ``tool_choice`` (``"auto"`` when ``tools`` come without one, as
    in vLLM).

    Raises:
        APIError 400 (vLLM's messages): ``tools: []``, a malformed tool, a ``tool_choice``
            without ``tools``, a named choice that is malformed or names no tool, or a choice
            the server's flags cannot serve (``auto`` without ``--enable-auto-tool-choice``
            and a parser; ``required`` / named without ``--tool-call-parser``).
    """
    tools, choice = body.tools, body.tool_choice
    _check_tool_list(tools)
    if choice is None and tools:
        choice = "auto"
    if choice is None or choice == "none":
        return choice
    if not tools:
        raise APIError(400, "When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if isinstance(choice, dict):
        fn = choice.get("function")
        if not isinstance(fn, dict):
            raise APIError(400, f"Invalid value for `function`: `{fn}` in `tool_choice`! {_USAGE}",
                           param="tool_choice.function")
        if "name" not in fn:
            raise APIError(400, f"Expected field `name` in `function` in `tool_choice`! {_USAGE}",
                           param="tool_choice.function.name")
        if not isinstance(fn["name"], str) or not fn["name"]:
            raise APIError(400, f"Invalid `name` in `function`: `{fn['name']}` in `tool_choice`! {_USAGE}",
                           param="tool_choice.function.name")
        if not any(t["function"]["name"] == fn["name"] for t in tools):
            raise APIError(400, "The tool specified in `tool_choice` does not match any of the specified `tools`",
                           param="tool_choice")
    refusal = outputs.check_tool_choice(choice)
    if refusal is not None:
        raise APIError(400, refusal, param="tool_choice")
    return choice


def forced_spec(body, outputs: ChatOutputConfig, tool_choice, own=None) -> dict | None:
    """The ``structured_outputs`` object forcing ``required`` / a named call, or an ``auto``
    call's format where vLLM constrains it (None: nothing to force): the parser's call format as
    a grammar (its structural tag, :func:`~rlserve.server.tool_parsers.structural.structural_tag`).
    A forced call replaces the request's own constraint ``own`` (its ``structured_outputs`` /
    ``response_format``), as in vLLM; under ``auto`` with ``own``, the output is calls or what
    ``own`` asks for where a tool is strict, else ``own`` alone (None here), as vLLM's
    ``_apply_structural_tag`` (:func:`~rlserve.server.tool_parsers.structural.auto_or_output`).

    Raises:
        APIError 400: the tools cannot be forced (e.g. a ``parameters`` that is no schema).
    """
    cls = outputs.tool_cls
    if cls is None or tool_choice in (None, "none"):
        return None
    if cls.structural_tag is None:  # mistral: a JSON schema forces required / named, unless the request has its
        # own structured_outputs (vLLM keeps it then) or a response_format it replaces
        schema = cls.forced_schema(body.tools, tool_choice)
        return None if schema is None or body.structured_outputs is not None else {"json": schema}
    try:
        grammar = structural_grammar(cls.structural_tag, body.tools, tool_choice, body.parallel_tool_calls, own)
        return None if grammar is None else {"grammar": grammar}
    except ImportError:
        from rlserve.engine.core.structured import needs_xgrammar

        raise APIError(400, needs_xgrammar('tool_choice "required" / named'), param="tool_choice") from None
    except ValueError as e:
        raise APIError(400, str(e), param="tools") from None
