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
  (``[None, {"<id>": {"logprob", "rank", "decoded_token"}}, ...]``).

Any other field is a 400 naming it (``code`` ``unknown_field``); ``model`` may be omitted (one
model is served).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rlserve.server.errors import APIError, exception_to_error
from rlserve.server.protocol import ChatCompletionRequest, CompletionRequest
from rlserve.server.state import ServerState

_DISCONNECT_POLL_S = 1.0  # how often a non-streaming request checks for a gone client


def sse(obj) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'), allow_nan=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_event(obj: dict) -> str:
    """One server-sent event named by ``obj["type"]`` (an ``event:`` line before the data, as
    the Responses API's stream labels every event)."""
    return f"event: {obj['type']}\n" + sse(obj)


class ClientDisconnected(Exception):
    """The HTTP client went away before its (non-streaming) answer was ready."""


async def merge_generators(gens: list) -> AsyncIterator[tuple[int, Any]]:
    """Interleave async generators; yields ``(index, item)``. An exception from any of
    them is re-raised; closing the merged generator cancels (and so aborts) all of them."""
    if len(gens) == 1:  # the common case: no task, no extra queue hop per token
        g = gens[0]
        try:
            async for item in g:
                yield 0, item
        finally:
            await g.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, g):
        try:
            async for item in g:
                queue.put_nowait((i, item, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - forwarded to the consumer
            queue.put_nowait((i, None, e))
        finally:
            queue.put_nowait((i, done, None))
            with contextlib.suppress(Exception):
                await g.aclose()

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item, err = await queue.get()
            if err is not None:
                raise err
            if item is done:
                remaining -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _common_params(state: ServerState, body, max_tokens: int, logprobs, prompt_logprobs=None, structured=None):
    return state.sampling_params(
        structured_outputs=structured, n=body.n, max_tokens=max_tokens, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs, **body.sampler_args())


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
        created = int(state.started)
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "rlserve", "root": state.settings.model,
             "parent": None, "max_model_len": state.max_model_len}
            for name in state.settings.served_model_names
        ]}

    # ---- /v1/completions ----------------------------------------------------------------
    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        """OpenAI completions. Errors: 400 (bad fields, context overflow, bad token ids),
        404 (unknown model), 503 (model unavailable), 500 (engine failure)."""
        model = state.check_model(body.model)
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
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _stream_completions(state, body, items, rid, created, model, n, include_usage, prompt_text, gens(True)),
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
                choice = {"index": i * n + c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                          "stop_reason": c.stop_reason, "weight_version": getattr(out, "weight_version", None)}
                if body.return_token_ids:
                    choice["prompt_token_ids"] = list(ids)
                    choice["token_ids"] = list(c.token_ids)
                if body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = state.prompt_logprobs_json(
                        ids, out.prompt_logprobs, getattr(out, "prompt_logprob_ranks", None), as_ids)
                choices.append(choice)
        version, versions = weight_versions(finals)
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": _usage(sum(len(it[1]) for it in items), completion_tokens),
            "weight_version": version, "weight_versions": versions,
        })

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
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        gen = state.generate(ids, params, rid, "chat", stream=body.stream)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _stream_chat(state, body, ids, rid, created, model, include_usage, gen, top_k),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            (out,) = await unless_disconnected(raw, collect_final([gen]))
        except ClientDisconnected:
            return Response(status_code=499)
        choices = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            choice = {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": state.chat_logprobs(c.token_ids, c.logprobs, top_k, body.return_tokens_as_token_ids)
                if body.logprobs else None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                "weight_version": getattr(out, "weight_version", None),
            }
            if body.return_token_ids:
                choice["token_ids"] = list(c.token_ids)
            choices.append(choice)
        version, versions = weight_versions([out])
        resp = {
            "id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": _usage(len(ids), sum(len(c.token_ids) for c in out.outputs)),
            "weight_version": version, "weight_versions": versions,
        }
        if body.return_token_ids:
            resp["prompt_token_ids"] = list(ids)
        return JSONResponse(resp)

    return router


async def _stream_completions(state: ServerState, body: CompletionRequest, items, rid, created, model, n,
                              include_usage, prompt_text, gens) -> AsyncIterator[str]:
    """SSE chunks of a completions stream (one delta per choice per engine step). A choice's
    keys are vLLM's (0.32's ``CompletionStreamResponse`` dumped with ``exclude_unset``):
    ``index``, ``text``, ``logprobs``, ``finish_reason``, ``stop_reason``, ``prompt_token_ids``
    (the prompt's ids on a choice's first chunk with ``return_token_ids``, else null),
    ``token_ids`` (the delta's ids with ``return_token_ids``, else null); plus rlserve's
    ``weight_version``. No ``usage`` key before the usage chunk (vLLM sets none)."""
    sent_text: dict[int, int] = {}
    sent_toks: dict[int, int] = {}
    done: set[int] = set()
    completion_tokens: dict[int, int] = {}
    text_offset: dict[int, int] = {}
    base = {"id": rid, "object": "text_completion", "created": created, "model": model}
    agen = merge_generators(gens)
    try:
        async for i, out in agen:
            _, ids, params = items[i]
            choices = []
            for c in out.outputs:
                idx = i * n + c.index
                if idx in done:
                    continue
                first = idx not in sent_toks
                t0, k0 = sent_text.get(idx, 0), sent_toks.get(idx, 0)
                delta_text = c.text[t0:]
                delta_ids = list(c.token_ids[k0:])
                if not delta_text and not delta_ids and c.finish_reason is None and not first:
                    continue
                lp = None
                prefix = ""
                if first and body.echo:
                    prefix = prompt_text(i)
                if body.logprobs is not None:
                    lp_ids, lp_vals = delta_ids, list((c.logprobs or [])[k0:k0 + len(delta_ids)])
                    if first and body.echo:
                        plps = out.prompt_logprobs or [None] * len(ids)
                        lp_ids, lp_vals = list(ids) + lp_ids, list(plps) + lp_vals
                    lp = state.completion_logprobs(lp_ids, lp_vals, text_offset.get(idx, 0),
                                                   as_ids=body.return_tokens_as_token_ids)
                    if lp["tokens"]:
                        text_offset[idx] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                sent_text[idx] = len(c.text)
                sent_toks[idx] = len(c.token_ids)
                completion_tokens[idx] = len(c.token_ids)
                choice = {"index": idx, "text": prefix + delta_text, "logprobs": lp,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                          "prompt_token_ids": list(ids) if body.return_token_ids and first else None,
                          "token_ids": delta_ids if body.return_token_ids else None,
                          "weight_version": getattr(out, "weight_version", None)}
                if first and body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = state.prompt_logprobs_json(
                        ids, out.prompt_logprobs, getattr(out, "prompt_logprob_ranks", None),
                        body.return_tokens_as_token_ids)
                if c.finish_reason is not None:
                    done.add(idx)
                choices.append(choice)
            if choices:
                yield sse(dict(base, choices=choices))
        if include_usage:
            yield sse(dict(base, choices=[], usage=_usage(sum(len(it[1]) for it in items),
                                                          sum(completion_tokens.values()))))
    except Exception as e:  # noqa: BLE001 - reported in-stream; the status line is already sent
        err = exception_to_error(e)
        yield sse(err.body())
    finally:
        await agen.aclose()
    yield SSE_DONE


async def _stream_chat(state: ServerState, body: ChatCompletionRequest, ids, rid, created, model, include_usage,
                       gen, top_k: int = 0) -> AsyncIterator[str]:
    """SSE chunks of a chat stream: a role delta per choice first, then content deltas. Keys
    as vLLM 0.32 sends them (``ChatCompletionStreamResponse`` dumped with ``exclude_unset``):
    the first chunk has ``prompt_token_ids`` (the ids with ``return_token_ids``, else null) and
    ``prompt_text`` (null); a role choice has ``index``, ``delta``, ``logprobs``,
    ``finish_reason``; a content choice those and ``token_ids`` (the delta's ids with
    ``return_token_ids``, else null), and ``stop_reason`` on the choice's last chunk only (the
    one with its ``finish_reason``); plus rlserve's ``weight_version`` on every choice. No
    ``usage`` key before the usage chunk (vLLM sets none)."""
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    n = body.n
    sent_text = [0] * n
    sent_toks = [0] * n
    done: set[int] = set()
    completion_tokens = 0

    def role_chunk(version):
        """The choices' ``{"role": "assistant", "content": ""}`` deltas. As vLLM, sent with the
        engine's first output (the first token is ready), not on arrival: a client timing the
        first chunk (``vllm bench serve``'s TTFT) measures the prefill."""
        choices = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None, "weight_version": version} for i in range(n)]
        return sse(dict(base, choices=choices, prompt_token_ids=list(ids) if body.return_token_ids else None,
                        prompt_text=None))

    agen = merge_generators([gen])
    sent_role = False
    try:
        async for _, out in agen:
            if not sent_role:
                sent_role = True
                yield role_chunk(getattr(out, "weight_version", None))
            choices = []
            for c in out.outputs:
                i = c.index
                if i in done:
                    continue
                delta_text = c.text[sent_text[i]:]
                k0 = sent_toks[i]
                delta_ids = list(c.token_ids[k0:])
                if not delta_text and c.finish_reason is None:
                    # no text yet (a character split over tokens, a held stop-string prefix): its
                    # token ids and logprobs go out with the chunk that has text
                    continue
                sent_text[i] = len(c.text)
                sent_toks[i] = len(c.token_ids)
                delta = {"content": delta_text} if delta_text else {}
                choice = {"index": i, "delta": delta,
                          "logprobs": state.chat_logprobs(delta_ids, (c.logprobs or [])[k0:k0 + len(delta_ids)],
                                                          top_k, body.return_tokens_as_token_ids)
                          if body.logprobs else None,
                          "finish_reason": c.finish_reason}
                if c.finish_reason is not None:  # as vLLM: stop_reason goes with the finish_reason only
                    choice["stop_reason"] = c.stop_reason
                choice["weight_version"] = getattr(out, "weight_version", None)
                choice["token_ids"] = delta_ids if body.return_token_ids else None
                if c.finish_reason is not None:
                    done.add(i)
                choices.append(choice)
            if out.finished:
                completion_tokens = sum(len(c.token_ids) for c in out.outputs)
            if choices:
                yield sse(dict(base, choices=choices))
        if include_usage:
            yield sse(dict(base, choices=[], usage=_usage(len(ids), completion_tokens)))
    except Exception as e:  # noqa: BLE001
        err = exception_to_error(e)
        yield sse(err.body())
    finally:
        await agen.aclose()
    yield SSE_DONE
