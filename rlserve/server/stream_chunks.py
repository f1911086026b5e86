"""The chunks of one streamed completions or chat answer (:mod:`rlserve.server.openai_stream`): their
encoding (:func:`sse`, :func:`sse_bytes`), a chunk's choice in vLLM's key order (:func:`text_choice`,
:func:`chat_choice`), and :class:`StreamChunks`: a stream's chunk encoder with its byte templates
(:mod:`rlserve.server.sse_template`) and the record of what of each choice went out, shared by the
stream's coroutine and its direct writes (:mod:`rlserve.server.direct_write`, issue 37), which
continue each other."""

from __future__ import annotations

import json

from rlserve import envs
from rlserve.server.openai_answers import usage_json
from rlserve.server.server_info import system_fingerprint
from rlserve.server.sse_template import ENCODE_ERRORS, ChunkTemplate, encode_json, sse_data_bytes
from rlserve.server.state import ServerState


def sse(obj) -> str:
    """One server-sent event carrying ``obj`` as compact JSON (UTF-8 text, as vLLM's pydantic
    dumps it). Encoded by msgspec: 1.0 us for a completions chunk against 8.7 us with
    ``json.dumps`` (CPU machine), at one chunk per token per stream; what msgspec cannot encode
    (a lone surrogate) goes through ``json.dumps`` (``\\u`` escapes)."""
    try:
        return "data: " + encode_json(obj).decode() + "\n\n"
    except ENCODE_ERRORS:
        return f"data: {json.dumps(obj, separators=(',', ':'), allow_nan=False)}\n\n"


def sse_bytes(obj) -> bytes:
    """:func:`sse` as UTF-8 bytes, for the per-token chunks of a stream: msgspec's bytes go out as
    they are (no decode to ``str`` and encode again by the response); the same fallback."""
    try:
        return sse_data_bytes(obj)
    except ENCODE_ERRORS:
        return sse(obj).encode()


class StreamChunks:
    """Chunk encoder of one stream, as vLLM's serving code builds them: one choice per chunk;
    with ``continuous_usage_stats`` every chunk's ``usage`` counts that choice's prompt tokens
    and its completion tokens sent so far (vLLM's ``previous_num_tokens[i]``), chat adding
    ``completion_tokens_details: null``; without ``include_usage``, a choice's last chunk (the
    one with its ``finish_reason``) carries the ``system_fingerprint``, else the usage chunk
    does. Also what of each choice has gone out (:attr:`sent_text`, :attr:`sent_toks`,
    :attr:`done`): one record for the stream's coroutine and its direct writes
    (:mod:`rlserve.server.direct_write`), which continue each other.

    Args:
        plain: the request asks for nothing a middle chunk would carry beyond its text, weight
            version and (``rti``) token ids (no logprobs, echo, tool or reasoning parsing): its
            middle chunks go through byte templates (:meth:`plain`).
        rti: the chunks carry ``token_ids``.
    """

    def __init__(self, state: ServerState, base: dict, usage: tuple[bool, bool], chat: bool, plain: bool = False,
                 rti: bool = False):
        self.base, self.include, self.continuous, self.chat, self.rti = base, usage[0], usage[1], chat, rti
        self.fingerprint = system_fingerprint(state)
        # byte templates of a choice's middle chunks (not with per-chunk usage: it counts tokens)
        self.templates: dict | None = {} if envs.RLSERVE_SSE_TEMPLATES and not self.continuous and plain else None
        self.names = ("content" if chat else "text", "weight_version") + (("token_ids",) if rti else ())
        self.sent_text: dict[int, int] = {}  # choice index -> characters of its text sent
        self.sent_toks: dict[int, int] = {}  # choice index -> tokens sent (absent: no chunk of it yet)
        self.done: set[int] = set()  # choices whose last chunk went out

    def chunk(self, choice: dict, prompt_tokens: int, completion_tokens: int, **extra) -> bytes:
        """The chunk of ``choice`` (``extra``: more top-level keys, e.g. the first chat chunk's), as
        bytes (:func:`sse_bytes`)."""
        return sse_bytes(self.obj(choice, prompt_tokens, completion_tokens, **extra))

    def plain(self, out, base: int = 0) -> bytes | None:
        """The chunks of ``out`` (a cumulative ``RequestOutput``; its choice ``c`` is choice ``base +
        c.index`` of the stream) when each of its choices not done is a plain middle chunk or has
        nothing new -- not finished, its tokens of one weight version (:func:`chunk_versions`), not
        a completion choice's first chunk, its template can be filled -- recorded as sent (``b""``:
        nothing new); else None, nothing recorded (the caller builds all of ``out``'s chunks the
        general way, byte-equal for a plain choice: :mod:`rlserve.server.sse_template`). Only with
        :attr:`templates` on. Nothing new: no new text (chat: its tokens go with the next text, as
        the general way), nor tokens (completions)."""
        version = getattr(out, "weight_version", None)
        got = []
        for c in out.outputs:
            idx = base + c.index
            if idx in self.done:
                continue
            if c.finish_reason is not None:
                return None
            k0 = self.sent_toks.get(idx)
            if k0 is None and not self.chat:
                return None  # a completion choice's first chunk (prompt ids with return_token_ids)
            k0 = k0 or 0
            t0 = self.sent_text.get(idx, 0)
            if len(c.text) <= t0 and (self.chat or len(c.token_ids) == k0):
                continue
            if chunk_versions(c, k0) is not None:
                return None
            t = self.templates.get(idx, False)
            if t is False:
                t = self.templates[idx] = ChunkTemplate.build(lambda v, idx=idx: self.obj(self._middle(idx, v), 0, 0),
                                                              self.names)
            b = None if t is None else t.fill((c.text[t0:], version, c.token_ids[k0:]) if self.rti
                                              else (c.text[t0:], version))
            if b is None:
                return None
            got.append((idx, c, b))
        for idx, c, _ in got:
            self.sent_text[idx], self.sent_toks[idx] = len(c.text), len(c.token_ids)
        return got[0][2] if len(got) == 1 else b"".join(b for _, _, b in got)

    def _middle(self, idx: int, v: dict) -> dict:
        """A middle chunk's choice with the field values ``v`` (:attr:`names`)."""
        if self.chat:
            return chat_choice(idx, {"content": v["content"]}, None, None, v.get("token_ids"), v["weight_version"])
        return text_choice(idx, v["text"], None, None, None, None, v.get("token_ids"), v["weight_version"])

    def obj(self, choice: dict, prompt_tokens: int, completion_tokens: int, **extra) -> dict:
        """The chunk object of :meth:`chunk`, before encoding."""
        ch = dict(self.base, choices=[choice])
        if self.continuous:
            ch["usage"] = usage_json(prompt_tokens, completion_tokens)
            if self.chat:
                ch["usage"]["completion_tokens_details"] = None
        if not self.include and choice["finish_reason"] is not None:
            ch["system_fingerprint"] = self.fingerprint
        ch.update(extra)
        return ch

    def usage(self, prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None) -> bytes:
        """The last chunk of a stream with ``include_usage``: no choices, the request's usage
        (with ``completion_tokens_details.reasoning_tokens`` when counted)."""
        u = usage_json(prompt_tokens, completion_tokens)
        if reasoning_tokens is not None:
            u["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return sse_bytes(dict(self.base, choices=[], usage=u, system_fingerprint=self.fingerprint))


def chunk_versions(c, k0: int) -> list | None:
    """The weight versions of a middle chunk's tokens ``c.token_ids[k0:]``, in order, when more than one produced
    them (a chunk holding several steps' tokens across a weight update); else None (its ``weight_version`` says it
    all). From ``c.version_marks`` (:class:`~rlserve.engine.outputs.CompletionOutput`); None without them."""
    marks = getattr(c, "version_marks", None)
    if marks is None or len(marks) < 2:
        return None
    nt = len(c.token_ids)
    versions = [v for j, (start, v) in enumerate(marks)
                if start < nt and (j + 1 == len(marks) or marks[j + 1][0] > k0)]
    return versions if len(versions) > 1 else None


def text_choice(idx, text, lp, finish, stop, prompt_ids, token_ids, version) -> dict:
    """A completions chunk's choice, its keys in vLLM's order
    (:func:`rlserve.server.openai_stream.stream_completions`)."""
    return {"index": idx, "text": text, "logprobs": lp, "finish_reason": finish, "stop_reason": stop,
            "prompt_token_ids": prompt_ids, "token_ids": token_ids, "weight_version": version}


def chat_choice(i, delta, logprobs, finish, token_ids, version, **stop) -> dict:
    """A chat chunk's choice, its keys in vLLM's order (``stop``: ``stop_reason`` on a choice's last
    chunk only), plus rlserve's ``weight_version`` (:func:`rlserve.server.openai_stream.stream_chat`)."""
    return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish, **stop,
            "token_ids": token_ids, "weight_version": version}
