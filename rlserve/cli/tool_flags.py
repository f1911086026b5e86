"""``vllm serve``'s tool-calling and reasoning flags: ``--enable-auto-tool-choice``,
``--tool-call-parser NAME``, ``--reasoning-parser NAME`` (vLLM 0.32's names and rules; the
parsers: :mod:`rlserve.server.tool_parsers`, :mod:`rlserve.server.reasoning`)."""

from __future__ import annotations

import argparse

from rlserve.server.reasoning import REASONING_PARSERS
from rlserve.server.tool_parsers import TOOL_PARSERS


def add_tool_args(p: argparse.ArgumentParser) -> None:
    """The three flags, in their own help group."""
    g = p.add_argument_group("tool calling and reasoning", "vLLM's flags: tool calls and reasoning in chat answers")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="parse tool calls out of chat answers with tool_choice auto (needs --tool-call-parser)")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS), metavar="NAME",
                   help=f"the model's tool-call format: {', '.join(sorted(TOOL_PARSERS))}; also needed for "
                        "tool_choice required / named (forced through structured outputs)")
    g.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS), metavar="NAME",
                   help=f"split the reasoning out of chat answers into 'reasoning': {', '.join(sorted(REASONING_PARSERS))}")


def check_tool_args(args) -> str | None:
    """vLLM's rule: ``--enable-auto-tool-choice`` needs ``--tool-call-parser`` (the message), else None."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        return "--enable-auto-tool-choice requires --tool-call-parser"
    return None


def check_parsers_fit_tokenizer(args, tokenizer_path: str):
    """Before any engine starts: the parsers named by ``--tool-call-parser`` / ``--reasoning-parser``
    must find their marker tokens in the model's vocabulary (the same check the server makes when
    it builds its :class:`~rlserve.server.chat_output.ChatOutputConfig`, made here so that a wrong
    pairing is one error line and exit 2, not a traceback after the model loaded).

    Returns:
        the tokenizer it loaded (``AutoTokenizer.from_pretrained(tokenizer_path)``), for the server
        to use instead of loading it again (``AsyncEngine(tokenizer=...)``: ~0.5 s at start-up);
        None when no parser flag is set or it could not be loaded here.
    Raises:
        ValueError: ``--reasoning-parser NAME: ...`` / ``--tool-call-parser NAME: ...`` (the vocabulary
            lacks the parser's tokens, or its library is not installed).
    """
    if not (args.tool_call_parser or args.reasoning_parser):
        return None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    except Exception:  # noqa: BLE001 - a tokenizer only the engine can load (e.g. GGUF): checked at startup there
        return None
    from rlserve.server.chat_output import ChatOutputConfig

    ChatOutputConfig(args.tool_call_parser, args.reasoning_parser, args.enable_auto_tool_choice, tokenizer)
    return tokenizer


def tool_settings(args) -> dict:
    """The :class:`~rlserve.server.state.ServerSettings` fields of these flags."""
    return {"tool_call_parser": args.tool_call_parser, "reasoning_parser": args.reasoning_parser,
            "enable_auto_tool_choice": args.enable_auto_tool_choice,
            "structured_in_reasoning": bool((args.structured_outputs_config or {}).get("enable_in_reasoning"))}
