"""Chat messages → prompt text through the tokenizer's chat template, shared by
``POST /v1/chat/completions`` and ``POST /tokenize`` (vLLM's chat form of it), so both render a
conversation to exactly the same prompt."""

from __future__ import annotations

import json
from typing import Any

from rlserve.server.errors import APIError
from rlserve.server.limits import TOO_LONG_TEXT_PARAM
from rlserve.server.template_pool import TemplateError, apply_chat_template, template_call_kwargs


def chat_message_dicts(messages: list) -> list[dict]:
    """:class:`~rlserve.server.protocol.ChatMessage` objects as the plain dicts a chat template
    reads: list contents may only hold text parts (joined without a separator, as vLLM does for
    text-only content; a ``tool`` message's by newlines); extra keys of a message are kept;
    an assistant's ``tool_calls`` / ``reasoning`` as vLLM passes them (:func:`_assistant_fields`).

    Raises:
        APIError 400: a non-text content part (``param`` ``messages.<i>.content``).
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
            content = ("\n" if m.role == "tool" else "").join(texts)  # vLLM joins a tool result's parts by lines
        msg = dict(m.model_extra or {})
        msg.update(role=m.role, content=content if content is not None else "")
        if m.name is not None:
            msg["name"] = m.name
        if m.role == "assistant":
            _assistant_fields(msg, i)
        rendered.append(msg)
    return rendered


def _assistant_fields(msg: dict, i: int) -> None:
    """An assistant message as vLLM 0.32 hands it to the template: each tool call's
    ``arguments`` a dict (a JSON string parsed; one that is not a JSON object becomes ``{}``,
    so a bad turn in the history cannot fail every later request), empty ``tool_calls``
    dropped, ``reasoning`` also given as ``reasoning_content``.

    Raises:
        APIError 400: a tool call that is not an object of type ``function`` with a
            ``function`` object (``param`` ``messages.<i>.tool_calls``).
    """
    if msg.get("reasoning") is not None:
        msg["reasoning_content"] = msg["reasoning"]
    calls = msg.get("tool_calls")
    if not isinstance(calls, list):
        return
    if not calls:
        del msg["tool_calls"]
        return
    msg["tool_calls"] = calls = [dict(c) if isinstance(c, dict) else c for c in calls]
    for c in calls:
        if not isinstance(c, dict) or c.get("type", "function") != "function" or not isinstance(c.get("function"), dict):
            raise APIError(400, "chat completions only support assistant tool_calls of type 'function'.",
                           param=f"messages.{i}.tool_calls")
        fn = c["function"] = dict(c["function"])
        args = fn.get("arguments")
        if isinstance(args, str) and args:
            try:
                args = json.loads(args)
            except ValueError:
                args = None
        fn["arguments"] = args if isinstance(args, dict) else {}


def template_error(e: TemplateError, chat_template: str | None, param: str = "messages") -> APIError:
    """The 400 for a failed render: ``param`` names ``chat_template`` when the request sent one
    (else ``param``, the conversation's field); a rendered prompt over the context's character
    bound is ``context_length_exceeded`` (param ``input_text``, as vLLM names a text over it:
    :data:`rlserve.server.limits.TOO_LONG_TEXT_PARAM`), a render over its time bound ``chat_template_timeout``."""
    where = "chat_template" if chat_template is not None else param
    if e.kind == "too_long":
        return APIError(400, str(e), param=TOO_LONG_TEXT_PARAM, code="context_length_exceeded")
    if e.kind == "timeout":
        return APIError(400, f"{e} (a server bound: the template must render in less)", param=where,
                        code="chat_template_timeout")
    if e.kind == "died":
        return APIError(400, str(e), param=where, code="chat_template_failed")
    return APIError(400, f"could not apply the chat template: {e}", param=where)


def render_chat(tokenizer, messages: list, *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template: str | None = None,
                chat_template_kwargs: dict[str, Any] | None = None, tools: list | None = None) -> str:
    """The prompt text of a conversation, rendered in this thread (the server renders in its
    template workers instead: :mod:`rlserve.server.template_pool`, which bounds time and size).

    Args:
        tokenizer: a Hugging Face tokenizer with ``apply_chat_template``.
        messages: :class:`~rlserve.server.protocol.ChatMessage` objects (:func:`chat_message_dicts`).
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
    kwargs = template_call_kwargs(add_generation_prompt, continue_final_message, chat_template,
                                  chat_template_kwargs, tools)
    try:
        return apply_chat_template(tokenizer, chat_message_dicts(messages), kwargs)
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - template errors are the request's fault
        raise template_error(TemplateError("error", f"{type(e).__name__}: {e}"), chat_template) from None
