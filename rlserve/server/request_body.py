"""JSON request bodies decoded by msgspec, with every answer unchanged (issue 37: admitting a
request cost the API process ~1 ms, BENCHMARKS.md H33).

FastAPI reads a JSON body with ``json.loads`` (the standard library: ~75 us for a body of 512
token ids on the 2-core test host; msgspec: ~16 us). :class:`FastJSONRoute` is the route class of
the routers with POST routes (``APIRouter(route_class=FastJSONRoute)``: generation, TRL ``/generate/``,
tokenize, responses, LoRA, admin control, sleep; not the weight-sync routes, which parse their bodies
themselves, and not the public GET routes): its requests' ``json()`` is
:func:`loads`, which returns what ``json.loads`` would return, or raises what it would raise,
because it falls back to ``json.loads`` for every body msgspec does not take (msgspec refuses
``NaN`` / ``Infinity``, numbers that overflow a float, escaped lone surrogates, a UTF-8 BOM,
UTF-16/32 bodies, where ``json.loads`` returns a value: the fallback returns that value; and
every malformed body: the fallback raises ``json.JSONDecodeError`` at the same position, which
FastAPI answers as before). Where both parse, the values are equal (``tests/test_request_body.py``
checks the cases that differ between the two parsers). Everything else of FastAPI's handling
(content type, validation, dependencies, the OpenAPI schema) is untouched.

A body that a middleware already parsed with :func:`loads` (:class:`rlserve.server.text_check.LoneSurrogateCheck`
parses a body that may hold a surrogate: any escaped surrogate pair, i.e. every emoji a client's ``json.dumps``
escaped) is not parsed again: the middleware leaves ``(body, value)`` in the ASGI scope under :data:`PARSED_KEY`
(:func:`remember`) and :class:`FastJSONRequest` takes the value for a body equal to it.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
from fastapi import Request
from fastapi.routing import APIRoute

_decode = msgspec.json.Decoder().decode
#: a body with at least this many ``[`` and ``{`` (a bound on its nesting depth) is read by
#: ``json.loads``: both parsers stop at the interpreter's recursion limit, but at a depth that
#: depends on the stack they are called from, which is not the same here and in FastAPI
MAX_BRACKETS = 256
#: the ASGI scope key of a body parsed before the route: ``(body bytes, its value)`` (:func:`remember`)
PARSED_KEY = "rlserve.parsed_body"


def loads(body: bytes) -> Any:
    """``json.loads(body)``: its value (msgspec's, where msgspec parses the body: the same value),
    or its exception (``json.JSONDecodeError``, ``UnicodeDecodeError``, ``ValueError`` for an
    integer of more than 4300 digits, ``RecursionError``)."""
    if body.count(b"[") + body.count(b"{") < MAX_BRACKETS:
        try:
            return _decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError):  # not msgspec's JSON: json.loads decides
            pass
    return json.loads(body)


def remember(scope: dict, body: bytes, value: Any) -> None:
    """Leave ``value``, :func:`loads` of ``body``, in the ASGI ``scope`` for the route's :class:`FastJSONRequest`
    (a middleware that parsed the body whole before the app). The value is shared, not copied: neither side may
    change it."""
    scope[PARSED_KEY] = (body, value)


class FastJSONRequest(Request):
    """A request whose ``json()`` is :func:`loads` (cached as Starlette's is), or the value a middleware left
    for this very body (:func:`remember`; compared byte for byte, so a body changed since is parsed)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            parsed = self.scope.get(PARSED_KEY)
            self._json = parsed[1] if parsed is not None and parsed[0] == body else loads(body)
        return self._json


class FastJSONRoute(APIRoute):
    """FastAPI's route, handed a :class:`FastJSONRequest` (so its body is decoded by :func:`loads`);
    everything else is FastAPI's own handling."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def app(request: Request):
            return await handler(FastJSONRequest(request.scope, request.receive))

        return app
