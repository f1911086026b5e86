"""OpenAI-compatible routes: ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (JSON or server-sent events).

Extensions beyond OpenAI's schema (vLLM's names where vLLM has them):

* request: ``logit_bias`` (OpenAI's), ``allowed_token_ids``, ``echo`` (completions: with ``max_tokens: 0`` the prompt
  alone, for prompt-only scoring; chat: vLLM's), ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
  ``stop_token_ids``, ``return_token_ids``, ``return_tokens_as_token_ids``,
  ``skip_special_tokens``, ``include_stop_str_in_output``, ``truncate_prompt_tokens``,
  ``structured_outputs`` (``json`` / ``regex`` / ``choice`` / ``grammar`` / ``json_object``;
  OpenAI's ``response_format`` too), ``add_special_tokens``, ``prompt_logprobs`` (chat: not with stream);
  chat: ``chat_template``, ``chat_template_kwargs``, ``tools`` / ``tool_choice`` /
  ``parallel_tool_calls`` (rendered into the prompt by the template; with
  ``--tool-call-parser`` the calls are parsed out of the answer and ``required`` / named ones
  forced: :mod:`rlserve.server.chat_tools`, :mod:`rlserve.server.chat_output`).
* response: ``weight_version`` (on the response and on every choice: the weights that
  produced the last token), ``weight_versions`` (every version seen while generating: more
  than one when a request spanned an update), ``stop_reason``; with ``return_token_ids``:
  ``token_ids`` per choice and ``prompt_token_ids``; ``prompt_logprobs`` in vLLM's form
  (``[None, {"<id>": {"logprob", "rank", "decoded_token"}}, ...]``). As in vLLM 0.32's
  answers, those keys are there (null) when not asked for, and so is every other key of vLLM's
  answers (:mod:`rlserve.server.openai_answers`; streams: :mod:`rlserve.server.openai_stream`).

Fields that change nothing here (OpenAI's ``metadata``, ``store`` ...) are accepted; any other
field is a 400 naming it (``code`` ``unknown_field``), or ignored and logged with
``--allow-unknown-fields`` (:mod:`rlserve.server.request_fields`); ``model`` may be omitted (one
model is served).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from rlserve.server.chat_output import ChatOutputConfig
from rlserve.server.chat_tools import check_tools, forced_spec
from rlserve.server.direct_write import sink_for
from rlserve.server.errors import APIError
from rlserve.engine.routed_experts import encode_routed_experts
from rlserve.engine.sampling_params import clip_logit_bias
from rlserve.errors import InvalidRequestError
from rlserve.server.openai_answers import answer_usage, chat_answer_role, chat_choice, chat_echo, chat_response, \
    completion_choice, completion_response, weight_versions
from rlserve.server.openai_stream import SSEResponse, merge_generators, stream_chat, stream_completions, usage_options
from rlserve.server.protocol import ChatCompletionRequest, CompletionRequest
from rlserve.server.request_body import FastJSONRoute
from rlserve.server.request_fields import bad_words_token_ids, check_extra_fields
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


def _common_params(state: ServerState, body, n_prompt: int, max_tokens: int, logprobs, prompt_logprobs=None,
                   structured=None):
    """The request's SamplingParams (``n_prompt``: its prompt's token count). Raises APIError 400
    (param ``routed_experts_prompt_start``) for a start beyond the prompt: the engine's own check
    would answer the same 400 without naming the field."""
    _check_routed_start(body, n_prompt)
    return state.sampling_params(
        structured_outputs=structured, n=body.n, max_tokens=max_tokens, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs, stream_interval=body.stream_interval if body.stream else None,
        routed_experts_prompt_start=body.routed_experts_prompt_start, logit_bias=_logit_bias(state, body),
        allowed_token_ids=_allowed_token_ids(state, body),
        bad_words_token_ids=bad_words_token_ids(state.tokenizer, body.bad_words, state.vocab_size) if body.bad_words
        else None, **body.sampler_args())


def _check_routed_start(body, n_prompt: int) -> None:
    """Raises APIError 400 (param ``routed_experts_prompt_start``) for a start beyond the prompt."""
    if body.routed_experts_prompt_start > n_prompt:
        raise APIError(400, f"routed_experts_prompt_start must be between 0 and the prompt length {n_prompt}, got "
                            f"{body.routed_experts_prompt_start}", param="routed_experts_prompt_start")


def _allowed_token_ids(state: ServerState, body) -> list[int] | None:
    """vLLM's ``allowed_token_ids`` (None: any token). Raises APIError 400 (param
    ``allowed_token_ids``): an empty list, an id outside ``[0, vocab_size)`` (vLLM refuses both)."""
    ids = body.allowed_token_ids
    if ids is None:
        return None
    if not ids:
        raise APIError(400, "allowed_token_ids must not be empty", param="allowed_token_ids")
    bad = [t for t in ids if not 0 <= t < state.vocab_size]
    if bad:
        raise APIError(400, f"allowed_token_ids: token ids out of the vocabulary [0, {state.vocab_size}): {bad[:5]}",
                       param="allowed_token_ids", code="invalid_token_id")
    return list(ids)


def _logit_bias(state: ServerState, body) -> dict[int, float] | None:
    """The request's ``logit_bias`` as ``{token id: bias}`` (clipped to [-100, 100] as vLLM), or
    None. Raises APIError 400 (param ``logit_bias``): a key that is not a token id, one outside
    ``[0, vocab_size)``, a value that is not a finite number."""
    if not body.logit_bias:
        return None
    try:
        bias = clip_logit_bias(body.logit_bias)
    except InvalidRequestError as e:
        raise APIError(400, str(e), param="logit_bias") from None
    bad = [t for t in bias if t >= state.vocab_size]
    if bad:
        raise APIError(400, f"logit_bias: token ids out of the vocabulary [0, {state.vocab_size}): {bad[:5]}",
                       param="logit_bias", code="invalid_token_id")
    return bias


def routed_b64(c) -> str | None:
    """A choice's ``routed_experts``: vLLM's base64 ``.npy`` of the sample's array, or None."""
    arr = getattr(c, "routed_experts", None)
    return None if arr is None else encode_routed_experts(arr)


def _reject_unsupported(body) -> None:
    if body.n is not None and body.n < 1:
        raise APIError(400, f"n must be >= 1, got {body.n}", param="n")


def _normalize_prompts(prompt) -> list:
    """A validated ``prompt`` field (:class:`CompletionRequest`'s: a str, or a list of str, of
    ints or of int lists, each list of one kind) → list of str | list[int]."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if type(prompt[0]) is int:  # token ids (the model's union: then every entry is an int)
        return [prompt]
    return list(prompt)


def make_openai_router(state: ServerState, dependencies: list) -> APIRouter:
    """The /v1 routes, behind ``dependencies`` (the API-key check); bodies are decoded by
    msgspec where it parses them (:class:`~rlserve.server.request_body.FastJSONRoute`)."""
    router = APIRouter(dependencies=dependencies, route_class=FastJSONRoute)
    st = state.settings
    outputs = ChatOutputConfig(st.tool_call_parser, st.reasoning_parser, st.enable_auto_tool_choice, state.tokenizer,
                               structured_in_reasoning=st.structured_in_reasoning)

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
        check_extra_fields(body, "completions", state.settings.allow_unknown_fields)
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        # vLLM's prompt-only scoring: one token is generated (and counted in usage), the prompt returned
        echo0 = body.echo and body.max_tokens == 0
        lp_k = state.check_logprobs(body.logprobs, "logprobs")
        plp_k = state.check_logprobs(body.prompt_logprobs, "prompt_logprobs")
        structured = await state.structured_outputs(body)
        prompts = _normalize_prompts(body.prompt)
        state.limits.check_sequences(len(prompts), body.n)
        items = []  # (prompt text, prompt ids, params)
        all_ids = await state.tokenize_many(prompts, ["prompt"] * len(prompts), body.add_special_tokens)
        prompt_lps = plp_k
        if body.echo and prompt_lps is None:  # vLLM: echo's prompt logprobs are logprobs' top-k
            prompt_lps = lp_k
        # a batch's prompts (TRL sends its whole batch in one request) share their SamplingParams but for
        # max_tokens and the reasoning gate: built once per (max_tokens, constraint), copied per prompt
        # (the engine front sets a copy's lora_int_id; no list of it is changed in place)
        built: dict = {}
        for p, ids in zip(prompts, all_ids):
            if body.truncate_prompt_tokens is not None:
                ids = state.truncate(ids, body.truncate_prompt_tokens, side=body.truncation_side)
            max_tokens = state.check_length(len(ids), 1 if echo0 else body.max_tokens)
            gated = outputs.reasoning_gate(structured, ids, None)
            first = built.get((max_tokens, id(gated)))
            if first is None:
                params = _common_params(state, body, len(ids), max_tokens, lp_k, prompt_lps, gated)
                params.lora_int_id = lora_id
                built[(max_tokens, id(gated))] = (params, gated)  # (gated kept alive: its id stays its own)
            else:
                _check_routed_start(body, len(ids))
                params = copy.copy(first[0])
            text = p if isinstance(p, str) and body.truncate_prompt_tokens is None else None
            items.append((text, ids, params))
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        n = body.n

        def prompt_text(i):
            if body.return_token_ids:  # vLLM: the prompt's ids are returned instead of its text
                return ""
            text = items[i][0]
            return text if text is not None else state.tokenizer.decode(items[i][1])

        as_ids = body.return_tokens_as_token_ids

        def gens(stream: bool, sink=None):
            return [state.generate(ids, params, f"{rid}-{i}", "completions", stream=stream, sink=sink)
                    for i, (_, ids, params) in enumerate(items)]

        if body.stream:
            sink = sink_for(raw.scope) if len(items) == 1 else None  # one request's direct writes (issue 37)
            return SSEResponse(
                stream_completions(state, body, items, rid, created, model, n, usage_options(body.stream_options),
                                   prompt_text, gens(True, sink), sink),
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
                text, lp_ids, lp_vals = c.text, list(c.token_ids), list(c.logprobs or [])
                if body.echo:  # vLLM: the prompt (text, ids, logprobs) before the output; max_tokens 0: alone
                    plps = list(out.prompt_logprobs or [None] * len(ids))
                    text = prompt_text(i) + ("" if echo0 else text)
                    lp_ids, lp_vals = (list(ids), plps) if echo0 else (list(ids) + lp_ids, plps + lp_vals)
                lp = state.completion_logprobs(lp_ids, lp_vals, as_ids=as_ids, n_prompt=len(ids) if body.echo else 0) \
                    if body.logprobs is not None else None
                plp = (state.prompt_logprobs_json(ids, out.prompt_logprobs, getattr(out, "prompt_logprob_ranks", None),
                                                  as_ids) if params.prompt_logprobs is not None else None)
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
        check_extra_fields(body, "chat", state.settings.allow_unknown_fields)
        if not body.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        tool_choice = check_tools(body, outputs)
        if body.top_logprobs is not None and body.top_logprobs > 0 and not body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        top_k = state.check_logprobs(body.top_logprobs, "top_logprobs") or 0
        structured = await state.structured_outputs(body)
        forced = forced_spec(body, outputs, tool_choice, structured)
        if forced is not None:
            structured = await state.compile_structured(forced, "tool_choice")
        ids = await state.tokenize_chat(body.messages, body.chat_template_args(), "messages", body.add_special_tokens)
        if body.truncate_prompt_tokens is not None:
            ids = state.truncate(ids, body.truncate_prompt_tokens, side=body.truncation_side)
        max_tokens = state.check_length(
            len(ids), body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
            param="max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens")
        k = top_k if body.logprobs else None
        # the response's prompt_logprobs: vLLM's prompt_logprobs, else with echo top_logprobs' top-k
        # (vLLM's default 0: the prompt tokens' own)
        if body.prompt_logprobs is not None and body.stream and (body.prompt_logprobs > 0 or body.prompt_logprobs == -1):
            raise APIError(400, "prompt_logprobs are not available when stream=true", param="prompt_logprobs")
        plp_k = state.check_logprobs(body.prompt_logprobs, "prompt_logprobs") if body.prompt_logprobs is not None \
            else (state.check_logprobs(body.top_logprobs, "top_logprobs") or 0) if body.echo else None
        structured = outputs.reasoning_gate(structured, ids, body.template_kwargs(), body.include_reasoning)
        params = _common_params(state, body, len(ids), max_tokens, k, prompt_logprobs=plp_k, structured=structured)
        params.lora_int_id = state.lora_int_id(body.model)
        if outputs.skip_special_tokens(body.tools, tool_choice) is not None:
            params.skip_special_tokens = outputs.skip_special_tokens(body.tools, tool_choice)
        parsers = [outputs.parser(body.tools, tool_choice, body.template_kwargs(), body.include_reasoning)
                   for _ in range(body.n)] \
            if outputs.active else None
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        sink = sink_for(raw.scope) if body.stream else None  # its direct writes (issue 37)
        gen = state.generate(ids, params, rid, "chat", stream=body.stream, sink=sink)
        if body.stream:
            return SSEResponse(
                stream_chat(state, body, ids, rid, created, model, usage_options(body.stream_options), gen, top_k,
                            parsers, sink),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            (out,) = await unless_disconnected(raw, collect_final([gen]))
        except ClientDisconnected:
            return Response(status_code=499)
        echo = chat_echo(body)
        choices, reasoning_tokens = [], None
        for c in sorted(out.outputs, key=lambda c: c.index):
            content, finish = echo + c.text, c.finish_reason
            if parsers is not None:  # tool calls / reasoning split out of the text (the token ids stay whole)
                content, finish = parsers[c.index].message(c.text, c.finish_reason)
                if body.echo:  # vLLM prepends the echo to the parsed content
                    content["content"] = echo + (content["content"] or "")
                content["tool_calls"] = content["tool_calls"][:1] if body.parallel_tool_calls is False \
                    else content["tool_calls"]
                if outputs.reasoning_cls is not None:
                    reasoning_tokens = (reasoning_tokens or 0) + parsers[c.index].reasoning_tokens(c.token_ids)
            hide = parsers is not None and not body.include_reasoning  # vLLM: no logprobs / ids showing the reasoning
            choices.append(chat_choice(
                c.index, content, state.chat_logprobs(c.token_ids, c.logprobs, top_k, body.return_tokens_as_token_ids)
                if body.logprobs and not hide else None, finish, c.stop_reason,
                list(c.token_ids) if body.return_token_ids and not hide else None,
                getattr(out, "weight_version", None), routed_b64(c)))
        role = chat_answer_role(body)
        for ch in choices:
            ch["message"]["role"] = role
        version, versions = weight_versions([out])
        return JSONResponse(chat_response(
            rid, created, model, choices,
            answer_usage(len(ids), sum(len(c.token_ids) for c in out.outputs), reasoning_tokens),
            system_fingerprint(state), list(ids) if body.return_token_ids else None, version, versions,
            state.prompt_logprobs_json(ids, out.prompt_logprobs, getattr(out, "prompt_logprob_ranks", None),
                                       body.return_tokens_as_token_ids) if plp_k is not None else None))

    return router
