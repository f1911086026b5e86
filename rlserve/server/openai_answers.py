"""The JSON objects of ``/v1/completions`` and ``/v1/chat/completions`` answers, with the keys
vLLM 0.32 sends, nulls included (a client reading the raw JSON finds every key it would find in
vLLM's answer), plus rlserve's ``weight_version`` (every choice and answer) and
``weight_versions`` (answers).

Where the key sets come from: vLLM 0.32's pydantic models
(``vllm/entrypoints/openai/{chat_completion,completion}/protocol.py``,
``vllm/entrypoints/serve/engine/protocol.py``'s ``UsageInfo``) dumped as its serving code dumps
them -- a non-streamed answer whole (``model_dump()``), so every field is there, null when vLLM
has nothing for it (``service_tier``, ``kv_transfer_params``, ``metrics``, a message's
``refusal`` / ``annotations`` / ``audio`` / ``function_call`` / ``reasoning`` ...); a stream chunk
with ``exclude_unset`` (only what the serving code set); the stream's last usage chunk with
``exclude_none``. ``tests/test_server_vllm_keys.py`` checks them against the installed vLLM. (A choice's ``routed_experts``
and the answer's ``metrics`` are null without ``--enable-return-routed-experts`` / per-request metrics:
vLLM 0.32's live ``vllm serve`` sends both keys null too, compared in session 21.)
The chunks themselves are built in :mod:`rlserve.server.openai_stream`.
"""

from __future__ import annotations


def usage_json(prompt_tokens: int, completion_tokens: int) -> dict:
    """``usage`` as a stream's last chunk carries it (vLLM's ``UsageInfo`` without its null
    ``*_details``): token counts."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens}


def answer_usage(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None) -> dict:
    """``usage`` of a non-streamed answer: the counts plus vLLM's ``prompt_tokens_details`` (null)
    and ``completion_tokens_details`` (``{"reasoning_tokens": n}`` with a reasoning parser, as
    vLLM; else null)."""
    return dict(usage_json(prompt_tokens, completion_tokens), prompt_tokens_details=None,
                completion_tokens_details=None if reasoning_tokens is None else {"reasoning_tokens": reasoning_tokens})


def chat_message(content: str | None, reasoning: str | None = None, tool_calls: list[dict] | None = None) -> dict:
    """A chat choice's ``message`` (vLLM's ``ChatMessage``, ``tool_calls`` dropped when empty as
    its serializer does): the assistant's text, its ``tool_calls`` (``[{"id", "type",
    "function": {"name", "arguments"}}]``) and ``reasoning`` (vLLM 0.32's key; it sends no
    ``reasoning_content``) from :mod:`rlserve.server.chat_output`, the fields rlserve never
    fills null."""
    msg = {"role": "assistant", "content": content, "refusal": None, "annotations": None, "audio": None,
           "function_call": None}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    msg["reasoning"] = reasoning
    return msg


def chat_choice(index: int, content: str | dict, logprobs: dict | None, finish_reason, stop_reason,
                token_ids: list[int] | None, weight_version: str | None, routed_experts: str | None = None) -> dict:
    """One choice of a non-streamed chat answer (vLLM's ``ChatCompletionResponseChoice``;
    ``content``: the text, or :func:`chat_message`'s keyword arguments when a parser split it;
    ``routed_experts``: base64 ``.npy`` with replay on, else null) plus rlserve's ``weight_version``."""
    message = chat_message(**content) if isinstance(content, dict) else chat_message(content)
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason, "token_ids": token_ids, "routed_experts": routed_experts,
            "weight_version": weight_version}


def completion_choice(index: int, text: str, logprobs: dict | None, finish_reason, stop_reason,
                      token_ids: list[int] | None, prompt_logprobs: list | None, prompt_token_ids: list[int] | None,
                      weight_version: str | None, routed_experts: str | None = None) -> dict:
    """One choice of a non-streamed completions answer (vLLM's ``CompletionResponseChoice``;
    ``routed_experts``: base64 ``.npy`` with replay on, else null) plus rlserve's ``weight_version``."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason, "token_ids": token_ids, "prompt_logprobs": prompt_logprobs,
            "prompt_token_ids": prompt_token_ids, "routed_experts": routed_experts, "weight_version": weight_version}


def _answer(rid: str, obj: str, created: int, model: str, choices: list[dict], fingerprint: str | None,
            usage: dict) -> dict:
    """The keys both answers open with, in vLLM's order (``service_tier`` null)."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices, "service_tier": None,
            "system_fingerprint": fingerprint, "usage": usage}


def chat_response(rid: str, created: int, model: str, choices: list[dict], usage: dict, fingerprint: str | None,
                  prompt_token_ids: list[int] | None, weight_version: str | None, weight_versions: list[str],
                  prompt_logprobs: list | None = None) -> dict:
    """A non-streamed chat answer (vLLM's ``ChatCompletionResponse``: ``prompt_text``,
    ``kv_transfer_params``, ``ec_transfer_params``, ``metrics`` null; ``prompt_logprobs`` null
    unless given: vLLM's ``echo`` with ``top_logprobs``) plus rlserve's ``weight_version`` /
    ``weight_versions``."""
    return dict(_answer(rid, "chat.completion", created, model, choices, fingerprint, usage),
                prompt_logprobs=prompt_logprobs,
                prompt_token_ids=prompt_token_ids, prompt_text=None, kv_transfer_params=None, ec_transfer_params=None,
                metrics=None, weight_version=weight_version, weight_versions=weight_versions)


def completion_response(rid: str, created: int, model: str, choices: list[dict], usage: dict,
                        fingerprint: str | None, weight_version: str | None, weight_versions: list[str]) -> dict:
    """A non-streamed completions answer (vLLM's ``CompletionResponse``: ``kv_transfer_params``,
    ``ec_transfer_params``, ``metrics`` null) plus rlserve's ``weight_version`` /
    ``weight_versions``."""
    return dict(_answer(rid, "text_completion", created, model, choices, fingerprint, usage), kv_transfer_params=None,
                ec_transfer_params=None, metrics=None, weight_version=weight_version, weight_versions=weight_versions)


def chat_answer_role(body) -> str:
    """The role of a chat answer's message, as vLLM's ``get_chat_request_role``: ``assistant``,
    or with ``add_generation_prompt: false`` the last message's own role (the answer continues
    that message)."""
    if body.add_generation_prompt or not body.messages:
        return "assistant"
    return body.messages[-1].role


def chat_echo(body) -> str:
    """vLLM's chat ``echo``: the last message's content (text parts joined by newlines) when its
    role is the answer's (:func:`chat_answer_role`: with ``add_generation_prompt: false`` always),
    else ``""``; ``""`` without ``echo``."""
    if not body.echo or not body.messages:
        return ""
    last = body.messages[-1]
    if last.role != chat_answer_role(body) or not last.content:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(part.text or "" for part in last.content)


def weight_versions(outs) -> tuple[str | None, list[str]]:
    """``(weight_version, weight_versions)`` of engine outputs: the last version seen and every
    version in order of first appearance (more than one when a request spanned a weight update)."""
    versions: list[str] = []
    for o in outs:
        for v in getattr(o, "weight_versions", None) or [getattr(o, "weight_version", None)]:
            if v is not None and v not in versions:
                versions.append(v)
    return (versions[-1] if versions else None), versions
