"""Byte templates of a stream's SSE chunks (issue 37): most chunks of a stream differ only in a few
fields (a completions chunk in its ``text``, a chat chunk in its ``delta.content``, both in
``weight_version`` and, with ``return_token_ids``, ``token_ids``), so a stream encodes its usual
chunk once, with a sentinel in each such field, and later chunks are the template's constant byte
pieces with only those fields' JSON spliced in: no per-chunk dict of the whole chunk, no encoding of
its constant keys.

Byte-equal to the general encoder (:func:`rlserve.server.openai_stream.sse_bytes` of the same
chunk) by construction: the template IS the general encoder's output with sentinels, a field's
JSON (msgspec's) does not depend on where in the object it sits, and a value msgspec cannot encode
(a lone surrogate, where the general encoder falls back to ``json.dumps`` for the whole chunk) makes
:meth:`ChunkTemplate.fill` return None, so the caller builds that chunk the general way.
``RLSERVE_SSE_TEMPLATES=0`` turns the templates off (:func:`rlserve.envs.sse_templates`: A/B)."""

from __future__ import annotations

import uuid
from typing import Callable

import msgspec

_JSON = msgspec.json.Encoder()
#: what msgspec raises for a value it cannot encode (a lone surrogate): the general encoder's fallback
ENCODE_ERRORS = (msgspec.EncodeError, TypeError, UnicodeError)
_TAG = uuid.uuid4().hex[:12]  # per process: a client cannot put a sentinel into a model name or id


def encode_json(obj) -> bytes:
    """``obj`` as compact JSON (msgspec), the one encoder of streamed chunks and their templates.
    Raises one of :data:`ENCODE_ERRORS` for what msgspec cannot encode."""
    return _JSON.encode(obj)


def sse_data_bytes(obj) -> bytes:
    """One server-sent event carrying ``obj``: ``b"data: " + JSON + b"\\n\\n"`` (:func:`encode_json`;
    raises as it does)."""
    return b"data: " + _JSON.encode(obj) + b"\n\n"


def sentinel(name: str) -> str:
    """The placeholder string of field ``name`` (ASCII letters, digits and ``@``: JSON-encoded as
    itself between quotes)."""
    return f"@rlserve-{name}-{_TAG}@"


class ChunkTemplate:
    """One kind of chunk as constant byte pieces around its ``fields``' values.

    Args:
        pieces: ``len(order) + 1`` byte strings.
        order: for each gap between two pieces, the index of its value in :meth:`fill`'s ``values``.
    """

    __slots__ = ("pieces", "order")

    def __init__(self, pieces: list[bytes], order: list[int]):
        self.pieces, self.order = pieces, order

    @classmethod
    def build(cls, render: Callable[[dict], object], names: tuple[str, ...]) -> "ChunkTemplate | None":
        """The template of ``render(values)`` (the chunk object, a dict, as the general encoder gets
        it; ``values``: name -> that field's sentinel), encoded ``b"data: " + JSON + b"\\n\\n"``. None
        when a sentinel is not found exactly once or msgspec cannot encode the rest (the chunk
        then always takes the general encoder)."""
        try:
            raw = sse_data_bytes(render({n: sentinel(n) for n in names}))
        except ENCODE_ERRORS:
            return None
        cuts = []
        for k, n in enumerate(names):
            token = b'"' + sentinel(n).encode() + b'"'
            at = raw.find(token)
            if at < 0 or raw.find(token, at + 1) >= 0:
                return None
            cuts.append((at, len(token), k))
        cuts.sort()
        pieces, order, pos = [], [], 0
        for at, size, k in cuts:
            pieces.append(raw[pos:at])
            order.append(k)
            pos = at + size
        pieces.append(raw[pos:])
        return cls(pieces, order)

    def fill(self, values: tuple) -> bytes | None:
        """The chunk with ``values`` (in :meth:`build`'s ``names`` order) in its fields; None when
        msgspec cannot encode one of them (the caller encodes that chunk the general way)."""
        p, enc = self.pieces, _JSON.encode
        try:
            if len(p) == 3:  # text and weight version: the usual chunk, unrolled
                i, j = self.order
                return b"".join((p[0], enc(values[i]), p[1], enc(values[j]), p[2]))
            out = [p[0]]
            for k, j in enumerate(self.order):
                out.append(enc(values[j]))
                out.append(p[k + 1])
        except ENCODE_ERRORS:
            return None
        return b"".join(out)
