"""A tiny Qwen3-style tool-calling checkpoint, offline: the tiny tokenizer of
:mod:`tests.tiny_models` plus Qwen3's added (non-special) tokens ``<think>``, ``</think>``,
``<tool_call>``, ``</tool_call>`` (ids 336..339), Llama 3's ``<|python_tag|>`` (340) and a chat template that renders ``tools``,
an assistant message's ``tool_calls`` / ``reasoning_content`` and ``tool`` messages the way
Qwen3's own template does (tools in ``<tools></tools>`` in the system turn (Qwen's instructions around them left out), each call as
``<tool_call>\\n{"name": .., "arguments": ..}\\n</tool_call>``, tool results wrapped in
``<tool_response>`` inside a user turn).

Usage: ``make_tool_model(path)`` (a random-init qwen3 of vocabulary 341 with that tokenizer)
or ``make_tool_tokenizer(path)`` (the tokenizer files only)."""

from __future__ import annotations

from pathlib import Path

from tests.tiny_models import build_tokenizer, make_tiny_model

ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<|python_tag|>"]
THINK_ID, THINK_END_ID, TOOL_CALL_ID, TOOL_CALL_END_ID, PYTHON_TAG_ID = 336, 337, 338, 339, 340

QWEN3_STYLE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{%- endif %}"
    "# Tools\n\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}"
    "\n</tools><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant\n"
    "{%- if message.reasoning_content %}<think>\n{{ message.reasoning_content }}\n</think>\n\n{%- endif %}"
    "{{ message.content or '' }}"
    "{%- if message.tool_calls %}{%- for tc in message.tool_calls %}"
    "{%- if (loop.first and message.content) or not loop.first %}\n{%- endif %}"
    "{%- set f = tc.function if tc.function else tc %}"
    "<tool_call>\n{\"name\": \"{{ f.name }}\", \"arguments\": "
    "{%- if f.arguments is string %}{{ f.arguments }}{%- else %}{{ f.arguments | tojson }}{%- endif %}"
    "}\n</tool_call>{%- endfor %}{%- endif %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{%- endif %}"
    "\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- endif %}"
)


def tool_tokenizer():
    """The tiny tokenizer (a copy) with Qwen3's four added tokens and :data:`QWEN3_STYLE_TEMPLATE`."""
    import copy

    tok = copy.deepcopy(build_tokenizer())
    tok.add_tokens(ADDED, special_tokens=False)
    assert tok.convert_tokens_to_ids(ADDED) == [THINK_ID, THINK_END_ID, TOOL_CALL_ID, TOOL_CALL_END_ID, PYTHON_TAG_ID]
    tok.chat_template = QWEN3_STYLE_TEMPLATE
    return tok


def make_tool_tokenizer(path) -> str:
    """Write :func:`tool_tokenizer` to ``path``; returns ``str(path)``."""
    Path(path).mkdir(parents=True, exist_ok=True)
    tool_tokenizer().save_pretrained(path)
    return str(path)


def make_tool_model(path) -> str:
    """A random-init tiny qwen3 (vocabulary 341, 1024 positions: the tiny byte-level tokenizer
    makes a prompt with tools several hundred tokens long; head_dim 32: vLLM's CPU attention
    has no kernel for the tiny models' 16) with :func:`tool_tokenizer`; returns ``str(path)``."""
    make_tiny_model("qwen3", path, vocab_size=len(ADDED) + 336, max_position_embeddings=1024, head_dim=32)
    make_tool_tokenizer(path)
    return str(path)


MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"
MISTRAL_TOOL_CALLS_ID = 336


def mistral_tool_tokenizer():
    """The tiny tokenizer (a copy) with Mistral's ``[TOOL_CALLS]`` as an added special token
    (id 336) and no ``[ARGS]``: what vLLM's ``mistral`` tool parser takes for a pre-v11 Hugging
    Face tokenizer (calls as ``[TOOL_CALLS][{"name": .., "arguments": {..}}, ...]``)."""
    import copy

    tok = copy.deepcopy(build_tokenizer())
    tok.add_tokens([MISTRAL_TOOL_CALLS], special_tokens=True)
    assert tok.convert_tokens_to_ids(MISTRAL_TOOL_CALLS) == MISTRAL_TOOL_CALLS_ID
    return tok


def make_mistral_tool_tokenizer(path) -> str:
    """Write :func:`mistral_tool_tokenizer` to ``path``; returns ``str(path)``."""
    Path(path).mkdir(parents=True, exist_ok=True)
    mistral_tool_tokenizer().save_pretrained(path)
    return str(path)
