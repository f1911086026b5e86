"""OpenAI-compatible routes: ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (JSON or server-sent events).

Extensions beyond OpenAI's schema (vLLM's names where vLLM has them):

* request: ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
  ``stop_token_ids``, ``return_token_ids``, ``return_tokens_as_token_ids``,
  ``skip_special_tokens``, ``include_stop_str_in_output``, ``truncate_prompt_tokens``,
  ``structured_outputs`` (``json`` / ``regex`` / ``choice`` / ``grammar`` / ``json_object``;
  OpenAI's ``response_format`` too), ``add_special_tokens``; completions: ``prompt_logprobs``;
  chat: ``chat_template``, ``chat_template_kwargs``, ``tools`` with ``tool_choice: "none"``
  (rendered into the prompt by the template; no tool-call parsing).
* response: ``weight_version`` (on the response and on every choice: the weights that
  produced the last token), ``weight_versions`` (every version seen while generating: more
  than one when a request spanned an update), ``stop_reason``; with ``return_token_ids``:
  ``token_ids`` per choice and ``prompt_token_ids``; ``prompt_logprobs`` in vLLM's form
  (``[None, {"<id>": {"logprob", "rank", "decoded_token"}}, ...]``). As in vLLM 0.32's
  answers, those keys are there (null) when not asked for, and so is every other key of vLLM's
  answers (:mod:`rlserve.server.openai_answers`; streams: :mod:`rlserve.server.openai_stream`).

Any other field is a 400 naming it (``code`` ``unknown_field``); ``model`` may be omitted (one
model is served).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rlserve.server.errors import APIError
from rlserve.engine.routed_experts import encode_routed_experts
from rlserve.server.openai_answers import answer_usage, chat_choice, chat_response, completion_choice, \
    completion_response
from rlserve.server.openai_stream import merge_generators, stream_chat, stream_completions, usage_options
from rlserve.server.protocol import ChatCompletionRequest, CompletionRequest
from rlserve.server.server_info import system_fingerprint
from rlserve.server.state import ServerState

_DISCONNECT_POLL_S = 1.0  # how often a non-streaming request checks for a gone client


class ClientDisconnected(Exception):
    """The HTTP client went away before its (non-streaming) answer was ready."""


async def collect_final(gens: list) -> list:
    """Run generators to completion; returns each one's last item, in order."""
    finals: list = [None] * len(gens)
    agen = merge_generators(gens)
    try:
        async for i, out in agen:
            finals[i] = out
    finally:
        await agen.aclose()
    return finals


async def unless_disconnected(raw: Request, coro):
    """Await ``coro``; cancel it (aborting its requests) if the client disconnects.

    Raises:
        ClientDisconnected: the client went away.
    """
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await raw.is_disconnected():
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


def weight_versions(outs) -> tuple[str | None, list[str]]:
    """``(weight_version, weight_versions)`` of engine outputs: the last version seen and every
    version in order of first appearance (more than one when a request spanned a weight update)."""
    versions: list[str] = []
    for o in outs:
        for v in getattr(o, "weight_versions", None) or [getattr(o, "weight_version", None)]:
            if v is not None and v not in versions:
                versions.append(v)
    return (versions[-1] if versions else None), versions


def _common_params(state: ServerState, body, max_tokens: int, logprobs, prompt_logprobs=None, structured=None):
    return state.sampling_params(
        structured_outputs=structured, n=body.n, max_tokens=max_tokens, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs, stream_interval=body.stream_interval if body.stream else None,
        routed_experts_prompt_start=body.routed_experts_prompt_start, **body.sampler_args())


def routed_b64(c) -> str | None:
    """A choice's ``routed_experts``: vLLM's base64 ``.npy`` of the sample's array, or None."""
    arr = getattr(c, "routed_experts", None)
    return None if arr is None else encode_routed_experts(arr)


def _reject_unsupported(body) -> None:
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    if body.n is not None and body.n < 1:
        raise APIError(400, f"n must be >= 1, got {body.n}", param="n")


def _check_tools(body) -> None:
    """``tools`` are rendered into the prompt by the chat template; rlserve parses no tool calls
    out of the output, so only ``tool_choice: "none"`` (what TRL sends) is accepted with them."""
    if body.tool_choice is not None and body.tool_choice != "none":
        raise APIError(400, f"tool_choice {body.tool_choice!r} is not supported: rlserve parses no tool calls; "
                            "send tool_choice \"none\" to have the tools rendered into the prompt",
                       param="tool_choice")
    if body.tools and body.tool_choice is None:
        raise APIError(400, "tools need tool_choice \"none\": rlserve renders the tools into the prompt but parses "
                            "no tool calls out of the output", param="tool_choice")


def _normalize_prompts(prompt) -> list:
    """``prompt`` field → list of str | list[int]."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [list(prompt)]
    return list(prompt)


def make_openai_router(state: ServerState, dependencies: list) -> APIRouter:
    """The /v1 routes, behind ``dependencies`` (the API-key check)."""
    router = APIRouter(dependencies=dependencies)

    @router.get("/v1/models")
    async def list_models():
        """vLLM's ``ModelList``: one card per served name, with vLLM's one default
        ``ModelPermission`` (sampling, logprobs and view allowed; ``created`` in unix seconds)."""
        created = int(state.started)

        def permission(created: int) -> list[dict]:
            return [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": created,
                     "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                     "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                     "organization": "*", "group": None, "is_blocking": False}]

        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "rlserve", "root": state.settings.model,
             "parent": None, "max_model_len": state.max_model_len, "permission": permission(created)}
            for name in state.settings.served_model_names
        ] + (state.lora.model_cards(state.model_name, permission) if state.lora is not None else [])}

    # ---- /v1/completions ----------------------------------------------------------------
    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        """OpenAI completions. Errors: 400 (bad fields, context overflow, bad token ids),
        404 (unknown model), 503 (model unavailable), 500 (engine failure)."""
        model = state.check_model(body.model)
        lora_id = state.lora_int_id(body.model)
        state.check_available()
        _reject_unsupported(body)
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of is not supported (it must be absent or equal n)", param="best_of")
        lp_k = state.check_logprobs(body.logprobs, "logprobs")
        plp_k = state.check_logprobs(body.prompt_logprobs, "prompt_logprobs")
        structured = await state.structured_outputs(body)
        prompts = _normalize_prompts(body.prompt)
        state.limits.check_sequences(len(prompts), body.n)
        items = []  # (prompt text, prompt ids, params)
        all_ids = await state.tokenize_many(prompts, ["prompt"] * len(prompts), body.add_special_tokens)
        for p, ids in zip(prompts, all_ids):
            if body.truncate_prompt_tokens is not None:
                ids = state.truncate(ids, body.truncate_prompt_tokens)
            max_tokens = state.check_length(len(ids), body.max_tokens)
            prompt_lps = plp_k
            if body.echo and lp_k is not None:
                prompt_lps = max(prompt_lps or 0, lp_k)
            params = _common_params(state, body, max_tokens, lp_k, prompt_lps, structured)
            params.lora_int_id = lora_id
            text = p if isinstance(p, str) and body.truncate_prompt_tokens is None else None
            items.append((text, ids, params))
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        n = body.n

        def prompt_text(i):
            text = items[i][0]
            return text if text is not None else state.tokenizer.decode(items[i][1])

        as_ids = body.return_tokens_as_token_ids

        def gens(stream: bool):
            return [state.generate(ids, params, f"{rid}-{i}", "completions", stream=stream)
                    for i, (_, ids, params) in enumerate(items)]

        if body.stream:
            return StreamingResponse(
                stream_completions(state, body, items, rid, created, model, n, usage_options(body.stream_options),
                                   prompt_text, gens(True)),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

        try:
            finals = await unless_disconnected(raw, collect_final(gens(False)))
        except ClientDisconnected:
            return Response(status_code=499)
        choices = []
        completion_tokens = 0
        for i, out in enumerate(finals):
            text0, ids, params = items[i]
            for c in sorted(out.outputs, key=lambda c: c.index):
                completion_tokens += len(c.token_ids)
                text = c.text
                lp = None
                if body.echo:
                    ptext = prompt_text(i)
                    text = ptext + text
                    if body.logprobs is not None:
                        plps = out.prompt_logprobs or [None] * len(ids)
                        lp = state.completion_logprobs(list(ids) + list(c.token_ids), list(plps) + list(c.logprobs or []),
                                                       as_ids=as_ids)
                elif body.logprobs is not None:
                    lp = state.completion_logprobs(c.token_ids, c.logprobs, as_ids=as_ids)
                plp = (state.prompt_logprobs_json(ids, out.prompt_logprobs, getattr(out, "prompt_logprob_ranks", None),
                                                  as_ids) if body.prompt_logprobs is not None else None)
                ret = body.return_token_ids
                choices.append(completion_choice(
                    i * n + c.index, text, lp, c.finish_reason, c.stop_reason, list(c.token_ids) if ret else None,
                    plp, list(ids) if ret else None, getattr(out, "weight_version", None), routed_b64(c)))
        version, versions = weight_versions(finals)
        return JSONResponse(completion_response(
            rid, created, model, choices, answer_usage(sum(len(it[1]) for it in items), completion_tokens),
            system_fingerprint(state), version, versions))

    # ---- /v1/chat/completions -----------------------------------------------------------
    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        """OpenAI chat completions through the tokenizer's chat template. Errors as for
        completions, plus 400 for empty messages or a model without a chat template."""
        model = state.check_model(body.model)
        state.check_available()
        _reject_unsupported(body)
        if not body.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        _check_tools(body)
        if body.top_logprobs is not None and body.top_logprobs > 0 and not body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        top_k = state.check_logprobs(body.top_logprobs, "top_logprobs") or 0
        structured = await state.structured_outputs(body)
        ids = await state.tokenize_chat(body.messages, body.chat_template_args(), "messages", body.add_special_tokens)
        if body.truncate_prompt_tokens is not None:
            ids = state.truncate(ids, body.truncate_prompt_tokens)
        max_tokens = state.check_length(
            len(ids), body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
            param="max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens")
        k = top_k if body.logprobs else None
        params = _common_params(state, body, max_tokens, k, structured=structured)
        params.lora_int_id = state.lora_int_id(body.model)
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        gen = state.generate(ids, params, rid, "chat", stream=body.stream)
        if body.stream:
            return StreamingResponse(
                stream_chat(state, body, ids, rid, created, model, usage_options(body.stream_options), gen, top_k),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            (out,) = await unless_disconnected(raw, collect_final([gen]))
        except ClientDisconnected:
            return Response(status_code=499)
        choices = [chat_choice(c.index, c.text,
                               state.chat_logprobs(c.token_ids, c.logprobs, top_k, body.return_tokens_as_token_ids)
                               if body.logprobs else None, c.finish_reason, c.stop_reason,
                               list(c.token_ids) if body.return_token_ids else None,
                               getattr(out, "weight_version", None), routed_b64(c))
                   for c in sorted(out.outputs, key=lambda c: c.index)]
        version, versions = weight_versions([out])
        return JSONResponse(chat_response(
            rid, created, model, choices, answer_usage(len(ids), sum(len(c.token_ids) for c in out.outputs)),
            system_fingerprint(state), list(ids) if body.return_token_ids else None, version, versions))

    return router
