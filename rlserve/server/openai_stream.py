"""Server-sent events of the OpenAI routes: the event encoding (:func:`sse`, :func:`sse_event`),
the interleaving of a request's generators (:func:`merge_generators`), and the chunk streams of
``/v1/completions`` and ``/v1/chat/completions`` with ``"stream": true``: one choice per chunk,
with the keys vLLM 0.32 sends (its ``*StreamResponse`` models dumped with ``exclude_unset``; the
last usage chunk with ``exclude_none``). The routes themselves: :mod:`rlserve.server.openai_routes`."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

from starlette.responses import StreamingResponse

from rlserve.server.direct_write import parked
from rlserve.server.errors import exception_to_error
from rlserve.server.openai_answers import chat_answer_role, chat_echo, weight_versions
from rlserve.server.protocol import ChatCompletionRequest, CompletionRequest
from rlserve.server.state import ServerState
from rlserve.server.stream_chunks import StreamChunks, chat_choice, chunk_versions, sse, sse_bytes, text_choice

__all__ = ["SSEResponse", "LastChunk", "merge_generators", "sse", "sse_bytes", "sse_event", "stream_chat",
           "stream_completions", "usage_options"]


SSE_DONE = "data: [DONE]\n\n"


class LastChunk(bytes):
    """A stream's last body bytes (its ``[DONE]`` event and what came with it): :class:`SSEResponse`
    sends them with ``more_body: False``, so the transfer-encoding's end goes out in the same write."""


class SSEResponse(StreamingResponse):
    """Starlette's ``StreamingResponse`` (the same headers, disconnect watch and chunks), except that
    a :class:`LastChunk` ends the body in its own message: one socket write per request less than an
    empty closing message after it."""

    async def stream_response(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        more = True
        async for chunk in self.body_iterator:
            if not isinstance(chunk, bytes | memoryview):
                chunk = chunk.encode(self.charset)
            more = type(chunk) is not LastChunk
            await send({"type": "http.response.body", "body": chunk, "more_body": more})
        if more:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def _joined(chunks: list) -> bytes:
    """The chunks of one engine output as one body message: one socket write (issue 37)."""
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _last(chunks: list) -> LastChunk:
    """``chunks`` (bytes or str) and the ``[DONE]`` event, as the stream's :class:`LastChunk`."""
    return LastChunk(b"".join(c if isinstance(c, bytes) else c.encode() for c in chunks) + SSE_DONE.encode())


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


async def stream_completions(state: ServerState, body: CompletionRequest, items, rid, created, model, n,
                             usage: tuple[bool, bool], prompt_text, gens, sink=None) -> AsyncIterator[str | bytes]:
    """SSE chunks of a completions stream: a chunk per choice per engine output with new text,
    tokens or its finish (vLLM's ``CompletionStreamResponse``,
    :class:`~rlserve.server.stream_chunks.StreamChunks`). A choice's keys: ``index``, ``text``,
    ``logprobs``, ``finish_reason``, ``stop_reason``,
    ``prompt_token_ids`` (the prompt's ids on a choice's first chunk with ``return_token_ids``
    or ``echo``, else null), ``token_ids`` (the delta's ids with ``return_token_ids``, else null); plus
    rlserve's ``weight_version`` (and ``prompt_logprobs`` on a choice's first chunk when asked
    for: vLLM refuses ``prompt_logprobs`` with ``stream``), and on a choice's last chunk (its
    ``finish_reason``) ``weight_versions`` (:func:`_versions`), on a middle chunk whose tokens more than
    one weight version produced those versions (:func:`~rlserve.server.stream_chunks.chunk_versions`).
    ``usage`` (:func:`usage_options`): with ``include_usage`` a last chunk with the request's usage
    and no choices; no ``usage`` key on the others unless ``continuous_usage_stats``. ``sink``: the one request's
    :class:`~rlserve.server.direct_write.DirectSink` (its generator's ``sink``), which writes the
    plain middle chunks itself (:func:`~rlserve.server.direct_write.parked`)."""
    chunks = StreamChunks(state, {"id": rid, "object": "text_completion", "created": created, "model": model}, usage,
                          chat=False, plain=body.logprobs is None and not body.echo, rti=body.return_token_ids)
    sent_text, sent_toks, done = chunks.sent_text, chunks.sent_toks, chunks.done
    text_offset: dict[int, int] = {}
    single = len(gens) == 1  # the common case: the request's generator itself, one async hop less per chunk
    agen = parked(gens[0], sink, chunks.plain if chunks.templates is not None else None) if single \
        else merge_generators(gens)
    rti = body.return_token_ids
    pending: list = []  # the chunks of one engine output: one write
    try:
        async for x in agen:
            i, out = (0, x) if single else x
            _, ids, params = items[i]
            b = None if chunks.templates is None else chunks.plain(out, i * n)
            if b is not None:  # its choices' middle chunks (not a first or last): issue 37's per-token path
                if b:
                    pending.append(b)
            else:  # the general way
                version = getattr(out, "weight_version", None)
                for c in out.outputs:
                    idx = i * n + c.index
                    if idx in done:
                        continue
                    first = idx not in sent_toks
                    t0, k0 = sent_text.get(idx, 0), sent_toks.get(idx, 0)
                    spans = None if c.finish_reason is not None else chunk_versions(c, k0)
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
                        lp_ids, lp_vals = ([], []) if echo0 else \
                            (delta_ids, list((c.logprobs or [])[k0:k0 + len(delta_ids)]))
                        if first and body.echo:
                            plps = out.prompt_logprobs or [None] * len(ids)
                            lp_ids, lp_vals = list(ids) + lp_ids, list(plps) + lp_vals
                        lp = state.completion_logprobs(lp_ids, lp_vals, text_offset.get(idx, 0),
                                                       as_ids=body.return_tokens_as_token_ids,
                                                       before=c.token_ids[max(0, k0 - 4):k0],  # (its context: 4 ids)
                                                       n_prompt=len(ids) if first and body.echo else 0)
                        if lp["tokens"]:
                            text_offset[idx] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                    sent_text[idx] = len(c.text)
                    sent_toks[idx] = len(c.token_ids)
                    # vLLM: the first chunk of an echo carries the prompt's ids too
                    choice = text_choice(idx, prefix + delta_text, lp, c.finish_reason, c.stop_reason,
                                          list(ids) if (rti or body.echo) and first else None,
                                          delta_ids if rti else None, version)
                    if first and body.prompt_logprobs is not None:
                        choice["prompt_logprobs"] = state.prompt_logprobs_json(
                            ids, out.prompt_logprobs, getattr(out, "prompt_logprob_ranks", None),
                            body.return_tokens_as_token_ids)
                    if c.finish_reason is not None:
                        done.add(idx)
                        choice["weight_versions"] = _versions(out, version)
                    elif spans is not None:
                        choice["weight_versions"] = spans
                    pending.append(chunks.chunk(choice, len(ids), sent_toks[idx]))
            if pending and not (single and out.finished):  # a finished request's last chunks go with [DONE]
                yield _joined(pending)
                pending = []
        if usage[0]:
            pending.append(chunks.usage(sum(len(it[1]) for it in items), sum(sent_toks.values())))
    except Exception as e:  # noqa: BLE001 - reported in-stream; the status line is already sent
        err = exception_to_error(e)
        pending.append(sse(err.body()))
    finally:
        await agen.aclose()
    yield _last(pending)


def _versions(out, version) -> list:
    """``weight_versions`` of a choice's last chunk (:func:`~rlserve.server.openai_answers.weight_versions`
    of its request; ``[version]`` when the output names none): every weight version seen while its request
    ran, in order (a chunk's ``weight_version`` names its last token's only, and a chunk may hold tokens of
    several steps)."""
    return weight_versions([out])[1] or [version]


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
                      usage: tuple[bool, bool], gen, top_k: int = 0, parsers: list | None = None,
                      sink=None) -> AsyncIterator[str | bytes]:
    """SSE chunks of a chat stream: a role chunk per choice first, then a chunk per choice per
    engine output with new text or its finish (vLLM's ``ChatCompletionStreamResponse``,
    :class:`~rlserve.server.stream_chunks.StreamChunks`). A role chunk also has ``prompt_token_ids`` (the ids with
    ``return_token_ids``, else null) and ``prompt_text`` (null), its choice ``index``,
    ``delta`` (``{"role": ROLE, "content": ""}``: :func:`chat_answer_role`), ``logprobs``,
    ``finish_reason``; with ``echo``, a chunk per choice with the echoed message next; a
    content choice ``index``, ``delta`` (``{"content": text}``), ``logprobs``,
    ``finish_reason``, ``token_ids`` (the delta's ids with ``return_token_ids``, else null), and
    ``stop_reason`` on the choice's last chunk only (the one with its ``finish_reason``); plus
    rlserve's ``weight_version`` on every choice, ``weight_versions`` on a choice's last chunk
    (:func:`_versions`) and on a middle chunk whose tokens several weight versions produced
    (:func:`~rlserve.server.stream_chunks.chunk_versions`). ``usage`` (:func:`usage_options`): with
    ``include_usage`` a last chunk with the usage and no choices; no ``usage`` key on the
    others unless ``continuous_usage_stats`` (a role chunk: 0 completion tokens). ``parsers``: a
    :class:`~rlserve.server.chat_output.ChatOutputParser` per choice (tool calls / reasoning
    flags on), fed each delta; its delta replaces ``{"content": text}``, a delta it holds back
    sends no chunk (unless the choice finishes or the chunk carries logprobs or token ids),
    and the usage chunk gains ``completion_tokens_details.reasoning_tokens``; with
    ``include_reasoning: false`` no reasoning, logprobs or token ids go out (vLLM's rule). ``sink``:
    ``gen``'s :class:`~rlserve.server.direct_write.DirectSink`, which writes the plain middle chunks
    itself (:func:`~rlserve.server.direct_write.parked`)."""
    n = body.n
    completion_tokens = 0
    reasoning_tokens = None
    hide = parsers is not None and not body.include_reasoning  # vLLM: no logprobs / ids that show the reasoning
    rti = body.return_token_ids and not hide
    chunks = StreamChunks(state, {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model},
                          usage, chat=True, plain=parsers is None and not body.logprobs, rti=rti)
    sent_text, sent_toks, done = chunks.sent_text, chunks.sent_toks, chunks.done

    def role_chunks(version):
        """The choices' ``{"role": ROLE, "content": ""}`` deltas. As vLLM, sent with the
        engine's first output (the first token is ready), not on arrival: a client timing the
        first chunk (``vllm bench serve``'s TTFT) measures the prefill."""
        prompt_ids = list(ids) if body.return_token_ids else None
        return [chunks.chunk({"index": i, "delta": {"role": chat_answer_role(body), "content": ""}, "logprobs": None,
                              "finish_reason": None, "weight_version": version}, len(ids), 0,
                             prompt_token_ids=prompt_ids, prompt_text=None) for i in range(n)]

    # one generator: no merging (one async hop less per chunk)
    agen = parked(gen, sink, chunks.plain if chunks.templates is not None else None)
    sent_role = False
    pending: list = []  # the chunks of one engine output: one write
    try:
        async for out in agen:
            version = getattr(out, "weight_version", None)
            if not sent_role:
                sent_role = True
                pending.extend(role_chunks(version))
                echo = chat_echo(body)
                for i in range(n) if echo else ():  # vLLM: the echoed message, one chunk per choice
                    pending.append(chunks.chunk({"index": i, "delta": {"content": echo}, "logprobs": None,
                                                 "finish_reason": None, "weight_version": version}, len(ids), 0))
            b = None if chunks.templates is None else chunks.plain(out)
            if b is not None:  # its choices' middle chunks (not a last): issue 37's per-token path
                if b:
                    pending.append(b)
            else:  # the general way
                for c in out.outputs:
                    i = c.index
                    if i in done:
                        continue
                    k0, t0 = sent_toks.get(i, 0), sent_text.get(i, 0)
                    spans = None if c.finish_reason is not None else chunk_versions(c, k0)
                    delta_text = c.text[t0:]
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
                    if c.finish_reason is not None:
                        done.add(i)
                    lp = state.chat_logprobs(delta_ids, (c.logprobs or [])[k0:k0 + len(delta_ids)], top_k,
                                             body.return_tokens_as_token_ids, c.token_ids[max(0, k0 - 4):k0]) \
                        if body.logprobs and not hide else None
                    choice = chat_choice(i, delta, lp, finish, delta_ids if rti else None, version,
                                          # as vLLM: stop_reason goes with the finish_reason only
                                          **({"stop_reason": c.stop_reason} if c.finish_reason is not None else {}))
                    if c.finish_reason is not None:
                        choice["weight_versions"] = _versions(out, version)
                    elif spans is not None:
                        choice["weight_versions"] = spans
                    pending.append(chunks.chunk(choice, len(ids), sent_toks[i]))
            if out.finished:
                completion_tokens = sum(len(c.token_ids) for c in out.outputs)
            elif pending:  # a finished request's last chunks go with [DONE]
                yield _joined(pending)
                pending = []
        if usage[0]:
            pending.append(chunks.usage(len(ids), completion_tokens, reasoning_tokens))
    except Exception as e:  # noqa: BLE001
        err = exception_to_error(e)
        pending.append(sse(err.body()))
    finally:
        await agen.aclose()
    yield _last(pending)
