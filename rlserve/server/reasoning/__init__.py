"""Reasoning parsers by ``--reasoning-parser`` name (vLLM 0.32's names; the reference is
``vllm/reasoning/``): :data:`REASONING_PARSERS`. Each class takes ``(vocab,
chat_template_kwargs)`` and is used once per request choice."""

from __future__ import annotations

from rlserve.server.tool_parsers.base import registry_class
from rlserve.server.reasoning.think import Qwen3ReasoningParser, ThinkReasoningParser

REASONING_PARSERS: dict[str, type] = {
    "deepseek_r1": ThinkReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def reasoning_parser_class(name: str) -> type:
    """The parser class of ``--reasoning-parser NAME`` (ValueError: an unknown name)."""
    return registry_class(REASONING_PARSERS, "reasoning-parser", name)
