"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}``.

Every error the server returns goes through here, so clients written for the OpenAI API
(the official ``openai`` package included) parse them: it raises ``BadRequestError`` (400),
``AuthenticationError`` (401), ``PermissionDeniedError`` (403), ``NotFoundError`` (404),
``ConflictError`` (409), ``InternalServerError`` (500, 503).

``code`` is always a string (OpenAI's schema: a string or null): the route's own code where it
has one (``model_not_found``, ``context_length_exceeded``, ``unknown_field`` ...), else the
status's default from :data:`DEFAULT_CODES`.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rlserve.errors import (
    InvalidRequestError,
    LoRAAdapterNotFoundError,
    RLServeError,
    ModelSleepingError,
    ModelUnavailableError,
    SleepMemoryError,
    SleepStateError,
    WeightUpdateError,
    WeightUpdateStateError,
)

logger = logging.getLogger(__name__)

#: ``code`` of a 500 from an unexpected exception (logged by :func:`exception_to_error`).
INTERNAL_ERROR = "internal_error"

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    500: "internal_server_error",
    502: "bad_gateway_error",  # a peer the server relies on failed (weight_transfer_unreachable)
    503: "service_unavailable_error",
    504: "timeout_error",
    507: "insufficient_storage_error",
}

#: the ``code`` of an error whose raiser gave none (by HTTP status)
DEFAULT_CODES = {
    400: "invalid_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "request_too_large",
    422: "invalid_request",
    429: "rate_limited",
    499: "client_closed_request",
    500: "internal_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "timeout",
}


def default_code(status: int) -> str:
    """The string ``code`` for an error of ``status`` that carries no code of its own."""
    return DEFAULT_CODES.get(status, "error" if status >= 500 else "invalid_request")


class APIError(Exception):
    """Raise from a route to answer with an OpenAI-style error.

    Args:
        status: HTTP status code.
        message: human-readable explanation (what was wrong and how to fix it).
        param: the offending request field, if any.
        code: machine-readable code (e.g. "model_not_found", "invalid_api_key"); default
            from the status (:func:`default_code`).
        type: error type (default from the status).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = str(code) if code is not None else default_code(status)
        self.type = type or _TYPES.get(status, "error")

    def body(self) -> dict:
        """``{"error": {message, type, param, code}}`` (also what an SSE stream sends in-band)."""
        return error_body(self.status, self.message, self.param, self.code, self.type)


def encodable(text):
    """``text`` as UTF-8 can carry it: a lone UTF-16 surrogate (which a client's own string may
    bring into a message) is written out as the six characters ``\\udXXX``. Anything but a
    ``str`` is returned as it is."""
    if not isinstance(text, str):
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(status: int, message: str, param=None, code=None, type: str | None = None) -> dict:
    """The OpenAI-shaped body of an error; ``code`` defaults to :func:`default_code` of the status.
    Every string is :func:`encodable`: building an error answer never fails."""
    return {"error": {"message": encodable(message), "type": encodable(type or _TYPES.get(status, "error")),
                      "param": encodable(param),
                      "code": encodable(str(code)) if code is not None else default_code(status)}}


#: the weight-transfer control routes, served only with --weight-transfer-config
WEIGHT_TRANSFER_PATHS = frozenset({
    "/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
    "/shutdown_weight_transfer_engine", "/weight_info", "/weight_checker", "/init_communicator",
    "/update_named_param", "/close_communicator",
})

#: vLLM's LoRA routes, served with --enable-lora (vLLM 0.32: with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1;
#: without it its server has no such route either: a 404)
LORA_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


def _error_response(status: int, message: str, param=None, code=None, type: str | None = None,
                    headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code, type), status_code=status, headers=headers)


error_response = _error_response


async def send_error(send, status: int, message: str, param=None, code=None,
                     headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    """Answer an ASGI request from a middleware in front of the app (no route, no ``Request``) with
    :func:`error_body`, encoded as every route's error is (``JSONResponse``'s compact JSON), plus
    ``headers`` (raw ASGI pairs, e.g. ``(b"connection", b"close")``)."""
    body = JSONResponse(error_body(status, message, param, code)).body
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


def exception_to_error(exc: BaseException) -> APIError:
    """Map an exception raised while serving a request onto an :class:`APIError`."""
    from rlserve.errors import APIServerTimeoutError, EngineDeadError, EngineStepError

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, LoRAAdapterNotFoundError):
        return APIError(404, str(exc), code="lora_adapter_not_found")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc))
    if isinstance(exc, ModelSleepingError):
        return APIError(503, str(exc), code="model_sleeping")
    if isinstance(exc, SleepStateError):
        return APIError(400 if exc.code == "sleep_mode_disabled" else 409, str(exc), code=exc.code)
    if isinstance(exc, SleepMemoryError):
        return APIError(503, str(exc), code="wake_up_out_of_memory")
    if isinstance(exc, ModelUnavailableError):
        return APIError(503, f"the model is unavailable: {exc}", code=getattr(exc, "code", None) or "model_unavailable")
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"the engine is not running: {exc}", code="engine_dead")
    if isinstance(exc, WeightUpdateStateError):
        return APIError(409, str(exc))
    if isinstance(exc, WeightUpdateError):
        return APIError(400, str(exc))
    if isinstance(exc, EngineStepError):
        return APIError(500, str(exc), code="engine_error")
    if isinstance(exc, APIServerTimeoutError):
        return APIError(504, str(exc), code="api_server_timeout")
    # Anything else is a bug of the server, not of the request (inputs are validated explicitly:
    # pydantic models, ServerState.tokenize, ...): logged with its traceback, answered 500
    # without the exception's text (no internals in answers).
    logger.error("unexpected %s while serving a request", type(exc).__name__, exc_info=exc)
    return APIError(500, "internal server error: the server failed on this request (its log has the details)",
                    code=INTERNAL_ERROR)


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "bytes"}


def _loc_to_param(loc) -> str | None:
    """pydantic error location → dotted field name, cut at the first union-member tag
    (``('body', 'prompt', 'list[int]', 3)`` → ``prompt``)."""
    parts = []
    for p in loc:
        if p in ("body", "query", "path", "header") and not parts:
            continue
        if isinstance(p, str) and (p in _TYPE_TAGS or "[" in p or "-" in p):
            break
        parts.append(str(p))
    return ".".join(parts) if parts else None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None, str]:
    """``(message, param, code)`` of a request that failed pydantic validation. An unknown
    field (pydantic ``extra_forbidden``) is ``unknown_field`` and named first; a missing one
    ``missing_field``; anything else ``invalid_value``."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None, "invalid_value"
    for e in errors:
        if e.get("type") == "json_invalid":
            ctx = e.get("ctx") or {}
            return f"request body is not valid JSON: {ctx.get('error', 'parse error')}", None, "invalid_json"
    unknown = [".".join(filter(None, [_loc_to_param(e["loc"][:-1]), str(e["loc"][-1])]))
               for e in errors if e.get("type") == "extra_forbidden" and e.get("loc")]
    if unknown:
        names = ", ".join(repr(u) for u in unknown[:5])
        return (f"unknown field{'s' if len(unknown) > 1 else ''} {names}: rlserve does not implement "
                f"{'them' if len(unknown) > 1 else 'it'} (see the README's list of supported request fields)",
                unknown[0], "unknown_field")
    by_param: dict = {}
    for e in errors:
        by_param.setdefault(_loc_to_param(e.get("loc", ())), []).append(e)
    msgs = []
    for param, errs in list(by_param.items())[:5]:
        e = errs[0]
        got = e.get("input")
        got_s = json.dumps(got)[:80] if _jsonable(got) else repr(got)[:80]
        if e.get("type") == "missing":
            msgs.append("the request needs a JSON body" if param is None else f"missing required field {param!r}")
        elif param is None and isinstance(got, (bytes, bytearray)):
            # FastAPI hands the raw bytes over when the Content-Type is not JSON (curl -d sends
            # application/x-www-form-urlencoded): say so rather than "not a dictionary".
            msgs.append("the body must be sent as JSON with the header Content-Type: application/json "
                        f"(curl: -H 'Content-Type: application/json'); got {got[:40]!r}")
        elif len(errs) > 1:  # a union: no member matched
            msgs.append(f"{param or 'body'}: invalid type or value (got {got_s}){_closest_member(errs)}")
        else:  # a validator's ValueError: its own text, without pydantic's "Value error, " prefix
            msg = str(e.get("msg"))
            msg = msg.removeprefix("Value error, ") if e.get("type") == "value_error" else msg
            msgs.append(f"{param or 'body'}: {msg} (got {got_s})")
    first = next(iter(by_param.values()))[0]
    code = "missing_field" if first.get("type") == "missing" else "invalid_value"
    return "; ".join(msgs), next(iter(by_param)), code


def _closest_member(errs: list[dict]) -> str:
    """For a union field no member of which matched: what was wrong for the member that came
    closest (the fewest errors, then the deepest location), e.g. ``prompt: [1, true, 3]`` ->
    ``"; as list[int]: prompt.1: Input should be a valid integer (got true)"``; ``""`` when the
    errors carry no union-member tag."""
    by_member: dict = {}
    for e in errs:
        tag = next((p for p in e.get("loc", ()) if isinstance(p, str) and ("[" in p or p in _TYPE_TAGS)), None)
        if tag is not None:
            by_member.setdefault(tag, []).append(e)
    if not by_member:
        return ""
    tag, member_errs = min(by_member.items(), key=lambda kv: (len(kv[1]), -max(len(e.get("loc", ())) for e in kv[1])))
    e = max(member_errs, key=lambda e: len(e.get("loc", ())))
    where = ".".join(str(p) for p in e["loc"] if p not in ("body", tag))
    got = e.get("input")
    got_s = json.dumps(got)[:40] if _jsonable(got) else repr(got)[:40]
    return f"; as {tag}: {where}: {e.get('msg')} (got {got_s})"


def _jsonable(x) -> bool:
    try:
        json.dumps(x)
        return True
    except (TypeError, ValueError):
        return False


def install_error_handlers(app: FastAPI, on_error=None) -> None:
    """Make every error OpenAI-shaped: validation (422 → 400), HTTP errors, our errors.
    ``on_error(status)`` is called for each error answered (metrics)."""

    def error_response(status, *args, **kwargs):
        if on_error is not None:
            try:
                on_error(status)
            except Exception:  # noqa: BLE001 - metrics must not break error replies
                pass
        return _error_response(status, *args, **kwargs)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param, code = _validation_message(exc)
        return error_response(400, message, param=param, code=code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404 and detail == "Not Found":
            detail = f"no route {request.method} {request.url.path}"
            if request.url.path.rstrip("/") in WEIGHT_TRANSFER_PATHS:
                detail += (" (weight transfer is off: start the server with --weight-transfer-config "
                           "'{\"backend\": \"gloo\"}' (or nccl / ipc))")
            elif request.url.path.rstrip("/") in LORA_PATHS:
                detail += " (LoRA adapters are off: start the server with --enable-lora; pip install 'rlserve[lora]')"
        return error_response(exc.status_code, detail, headers=getattr(exc, "headers", None))

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.type)

    @app.exception_handler(RLServeError)
    async def _ours(request: Request, exc: RLServeError):
        err = exception_to_error(exc)
        return error_response(err.status, err.message, err.param, err.code, err.type)

    @app.exception_handler(Exception)
    async def _other(request: Request, exc: Exception):
        err = exception_to_error(exc)
        if err.status >= 500 and err.code != INTERNAL_ERROR:  # (an unexpected one was logged)
            logger.error("error serving %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(err.status, err.message, err.param, err.code, err.type)
