"""Server-sent events of the OpenAI routes: the event encoding (:func:`sse`, :func:`sse_event`),
the interleaving of a request's generators (:func:`merge_generators`), and the chunk streams of
``/v1/completions`` and ``/v1/chat/completions`` with ``"stream": true``: one choice per chunk,
with the keys vLLM 0.32 sends (its ``*StreamResponse`` models dumped with ``exclude_unset``; the
last usage chunk with ``exclude_none``). The routes themselves: :mod:`rlserve.server.openai_routes`."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, AsyncIterator

import msgspec

from rlserve.server.errors import exception_to_error
from rlserve.server.openai_answers import chat_answer_role, chat_echo, usage_json
from rlserve.server.protocol import ChatCompletionRequest, CompletionRequest
from rlserve.server.server_info import system_fingerprint
from rlserve.server.state import ServerState


_JSON = msgspec.json.Encoder()


def sse(obj) -> str:
    """One server-sent event carrying ``obj`` as compact JSON (UTF-8 text, as vLLM's pydantic
    dumps it). Encoded by msgspec: 1.0 us for a completions chunk against 8.7 us with
    ``json.dumps`` (CPU machine), at one chunk per token per stream; what msgspec cannot encode
    (a lone surrogate) goes through ``json.dumps`` (``\\u`` escapes)."""
    try:
        return "data: " + _JSON.encode(obj).decode() + "\n\n"
    except (msgspec.EncodeError, TypeError, UnicodeError):
        return f"data: {json.dumps(obj, separators=(',', ':'), allow_nan=False)}\n\n"


def sse_bytes(obj) -> bytes:
    """:func:`sse` as UTF-8 bytes, for the per-token chunks of a stream: msgspec's bytes go out as
    they are (no decode to ``str`` and encode again by the response); the same fallback."""
    try:
        return b"data: " + _JSON.encode(obj) + b"\n\n"
    except (msgspec.EncodeError, TypeError, UnicodeError):
        return sse(obj).encode()


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


def usage_options(stream_options) -> tuple[bool, bool]:
    """``(include_usage, continuous)`` of a request's ``stream_options`` (``None``: neither), as
    vLLM reads them: ``continuous_usage_stats`` counts only with ``include_usage``. With
    ``include_usage`` a last chunk carries the request's usage; with both, every chunk also
    carries the usage so far of the one choice in it."""
    include = bool(stream_options and stream_options.include_usage)
    return include, include and bool(stream_options.continuous_usage_stats)


class _Chunks:
    """Chunk encoder of one stream, as vLLM's serving code builds them: one choice per chunk;
    with ``continuous_usage_stats`` every chunk's ``usage`` counts that choice's prompt tokens
    and its completion tokens sent so far (vLLM's ``previous_num_tokens[i]``), chat adding
    ``completion_tokens_details: null``; without ``include_usage``, a choice's last chunk (the
    one with its ``finish_reason``) carries the ``system_fingerprint``, else the usage chunk
    does."""

    def __init__(self, state: ServerState, base: dict, usage: tuple[bool, bool], chat: bool):
        self.base, self.include, self.continuous, self.chat = base, usage[0], usage[1], chat
        self.fingerprint = system_fingerprint(state)

    def chunk(self, choice: dict, prompt_tokens: int, completion_tokens: int, **extra) -> bytes:
        """The chunk of ``choice`` (``extra``: more top-level keys, e.g. the first chat chunk's), as
        bytes (:func:`sse_bytes`)."""
        ch = dict(self.base, choices=[choice])
        if self.continuous:
            ch["usage"] = usage_json(prompt_tokens, completion_tokens)
            if self.chat:
                ch["usage"]["completion_tokens_details"] = None
        if not self.include and choice["finish_reason"] is not None:
            ch["system_fingerprint"] = self.fingerprint
        ch.update(extra)
        return sse_bytes(ch)

    def usage(self, prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None) -> bytes:
        """The last chunk of a stream with ``include_usage``: no choices, the request's usage
        (with ``completion_tokens_details.reasoning_tokens`` when counted)."""
        u = usage_json(prompt_tokens, completion_tokens)
        if reasoning_tokens is not None:
            u["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return sse_bytes(dict(self.base, choices=[], usage=u, system_fingerprint=self.fingerprint))


async def stream_completions(state: ServerState, body: CompletionRequest, items, rid, created, model, n,
                             usage: tuple[bool, bool], prompt_text, gens) -> AsyncIterator[str | bytes]:
    """SSE chunks of a completions stream: a chunk per choice per engine output with new text,
    tokens or its finish (vLLM's ``CompletionStreamResponse``, :class:`_Chunks`). A choice's
    keys: ``index``, ``text``, ``logprobs``, ``finish_reason``, ``stop_reason``,
    ``prompt_token_ids`` (the prompt's ids on a choice's first chunk with ``return_token_ids``
    or ``echo``, else null), ``token_ids`` (the delta's ids with ``return_token_ids``, else null); plus
    rlserve's ``weight_version`` (and ``prompt_logprobs`` on a choice's first chunk when asked
    for: vLLM refuses ``prompt_logprobs`` with ``stream``). ``usage`` (:func:`usage_options`):
    with ``include_usage`` a last chunk with the request's usage and no choices; no ``usage``
    key on the others unless ``continuous_usage_stats``."""
    sent_text: dict[int, int] = {}
    sent_toks: dict[int, int] = {}
    done: set[int] = set()
    text_offset: dict[int, int] = {}
    chunks = _Chunks(state, {"id": rid, "object": "text_completion", "created": created, "model": model}, usage,
                     chat=False)
    single = len(gens) == 1  # the common case: the request's generator itself, one async hop less per chunk
    agen = gens[0] if single else merge_generators(gens)
    try:
        async for x in agen:
            i, out = (0, x) if single else x
            _, ids, params = items[i]
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
                echo0 = body.echo and body.max_tokens == 0  # vLLM's prompt-only scoring: no output text
                if echo0:
                    delta_text = ""
                if body.logprobs is not None:
                    lp_ids, lp_vals = ([], []) if echo0 else (delta_ids, list((c.logprobs or [])[k0:k0 + len(delta_ids)]))
                    if first and body.echo:
                        plps = out.prompt_logprobs or [None] * len(ids)
                        lp_ids, lp_vals = list(ids) + lp_ids, list(plps) + lp_vals
                    lp = state.completion_logprobs(lp_ids, lp_vals, text_offset.get(idx, 0),
                                                   as_ids=body.return_tokens_as_token_ids,
                                                   before=list(c.token_ids[:k0]),
                                                   n_prompt=len(ids) if first and body.echo else 0)
                    if lp["tokens"]:
                        text_offset[idx] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                sent_text[idx] = len(c.text)
                sent_toks[idx] = len(c.token_ids)
                choice = {"index": idx, "text": prefix + delta_text, "logprobs": lp,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                          # vLLM: the first chunk of an echo carries the prompt's ids too
                          "prompt_token_ids": list(ids) if (body.return_token_ids or body.echo) and first else None,
                          "token_ids": delta_ids if body.return_token_ids else None,
                          "weight_version": getattr(out, "weight_version", None)}
                if first and body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = state.prompt_logprobs_json(
                        ids, out.prompt_logprobs, getattr(out, "prompt_logprob_ranks", None),
                        body.return_tokens_as_token_ids)
                if c.finish_reason is not None:
                    done.add(idx)
                yield chunks.chunk(choice, len(ids), sent_toks[idx])
        if usage[0]:
            yield chunks.usage(sum(len(it[1]) for it in items), sum(sent_toks.values()))
    except Exception as e:  # noqa: BLE001 - reported in-stream; the status line is already sent
        err = exception_to_error(e)
        yield sse(err.body())
    finally:
        await agen.aclose()
    yield SSE_DONE


def _parsed_delta(parser, body, delta_text, delta_ids, prompt_ids, finish):
    """``(delta, finish_reason)`` of one chunk through a choice's output parser; delta None:
    no chunk (the parser holds the text back and nothing else must go out)."""
    delta = parser.delta(delta_text, delta_ids, prompt_ids, finished=finish is not None)
    if delta is None:
        if finish is None and (not (body.logprobs or body.return_token_ids) or not body.include_reasoning):
            return None, finish
        delta = {}
    if body.parallel_tool_calls is False and delta.get("tool_calls"):
        delta["tool_calls"] = [tc for tc in delta["tool_calls"] if tc["index"] == 0]
        if not delta["tool_calls"]:
            del delta["tool_calls"]
    return delta, parser.finish_reason(finish) if finish is not None else None


async def stream_chat(state: ServerState, body: ChatCompletionRequest, ids, rid, created, model,
                      usage: tuple[bool, bool], gen, top_k: int = 0, parsers: list | None = None) -> AsyncIterator[str | bytes]:
    """SSE chunks of a chat stream: a role chunk per choice first, then a chunk per choice per
    engine output with new text or its finish (vLLM's ``ChatCompletionStreamResponse``,
    :class:`_Chunks`). A role chunk also has ``prompt_token_ids`` (the ids with
    ``return_token_ids``, else null) and ``prompt_text`` (null), its choice ``index``,
    ``delta`` (``{"role": ROLE, "content": ""}``: :func:`chat_answer_role`), ``logprobs``,
    ``finish_reason``; with ``echo``, a chunk per choice with the echoed message next; a
    content choice ``index``, ``delta`` (``{"content": text}``), ``logprobs``,
    ``finish_reason``, ``token_ids`` (the delta's ids with ``return_token_ids``, else null), and
    ``stop_reason`` on the choice's last chunk only (the one with its ``finish_reason``); plus
    rlserve's ``weight_version`` on every choice. ``usage`` (:func:`usage_options`): with
    ``include_usage`` a last chunk with the usage and no choices; no ``usage`` key on the
    others unless ``continuous_usage_stats`` (a role chunk: 0 completion tokens). ``parsers``: a
    :class:`~rlserve.server.chat_output.ChatOutputParser` per choice (tool calls / reasoning
    flags on), fed each delta; its delta replaces ``{"content": text}``, a delta it holds back
    sends no chunk (unless the choice finishes or the chunk carries logprobs or token ids),
    and the usage chunk gains ``completion_tokens_details.reasoning_tokens``; with
    ``include_reasoning: false`` no reasoning, logprobs or token ids go out (vLLM's rule)."""
    n = body.n
    sent_text = [0] * n
    sent_toks = [0] * n
    done: set[int] = set()
    completion_tokens = 0
    reasoning_tokens = None
    hide = parsers is not None and not body.include_reasoning  # vLLM: no logprobs / ids that show the reasoning
    chunks = _Chunks(state, {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}, usage,
                     chat=True)

    def role_chunks(version):
        """The choices' ``{"role": ROLE, "content": ""}`` deltas. As vLLM, sent with the
        engine's first output (the first token is ready), not on arrival: a client timing the
        first chunk (``vllm bench serve``'s TTFT) measures the prefill."""
        prompt_ids = list(ids) if body.return_token_ids else None
        return [chunks.chunk({"index": i, "delta": {"role": chat_answer_role(body), "content": ""}, "logprobs": None,
                              "finish_reason": None, "weight_version": version}, len(ids), 0,
                             prompt_token_ids=prompt_ids, prompt_text=None) for i in range(n)]

    agen = gen  # one generator: no merging (one async hop less per chunk)
    sent_role = False
    try:
        async for out in agen:
            if not sent_role:
                sent_role = True
                for ch in role_chunks(getattr(out, "weight_version", None)):
                    yield ch
                echo = chat_echo(body)
                for i in range(n) if echo else ():  # vLLM: the echoed message, one chunk per choice
                    yield chunks.chunk({"index": i, "delta": {"content": echo}, "logprobs": None, "finish_reason": None,
                                        "weight_version": getattr(out, "weight_version", None)}, len(ids), 0)
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
                finish = c.finish_reason
                delta = {"content": delta_text}
                if parsers is not None:
                    delta, finish = _parsed_delta(parsers[i], body, delta_text, delta_ids, ids, finish)
                    if delta is None:
                        continue
                    if finish is not None and parsers[i].cfg.reasoning_cls is not None:
                        reasoning_tokens = (reasoning_tokens or 0) + parsers[i].reasoning_tokens(c.token_ids)
                choice = {"index": i, "delta": delta,
                          "logprobs": state.chat_logprobs(delta_ids, (c.logprobs or [])[k0:k0 + len(delta_ids)],
                                                          top_k, body.return_tokens_as_token_ids, c.token_ids[:k0])
                          if body.logprobs and not hide else None,
                          "finish_reason": finish}
                if c.finish_reason is not None:  # as vLLM: stop_reason goes with the finish_reason only
                    choice["stop_reason"] = c.stop_reason
                    done.add(i)
                choice["token_ids"] = delta_ids if body.return_token_ids and not hide else None
                choice["weight_version"] = getattr(out, "weight_version", None)
                yield chunks.chunk(choice, len(ids), sent_toks[i])
            if out.finished:
                completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        if usage[0]:
            yield chunks.usage(len(ids), completion_tokens, reasoning_tokens)
    except Exception as e:  # noqa: BLE001
        err = exception_to_error(e)
        yield sse(err.body())
    finally:
        await agen.aclose()
    yield SSE_DONE
