"""Tool-call parsers by ``--tool-call-parser`` name (vLLM 0.32's names; the reference is
``vllm/tool_parsers/``): :data:`TOOL_PARSERS`. Each parser class takes ``(vocab, tools)`` and is
used once per request choice (:class:`rlserve.server.tool_parsers.base.ToolParser`)."""

from __future__ import annotations

from rlserve.server.tool_parsers.base import registry_class
from rlserve.server.tool_parsers.hermes import HermesToolParser
from rlserve.server.tool_parsers.llama3_json import Llama3JsonToolParser
from rlserve.server.tool_parsers.mistral import MistralToolParser
from rlserve.server.tool_parsers.qwen3_xml import Qwen3XmlToolParser

TOOL_PARSERS: dict[str, type] = {
    "hermes": HermesToolParser,
    "qwen3_json": HermesToolParser,  # vLLM aliases Qwen's JSON tool calls to hermes
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,  # vLLM's alias
    "qwen3_xml": Qwen3XmlToolParser,
    "qwen3_coder": Qwen3XmlToolParser,  # vLLM's alias
    "mistral": MistralToolParser,  # the pre-v11 [TOOL_CALLS][{...}] format of a Hugging Face tokenizer
}


def tool_parser_class(name: str) -> type:
    """The parser class of ``--tool-call-parser NAME`` (ValueError: an unknown name)."""
    return registry_class(TOOL_PARSERS, "tool-call-parser", name)
