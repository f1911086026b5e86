"""OpenAI's Responses API, ``POST /v1/responses``, for text generation, as ``vllm serve`` serves it
(``openai.OpenAI(...).responses.create``, ``vllm bench serve --backend openai-responses``).

The conversation (``instructions`` as a system message, then ``input``: a string = one user
message, or message items of role ``user`` / ``system`` / ``developer`` / ``assistant`` with a
string or ``input_text`` / ``output_text`` parts) is rendered by the chat template exactly as
``/v1/chat/completions`` renders the same messages (:func:`rlserve.server.chat_render.render_chat`,
on the tokenizer thread), so greedy output is the same. As in vLLM, a last ``assistant`` item with
``status`` ``in_progress`` / ``incomplete`` is continued (``continue_final_message``).

Answer: vLLM's ``ResponsesResponse`` with exactly the keys vLLM 0.32 sends (its
``model_dump(mode="json")``: the nulls ``prompt``, ``input_messages``, ``output_messages``,
``kv_transfer_params``, ``ec_transfer_params``, ``top_logprobs``; ``text`` the request's ``text``
config or null; no ``metrics``, ``error`` or ``store``, which vLLM does not send):
``object: "response"``, one ``message`` output item (``phase`` null) with one ``output_text``
part (``logprobs`` null; no part for an empty output, as vLLM), ``status`` ``completed``, or ``incomplete`` with
``incomplete_details.reason = "max_output_tokens"`` when ``max_output_tokens`` cut it, or
``cancelled`` when it was aborted (``/abort_requests`` with the response's ``id``, a pause in
mode ``abort``); ``usage``
``{input_tokens, output_tokens, total_tokens, input_tokens_details: {cached_tokens: 0,
cache_write_tokens: 0, input_tokens_per_turn: [], cached_tokens_per_turn: []},
output_tokens_details: {reasoning_tokens: 0, tool_output_tokens: 0, output_tokens_per_turn: [],
tool_output_tokens_per_turn: []}}`` (token counts of the rendered prompt and the output; rlserve
does not count prefix-cache hits per request, hence 0; the per-turn lists are empty as vLLM's for
a single-turn answer);
plus rlserve's ``weight_version`` / ``weight_versions`` as on its other answers.

``stream: true``: server-sent events, each ``event: <type>`` + ``data: {...}`` with a
``sequence_number`` from 0, in OpenAI's order: ``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added`` (with the engine's first output),
``response.output_text.delta`` (one per engine step that added text), ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``, ``response.completed`` (also for an
``incomplete`` response, as vLLM does: the ``openai`` client's ``responses.stream`` helper needs
it). Each event has the keys vLLM's ``model_dump_json`` of it has (``tests/vllm_answer_keys.py``);
the ``content_part.done`` part's ``logprobs`` is null, the other events' ``logprobs`` ``[]``, as
vLLM's. A failure after the stream started is an ``error`` event (``{type, code, message, param}``).

Not supported (a 400 naming the field: :func:`refuse_unsupported`, :func:`input_messages`): tools
and tool calls, stored responses (``store: true``, ``previous_response_id``, ``conversation``,
``prompt``), ``background``, ``reasoning``, logprobs (``top_logprobs``, ``include``),
``truncation: "auto"``, non-text inputs (images, files, audio) and non-message items. ``text.format``
``json_schema`` / ``json_object`` constrain the output through the structured-outputs path.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rlserve.server.errors import APIError, exception_to_error
from rlserve.server.openai_answers import weight_versions
from rlserve.server.openai_routes import ClientDisconnected, collect_final, unless_disconnected
from rlserve.server.openai_stream import merge_generators, sse_event
from rlserve.server.protocol import ChatMessage, ResponsesRequest
from rlserve.server.request_body import FastJSONRoute
from rlserve.server.request_fields import check_extra_fields
from rlserve.server.state import ServerState

#: the roles of an input message item
ROLES = ("user", "system", "developer", "assistant")
#: the keys a message item may carry besides ``role`` / ``content`` (``id``, ``status``, ``phase``:
#: what the ``openai`` client sends back when a previous response's output is passed as input)
_ITEM_KEYS = frozenset({"type", "role", "content", "id", "status", "phase"})

#: field -> (is the value a no-op?, why anything else is refused)
_REFUSED = {
    "store": (lambda v: not v, "rlserve keeps no responses: send store false (or leave it out)"),
    "background": (lambda v: not v, "background mode is not supported"),
    "previous_response_id": (lambda v: v is None, "rlserve keeps no responses to continue from: send the whole "
                                                  "conversation in input"),
    "conversation": (lambda v: v is None, "rlserve keeps no conversations: send the whole conversation in input"),
    "prompt": (lambda v: v is None, "stored prompt templates are not supported: send instructions and input"),
    "tools": (lambda v: not v, "tools are not supported: rlserve parses no tool calls out of the output"),
    "tool_choice": (lambda v: v in (None, "none", "auto"), "tool_choice is not supported: rlserve has no tools"),
    "max_tool_calls": (lambda v: v is None, "max_tool_calls is not supported: rlserve has no tools"),
    "reasoning": (lambda v: not v, "reasoning is not supported: rlserve has no reasoning parser"),
    "include": (lambda v: not v, "include is not supported (no logprobs, reasoning or tool outputs to include)"),
    "top_logprobs": (lambda v: not v, "top_logprobs is not supported on /v1/responses: use /v1/chat/completions "
                                      "with logprobs"),
    "truncation": (lambda v: v in (None, "disabled"), "truncation 'auto' is not supported: a prompt longer than "
                                                      "the context is a 400"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "service tiers are not supported"),
}


def refuse_unsupported(body: ResponsesRequest) -> None:
    """Raises APIError 400 (``code`` ``unsupported_field``, ``param`` the field) for an OpenAI
    feature rlserve does not have, asked for (see :data:`_REFUSED`); its no-op value passes."""
    for name, (noop, why) in _REFUSED.items():
        value = getattr(body, name)
        if not noop(value):
            raise APIError(400, f"{name}={repr(value)[:80]}: {why}", param=name, code="unsupported_field")


def _item_text(content: Any, where: str) -> str:
    """A message item's ``content`` (a string or a list of ``input_text`` / ``output_text`` parts,
    joined without a separator as chat completions joins text parts) as text. Raises APIError
    400 naming ``<where>.content[.<j>]`` for anything else."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of input_text parts", param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}.content.{j}: only input_text / output_text parts with a string text are "
                                f"supported (rlserve serves text), got type {kind!r}", param=f"{where}.content.{j}")
        texts.append(part["text"])
    return "".join(texts)


def input_messages(body: ResponsesRequest) -> tuple[list[ChatMessage], bool]:
    """``instructions`` + ``input`` → ``(chat messages, continue_final_message)``, vLLM's
    construction: ``instructions`` first as a ``system`` message, a string ``input`` as one
    ``user`` message; continue when the last item is an ``assistant`` message whose ``status`` is
    ``in_progress`` or ``incomplete``.

    Raises:
        APIError 400: empty ``input``; an item that is not a message (``param``
            ``input.<i>.type``), an unknown role (``input.<i>.role``), an unknown key
            (``input.<i>.<key>``), a non-text content part (``input.<i>.content.<j>``).
    """
    messages = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    if isinstance(body.input, str):
        if not body.input:
            raise APIError(400, "input must not be empty", param="input")
        return messages + [ChatMessage(role="user", content=body.input)], False
    if not body.input:
        raise APIError(400, "input must not be empty", param="input")
    for i, item in enumerate(body.input):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind != "message":
            raise APIError(400, f"{where}: items of type {kind!r} are not supported: rlserve serves text messages "
                                "only (no tool calls or outputs, reasoning items, item references)",
                           param=f"{where}.type", code="unsupported_field")
        extra = sorted(set(item) - _ITEM_KEYS)
        if extra:
            raise APIError(400, f"{where}: unknown key {extra[0]!r} in a message item", param=f"{where}.{extra[0]}",
                           code="unknown_field")
        role = item.get("role")
        if role not in ROLES:
            raise APIError(400, f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}", param=f"{where}.role")
        messages.append(ChatMessage(role=role, content=_item_text(item.get("content"), where)))
    last = body.input[-1]
    return messages, last.get("role") == "assistant" and last.get("status") in ("in_progress", "incomplete")


async def _text_format(state: ServerState, body: ResponsesRequest):
    """``text.format`` → the compiled output constraint (None for ``text`` / absent). Raises
    APIError 400 naming ``text.format.schema`` (missing or bad schema)."""
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return await state.compile_structured({"json_object": True}, "text.format")
    if fmt.schema_ is None:
        raise APIError(400, "text.format json_schema needs a schema", param="text.format.schema")
    return await state.compile_structured({"json": fmt.schema_}, "text.format.schema")


def _usage(n_input: int, n_output: int) -> dict:
    """vLLM's ``ResponseUsage`` of a single-turn answer: ``n_input`` prompt tokens, ``n_output``
    generated tokens; no cache, reasoning or tool tokens, empty per-turn lists."""
    return {"input_tokens": n_input,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0, "input_tokens_per_turn": [],
                                     "cached_tokens_per_turn": []},
            "output_tokens": n_output,
            "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0, "output_tokens_per_turn": [],
                                      "tool_output_tokens_per_turn": []},
            "total_tokens": n_input + n_output}


def _text_part(text: str, logprobs: list | None) -> dict:
    """An ``output_text`` part; ``logprobs``: ``[]`` on ``content_part.added``, None (rlserve
    has no Responses logprobs) on the finished part, as vLLM."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _message(item_id: str, status: str, text: str | None) -> dict:
    """The assistant ``message`` output item: no part while ``text`` is None (in progress) or
    empty (vLLM sends ``content: []`` for an empty output), else one ``output_text`` part."""
    content = [_text_part(text, None)] if text else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content,
            "phase": None}


def _text_config(body: ResponsesRequest) -> dict | None:
    """The answer's ``text``: the request's ``text`` as vLLM dumps it (``format`` with a
    json_schema's ``name`` / ``schema`` / ``description`` / ``strict``, nulls included;
    ``verbosity`` null), None when the request has none."""
    if body.text is None:
        return None
    fmt = body.text.format
    if fmt is not None:
        fmt = fmt.model_dump(by_alias=True, exclude_none=fmt.type != "json_schema")
    return {"format": fmt, "verbosity": None}


def _status(out) -> tuple[str, str]:
    """``(response status, output item status)`` of a finished output: ``incomplete`` when it
    stopped at ``max_output_tokens`` (finish reason ``length``), ``cancelled`` (item
    ``incomplete``) when it was aborted (``/abort_requests``, ``/pause?mode=abort``), else
    ``completed``."""
    status = {"length": "incomplete", "abort": "cancelled"}.get(out.outputs[0].finish_reason, "completed")
    return status, "completed" if status == "completed" else "incomplete"


def make_responses_router(state: ServerState, dependencies: list) -> APIRouter:
    """``POST /v1/responses`` behind ``dependencies`` (the API-key check). Errors: 400 (bad or
    unsupported fields, context overflow), 404 (unknown model), 503 (model unavailable), 500."""
    router = APIRouter(dependencies=dependencies, route_class=FastJSONRoute)

    @router.post("/v1/responses")
    async def create_response(body: ResponsesRequest, raw: Request):
        model = state.check_model(body.model)
        state.check_available()
        refuse_unsupported(body)
        check_extra_fields(body, "responses", state.settings.allow_unknown_fields)
        messages, continue_final = input_messages(body)
        structured = await _text_format(state, body)
        template_args = body.chat_template_args()
        if continue_final:
            template_args["continue_final_message"] = True

        ids = await state.tokenize_chat(messages, template_args, "input", add_special_tokens=False)
        max_tokens = state.check_length(len(ids), body.max_output_tokens, param="max_output_tokens")
        params = state.sampling_params(structured_outputs=structured, n=1, max_tokens=max_tokens, logprobs=None,
                                       **body.sampler_args())
        params.lora_int_id = state.lora_int_id(body.model)
        rid = f"resp_{uuid.uuid4().hex}"
        created = int(time.time())
        text_config = _text_config(body)

        def response(status: str, output: list, usage: dict | None, outs: list) -> dict:
            """The ``response`` object (vLLM's ``ResponsesResponse.from_request`` fields and
            nulls) plus rlserve's ``weight_version`` / ``weight_versions``."""
            version, versions = weight_versions(outs)
            return {
                "id": rid, "object": "response", "created_at": created, "status": status,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": body.instructions, "metadata": body.metadata, "model": model, "output": output,
                "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
                "temperature": params.temperature, "top_p": params.top_p, "tool_choice": body.tool_choice or "none",
                "tools": [], "background": False, "max_output_tokens": max_tokens, "max_tool_calls": None,
                "previous_response_id": None, "prompt": None, "reasoning": None,
                "service_tier": body.service_tier or "auto", "text": text_config, "top_logprobs": None,
                "truncation": "disabled", "usage": usage, "user": body.user,
                "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
                "kv_transfer_params": None, "ec_transfer_params": None, "input_messages": None,
                "output_messages": None, "weight_version": version, "weight_versions": versions,
            }

        gen = state.generate(ids, params, rid, "responses", stream=body.stream)
        if body.stream:
            return StreamingResponse(_stream(gen, response, len(ids)), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            (out,) = await unless_disconnected(raw, collect_final([gen]))
        except ClientDisconnected:
            return Response(status_code=499)
        c = out.outputs[0]
        status, item_status = _status(out)
        item = _message(f"msg_{uuid.uuid4().hex}", item_status, c.text)
        return JSONResponse(response(status, [item], _usage(len(ids), len(c.token_ids)), [out]))

    return router


async def _stream(gen, response, n_input: int) -> AsyncIterator[str]:
    """The SSE events of a streamed response (order: the module's docstring). ``response(status,
    output, usage, outs)`` builds the ``response`` object; ``n_input``: prompt tokens."""
    seq = 0

    def event(obj: dict) -> str:
        nonlocal seq
        obj["sequence_number"] = seq
        seq += 1
        return sse_event(obj)

    item_id = f"msg_{uuid.uuid4().hex}"
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    started = response("in_progress", [], None, [])
    yield event({"type": "response.created", "response": started})
    yield event({"type": "response.in_progress", "response": started})
    agen = merge_generators([gen])
    last = None
    text = ""
    try:
        async for _, out in agen:
            if last is None:  # with the engine's first output, as vLLM opens the item with its first delta
                yield event({"type": "response.output_item.added", "output_index": 0,
                             "item": _message(item_id, "in_progress", None)})
                yield event({"type": "response.content_part.added", **where, "part": _text_part("", [])})
            last = out
            delta = out.outputs[0].text[len(text):]
            if delta:
                text = out.outputs[0].text
                yield event({"type": "response.output_text.delta", **where, "delta": delta, "logprobs": []})
        if last is None:
            raise APIError(500, "the engine ended the request without an output", code="engine_error")
        status, item_status = _status(last)
        part = _text_part(text, None)
        item = _message(item_id, item_status, text)
        yield event({"type": "response.output_text.done", **where, "text": text, "logprobs": []})
        yield event({"type": "response.content_part.done", **where, "part": part})
        yield event({"type": "response.output_item.done", "output_index": 0, "item": item})
        usage = _usage(n_input, len(last.outputs[0].token_ids))
        yield event({"type": "response.completed", "response": response(status, [item], usage, [last])})
    except Exception as e:  # noqa: BLE001 - reported in-stream; the status line is already sent
        err = exception_to_error(e)
        yield event({"type": "error", "code": err.code, "message": err.message, "param": err.param})
    finally:
        await agen.aclose()
