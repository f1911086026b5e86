"""Text a client sends must be valid Unicode, wherever it is in the body.

JSON may escape half of a UTF-16 surrogate pair alone (``"\\ud800"``); Python's ``json`` reads it
as a lone surrogate, which no tokenizer reads, no UTF-8 answer can echo and MessagePack (the
engine core's wire) cannot carry. :class:`LoneSurrogateCheck` refuses such a body with one 400
(``code`` ``invalid_text``, ``param`` the dotted path of the string: ``stop.0``, ``model``,
``messages.2.content``, ``generation_kwargs.stop.0``) before any route parses it, so no route has
to remember to check its own strings. :func:`check_text` is the same rule for one string.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from rlserve.server.errors import APIError, send_error
from rlserve.server.request_body import loads, remember

_SURROGATE = re.compile("[\ud800-\udfff]")
#: bytes of a JSON body that may decode to a surrogate: the escape of one (``\\uD800``-``\\uDFFF``;
#: a pair's halves too, so an emoji escaped by the client makes the body parsed here: once, the
#: route's :class:`~rlserve.server.request_body.FastJSONRequest` takes the value), or
#: the UTF-8-style bytes of one (``json.loads`` decodes bytes with ``surrogatepass``). Only a
#: suspicion: the parsed body decides (``"\\\\ud800"`` is a backslash and text).
_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_RAW = re.compile(rb"\xed[\xa0-\xbf]")
#: bodies at least this large are scanned off the event loop (bytes): a 480 KB body of escaped
#: CJK text (every character a \\uXXXX) took 5.9 ms to scan on the 2-core test host
_THREAD_BYTES = 256 << 10


def surrogate_message(param: str, text: str, at: int) -> str:
    """The message for a lone surrogate at character ``at`` of ``text`` (field ``param``)."""
    return (f"{param}: a lone UTF-16 surrogate (U+{ord(text[at]):04X}) at character {at} is not valid Unicode "
            "text; send the character itself (or both halves of its surrogate pair)")


def check_text(text: str, param: str) -> None:
    """Refuse text that is not valid Unicode (a lone UTF-16 surrogate).

    Raises:
        APIError 400 (``code`` ``invalid_text``) naming ``param`` and the position.
    """
    m = _SURROGATE.search(text)
    if m is not None:
        raise APIError(400, surrogate_message(param, text, m.start()), param=param, code="invalid_text")


def _printable(key: str) -> str:
    return key.encode("utf-8", "backslashreplace").decode("utf-8")


def find_lone_surrogate(value) -> tuple[str, str, int] | None:
    """The first string (or object key) of a parsed JSON value that holds a lone surrogate, in
    document order: ``(dotted path, the string, character index)``, else None. Iterative (the
    depth of the value is whatever ``json.loads`` accepted)."""
    stack: list = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            m = _SURROGATE.search(v)
            if m is not None:
                return path or "body", v, m.start()
        elif isinstance(v, dict):
            children = []
            for k, item in v.items():
                sub = f"{path}.{_printable(k)}" if path else _printable(k)
                m = _SURROGATE.search(k)
                if m is not None:
                    return sub, k, m.start()
                children.append((sub, item))
            stack.extend(reversed(children))
        elif isinstance(v, list):
            stack.extend(reversed([(f"{path}.{i}" if path else str(i), item) for i, item in enumerate(v)]))
    return None


def _suspect(body: bytes) -> bool:
    """Whether ``body`` may hold a surrogate once parsed (see :data:`_ESCAPE`). Each test starts
    with a ``memchr``-fast one: a body without a backslash (token ids, raw UTF-8 text) is not
    searched for escapes."""
    if json.detect_encoding(body) != "utf-8":  # UTF-16 / 32: may carry lone surrogates raw
        return True
    if b"\xed" in body and _RAW.search(body) is not None:
        return True
    return b"\\" in body and _ESCAPE.search(body) is not None


_NOT_PARSED = object()


def _scan(body: bytes) -> tuple[tuple[str, str, int] | None, Any]:
    """``(the first lone surrogate of the parsed body or None, the parsed value)``; the value is
    :data:`_NOT_PARSED` where the body was not parsed (not suspect, or not JSON: the route answers that)."""
    if not _suspect(body):
        return None, _NOT_PARSED
    try:
        value = loads(body)  # json.loads' value or error, by msgspec where it parses (an escaped emoji's pair)
    except (ValueError, RecursionError):  # not JSON: the route parses it again and answers that
        return None, _NOT_PARSED
    return find_lone_surrogate(value), value


class LoneSurrogateCheck:
    """ASGI middleware: a request body that is JSON holding a lone surrogate in any string or key
    is answered 400 (``invalid_text``, ``param`` its path) before the app sees it. The body is
    read whole (the routes read it whole anyway; put this inside the body-size limit), scanned
    as bytes (:func:`_suspect`; a body without a surrogate's escape or bytes is not parsed here),
    and handed on unchanged; a body parsed here without a lone surrogate leaves its value in the
    scope (:func:`rlserve.server.request_body.remember`), so a FastJSONRoute does not parse it again.

    Args:
        app: the ASGI app.
        on_error: ``on_error(status)`` for each refusal (metrics), optional.
    """

    def __init__(self, app, on_error=None):
        self.app = app
        self.on_error = on_error

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        chunks, first = [], None
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # the client left mid-body: the app sees that
                first = msg
                break
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        if first is None and body:
            found, value = await asyncio.to_thread(_scan, body) if len(body) >= _THREAD_BYTES else _scan(body)
            if found is not None:
                return await self._refuse(send, *found)
            if value is not _NOT_PARSED:  # the route's FastJSONRequest takes it instead of parsing again
                remember(scope, body, value)
        pending = [{"type": "http.request", "body": body, "more_body": False}] + ([first] if first else [])

        async def replay():
            return pending.pop(0) if pending else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send, param: str, text: str, at: int) -> None:
        if self.on_error is not None:
            self.on_error(400)
        await send_error(send, 400, surrogate_message(param, text, at), param=param, code="invalid_text")
