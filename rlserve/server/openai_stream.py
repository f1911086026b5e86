"""Server-sent events of the OpenAI routes: the event encoding (:func:`sse`, :func:`sse_event`),
the interleaving of a request's generators (:func:`merge_generators`), and the chunk streams of
``/v1/completions`` and ``/v1/chat/completions`` with ``"stream": true`` (their keys as vLLM
0.32 sends them). The routes themselves: :mod:`rlserve.server.openai_routes`."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, AsyncIterator

from rlserve.server.errors import exception_to_error
from rlserve.server.protocol import ChatCompletionRequest, CompletionRequest
from rlserve.server.state import ServerState


def sse(obj) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'), allow_nan=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_event(obj: dict) -> str:
    """One server-sent event named by ``obj["type"]`` (an ``event:`` line before the data, as
    the Responses API's stream labels every event)."""
    return f"event: {obj['type']}\n" + sse(obj)


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


def usage_json(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's ``usage`` object of a completion or chat answer (token counts)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def usage_options(stream_options) -> tuple[bool, bool]:
    """``(include_usage, continuous)`` of a request's ``stream_options`` (``None``: neither), as
    vLLM reads them: ``continuous_usage_stats`` counts only with ``include_usage``. With
    ``include_usage`` a last chunk carries the request's usage; with both, every chunk also
    carries the usage so far."""
    include = bool(stream_options and stream_options.include_usage)
    return include, include and bool(stream_options.continuous_usage_stats)


async def stream_completions(state: ServerState, body: CompletionRequest, items, rid, created, model, n,
                             usage: tuple[bool, bool], prompt_text, gens) -> AsyncIterator[str]:
    """SSE chunks of a completions stream (one delta per choice per engine step). A choice's
    keys are vLLM's (0.32's ``CompletionStreamResponse`` dumped with ``exclude_unset``):
    ``index``, ``text``, ``logprobs``, ``finish_reason``, ``stop_reason``, ``prompt_token_ids``
    (the prompt's ids on a choice's first chunk with ``return_token_ids``, else null),
    ``token_ids`` (the delta's ids with ``return_token_ids``, else null); plus rlserve's
    ``weight_version``. ``usage`` (:func:`usage_options`): with ``include_usage`` a last chunk
    with the request's usage and no choices; with ``continuous_usage_stats`` too, every chunk
    carries its prompt's ``usage`` so far (the tokens of the choices in it; vLLM sends one
    choice a chunk), else no ``usage`` key (vLLM sets none)."""
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
                chunk = dict(base, choices=choices)
                if usage[1]:
                    chunk["usage"] = usage_json(len(ids), sum(len(c.token_ids) for c in out.outputs))
                yield sse(chunk)
        if usage[0]:
            yield sse(dict(base, choices=[], usage=usage_json(sum(len(it[1]) for it in items),
                                                          sum(completion_tokens.values()))))
    except Exception as e:  # noqa: BLE001 - reported in-stream; the status line is already sent
        err = exception_to_error(e)
        yield sse(err.body())
    finally:
        await agen.aclose()
    yield SSE_DONE


async def stream_chat(state: ServerState, body: ChatCompletionRequest, ids, rid, created, model,
                      usage: tuple[bool, bool], gen, top_k: int = 0) -> AsyncIterator[str]:
    """SSE chunks of a chat stream: a role delta per choice first, then content deltas. Keys
    as vLLM 0.32 sends them (``ChatCompletionStreamResponse`` dumped with ``exclude_unset``):
    the first chunk has ``prompt_token_ids`` (the ids with ``return_token_ids``, else null) and
    ``prompt_text`` (null); a role choice has ``index``, ``delta``, ``logprobs``,
    ``finish_reason``; a content choice those and ``token_ids`` (the delta's ids with
    ``return_token_ids``, else null), and ``stop_reason`` on the choice's last chunk only (the
    one with its ``finish_reason``); plus rlserve's ``weight_version`` on every choice.
    ``usage`` (:func:`usage_options`): with ``include_usage`` a last chunk with the usage and
    no choices; with ``continuous_usage_stats`` too, every chunk carries the usage so far (the
    role chunk 0 completion tokens; then the tokens of every choice so far: vLLM counts the
    chunk's one choice; with vLLM's ``completion_tokens_details``: null), else no ``usage`` key
    (vLLM sets none)."""
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
        chunk = dict(base, choices=choices, prompt_token_ids=list(ids) if body.return_token_ids else None,
                     prompt_text=None)
        if usage[1]:
            chunk["usage"] = dict(usage_json(len(ids), 0), completion_tokens_details=None)
        return sse(chunk)

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
                chunk = dict(base, choices=choices)
                if usage[1]:  # vLLM's chat chunks also name completion_tokens_details (null)
                    chunk["usage"] = dict(usage_json(len(ids), sum(len(c.token_ids) for c in out.outputs)),
                                          completion_tokens_details=None)
                yield sse(chunk)
        if usage[0]:
            yield sse(dict(base, choices=[], usage=usage_json(len(ids), completion_tokens)))
    except Exception as e:  # noqa: BLE001
        err = exception_to_error(e)
        yield sse(err.body())
    finally:
        await agen.aclose()
    yield SSE_DONE
