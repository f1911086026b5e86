"""The error answers of the HTTP routes, for the OpenAPI schema (``/openapi.json``, ``/docs``).

Every error body is OpenAI's ``{"error": {"message", "type", "param", "code"}}``
(:mod:`rlserve.server.errors`); :func:`error_answers` gives FastAPI's ``responses`` entry for a
set of status codes, which ``build_app`` attaches to each router.
"""

from __future__ import annotations

from typing import Optional, Union

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    """One error: ``code`` is a machine-readable string (e.g. ``"model_unavailable"``)."""

    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(BaseModel):
    """Every error answer of the server."""

    error: ErrorDetail


#: What each status means on this server's routes.
ERROR_MEANINGS = {
    400: "Refused: the request is invalid (a field named in `param`); nothing happened.",
    401: "Missing or wrong `Authorization: Bearer` key (`--api-key`; the admin and weight-sync routes: "
         "`--admin-key`).",
    404: "Unknown model name.",
    409: "Out of order (weight sync: no transfer engine, an update already open or none open, a stale "
         "session; an operator's /resume during an in-place update).",
    413: "The body is larger than `--max-request-body-bytes`.",
    500: "The server failed: the weight transfer broke (the group was torn down: initialise again), or an "
         "unexpected error (logged by the server).",
    503: "The model is unavailable (a failed in-place weight update: until a full update lands), the engine "
         "is not running, or a request was held by a pause for too long.",
    504: "Timed out (a rendezvous, a collective or a worker call ran past its timeout_s; a pause).",
}

#: The answers of generation routes (OpenAI, TRL).
GENERATION_ERRORS = (400, 401, 404, 413, 500, 503)
#: The answers of /tokenize and /detokenize (open, no engine involved).
TOKENIZE_ERRORS = (400, 404, 413, 500)
#: The answers of the admin routes (pause, resume, reset_prefix_cache, abort).
ADMIN_ERRORS = (400, 401, 409, 500, 504)
#: The answers of the weight-sync routes.
WEIGHT_SYNC_ERRORS = (400, 401, 409, 500, 503, 504)


def error_answers(codes) -> dict:
    """FastAPI ``responses=`` for ``codes``: each an :class:`ErrorResponse` with its meaning."""
    return {c: {"model": ErrorResponse, "description": ERROR_MEANINGS[c]} for c in codes}
