"""Chat messages → prompt text through the tokenizer's chat template, shared by
``POST /v1/chat/completions`` and ``POST /tokenize`` (vLLM's chat form of it), so both render a
conversation to exactly the same prompt."""

from __future__ import annotations

from typing import Any

from rlserve.server.errors import APIError


def render_chat(tokenizer, messages: list, *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template: str | None = None,
                chat_template_kwargs: dict[str, Any] | None = None, tools: list | None = None) -> str:
    """The prompt text of a conversation.

    Args:
        tokenizer: a Hugging Face tokenizer with ``apply_chat_template``.
        messages: :class:`~rlserve.server.protocol.ChatMessage` objects; list contents may only
            hold text parts (joined without a separator, as vLLM does for text-only content).
        add_generation_prompt: end with the assistant turn's opening (ignored, as in vLLM, when
            ``continue_final_message`` is set).
        continue_final_message: leave the last message open for the model to continue.
        chat_template / chat_template_kwargs / tools: passed to the template.

    Returns:
        the rendered prompt (not tokenized).

    Raises:
        APIError 400: a non-text content part (``param`` ``messages.<i>.content``), or the
            template fails on this conversation (``param`` ``messages`` or ``chat_template``).
    """
    rendered = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"messages[{i}].content: only text parts are supported, got {part.type!r}",
                                   param=f"messages.{i}.content")
                texts.append(part.text)
            content = "".join(texts)
        msg = dict(m.model_extra or {})
        msg.update(role=m.role, content=content if content is not None else "")
        if m.name is not None:
            msg["name"] = m.name
        rendered.append(msg)
    kwargs = dict(chat_template_kwargs or {})
    if continue_final_message:
        kwargs["continue_final_message"] = True
    if tools:
        kwargs["tools"] = tools
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    try:
        return tokenizer.apply_chat_template(
            rendered, tokenize=False, add_generation_prompt=add_generation_prompt and not continue_final_message,
            **kwargs)
    except Exception as e:  # noqa: BLE001 - template errors are the request's fault
        raise APIError(400, f"could not apply the chat template: {type(e).__name__}: {e}",
                       param="chat_template" if chat_template is not None else "messages") from None
