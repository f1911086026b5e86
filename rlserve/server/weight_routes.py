"""HTTP routes of the weight-sync control plane (owned by the transfer layer).

``make_weight_router(manager, dependencies=[...])`` returns a FastAPI ``APIRouter``; the server
mounts it behind its admin-key dependency. ``make_weight_manager(aengine, config, staging)``
builds the :class:`~rlserve.transfer.server.manager.WeightTransferManager` the router drives.

Routes (JSON bodies; every error is OpenAI-shaped ``{"error": {"message", "type", "param",
"code"}}``):

================================  ===================================  =========================
route                             body                                 answer
================================  ===================================  =========================
POST /init_weight_transfer_engine ``{"init_info": {...}}``             ``{"status", "worker_ranks"}``
POST /start_weight_update         ``{"update_info": {...}}`` (opt.)    ``{"status": "started"}``
POST /update_weights              ``{"update_info": {...}}``           ``{"tensors", "bytes", ...}``
POST /finish_weight_update        ``{"weight_version": "..."}`` (opt.) ``{"weight_version", ...}``
POST /shutdown_weight_transfer_engine                                  ``{"status": "ok"}``
GET  /weight_info                                                      version, state, last update
POST /weight_checker              ``{"compare": {name: sha256}}`` opt. ``{"checksums", "compare"}``
POST /init_communicator/          ``{"host", "port", "world_size"}``   TRL: answers at once
POST /update_named_param/         ``{"name", "dtype", "shape"}``       TRL: answers at once
POST /close_communicator/                                              TRL
================================  ===================================  =========================

Status codes: 400 refused (bad metadata: nothing changed), 409 out of order, 500 the transfer
failed (group torn down; re-initialise), 503 the model is unavailable, 504 a timeout.
Blocking work never runs on the event loop: the manager drives worker threads and awaits them,
every step bounded by ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Optional

from fastapi import APIRouter, Body, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, StrictInt, StrictStr

from rlserve.errors import (
    EngineDeadError,
    LoRAAdapterError,
    ModelUnavailableError,
    NoTransferEngineError,
    SleepMemoryError,
    SleepStateError,
    StaleSessionError,
    WeightUpdateError,
    WeightUpdateStateError,
)
from rlserve.engine.front.weight_state import WeightVersionInUseError
from rlserve.server.errors import error_body
from rlserve.transfer.errors import (DeviceOutOfMemoryError, TrainerUnreachableError, TransferTimeoutError,
                                     WeightTransferFailedError)

logger = logging.getLogger(__name__)

def error_status(exc: BaseException) -> tuple[int, str]:
    """HTTP status and error code of an exception raised by the manager."""
    if isinstance(exc, SleepStateError):  # sleep mode: e.g. a sync into weights a level-1 sleep holds
        return 409, exc.code
    if isinstance(exc, SleepMemoryError):
        return 503, "wake_up_out_of_memory"
    if isinstance(exc, WeightVersionInUseError):
        return 409, exc.code
    if isinstance(exc, DeviceOutOfMemoryError):  # before the coded 400s: an OOM is not the caller's input
        return 507, exc.code
    if isinstance(exc, TrainerUnreachableError):  # the trainer's store: a peer failed, not this server (502)
        return 502, "weight_transfer_unreachable"
    if isinstance(exc, LoRAAdapterError):  # an adapter-only update's commit refused the factors (rlserve.lora)
        return 400, "weight_update_refused"
    if isinstance(exc, WeightUpdateError) and isinstance(getattr(exc, "code", None), str):
        return 400, exc.code  # e.g. UnsafePickleError: "unsafe_pickle"
    if isinstance(exc, NoTransferEngineError):
        return 409, "no_transfer_engine"
    if isinstance(exc, StaleSessionError):
        return 409, "stale_session"
    if isinstance(exc, WeightUpdateStateError):
        return 409, "weight_update_out_of_order"
    if isinstance(exc, TransferTimeoutError):
        return 504, "weight_transfer_timeout"
    if isinstance(exc, WeightTransferFailedError):
        return 500, "weight_transfer_failed"
    if isinstance(exc, WeightUpdateError):
        return 400, "weight_update_refused"
    if isinstance(exc, ModelUnavailableError):
        return 503, getattr(exc, "code", None) or "model_unavailable"
    if isinstance(exc, EngineDeadError):  # the engine core died (being restarted, or for good)
        return 503, "engine_dead"
    if isinstance(exc, TimeoutError):
        return 504, "timeout"
    return 500, "internal_error"


def error_response(exc: BaseException) -> JSONResponse:
    status, code = error_status(exc)
    if status >= 500 and not isinstance(exc, (WeightUpdateError, TimeoutError, EngineDeadError)):
        logger.error("weight route failed", exc_info=exc)
    msg = str(exc) if isinstance(exc, (WeightUpdateError, ModelUnavailableError, TimeoutError, SleepStateError,
                                       SleepMemoryError, EngineDeadError, LoRAAdapterError)) \
        else f"{type(exc).__name__}: {exc}"
    return JSONResponse(error_body(status, msg, getattr(exc, "param", None), code), status_code=status)


async def _call(coro) -> Any:
    try:
        return await coro
    except Exception as e:  # noqa: BLE001 - every error becomes a JSON answer
        return error_response(e)


class InitBody(BaseModel):
    init_info: dict


class StartBody(BaseModel):
    update_info: Optional[dict] = None
    session: Optional[str] = None  # rlserve: the caller's init_info.session (stale ones get 409)


class UpdateBody(BaseModel):
    update_info: dict
    session: Optional[str] = None


class FinishBody(BaseModel):
    # strict: pydantic would read ``true`` as 1 (a version that goes backwards); it is refused
    weight_version: Optional[StrictStr | StrictInt] = None
    session: Optional[str] = None


class SyncBody(BaseModel):
    update_info: dict
    weight_version: Optional[StrictStr | StrictInt] = None
    session: Optional[str] = None


def _body_schema(model: type[BaseModel]) -> dict:
    """OpenAPI request body of a route that parses its JSON itself."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


async def _json_object(request: Request, required: tuple[str, ...]) -> dict:
    """The request's JSON object, parsed with the standard library (no pydantic pass over a body
    of hundreds of KB: the ipc handles of an 8B model are ~290 KB). Raises WeightUpdateError
    (400): not JSON, not an object, a required key missing or not an object."""
    raw = await request.body()
    try:
        # a large body (an 8B model's ipc handles are ~290 KB; a bad client can send far more) is
        # parsed off the event loop, so generation and /health keep being served meanwhile
        body = json.loads(raw) if len(raw) < (1 << 20) else await asyncio.to_thread(json.loads, raw)
    except ValueError as e:
        raise WeightUpdateError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise WeightUpdateError("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise WeightUpdateError("the request body must be a JSON object")
    for k in required:
        if not isinstance(body.get(k), dict):
            raise WeightUpdateError(f"the request body needs {k!r}: a JSON object", param=k)
    if "weight_version" in body and not isinstance(body["weight_version"], (str, int, type(None))):
        raise WeightUpdateError("weight_version must be a string, an integer or null", param="weight_version")
    return body


class CheckerBody(BaseModel):
    compare: Optional[dict[str, str]] = None


class TRLInitBody(BaseModel):
    host: str = "0.0.0.0"
    port: int
    world_size: Optional[int] = None
    client_device_uuid: Optional[str] = None
    wire: Optional[str] = None  # rlserve: "rlserve" from TRLWeightSyncClient; TRL's own client sends none


class TRLUpdateBody(BaseModel):
    name: str
    dtype: str
    shape: list[int]


def make_weight_manager(aengine, transfer_config: dict | None, staging: str = "none", check_finite: bool = True):
    """The manager for ``--weight-transfer-config`` / ``--weight-staging`` / ``--weight-check-finite``.

    Raises:
        ValueError: a bad config or staging mode (the server refuses to start).
    """
    from rlserve.transfer.server.manager import WeightTransferManager

    return WeightTransferManager(aengine, transfer_config, staging=staging, check_finite=check_finite)


def make_weight_router(manager, dependencies: list | None = None) -> APIRouter:
    """The weight-sync routes, each behind ``dependencies`` (the server's admin check)."""
    router = APIRouter(dependencies=list(dependencies or []), tags=["weight sync"])

    async def _checked(session, call):
        """``await call()`` once ``session`` (the body's, if any) is the current group's."""
        manager.check_session(session)
        return await call()

    @router.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(body: InitBody):
        """Workers join the transfer group; the trainer (rank 0, hosting the TCPStore) joins
        concurrently. Returns once everyone arrived (at most ``timeout_s``)."""
        return await _call(manager.init_engine(body.init_info))

    @router.post("/start_weight_update")
    async def start_weight_update(body: Optional[StartBody] = Body(None)):
        """Open an update session (optionally declaring the whole update for early validation)."""
        return await _call(_checked(body.session if body else None, lambda: manager.start_update(
            body.update_info if body else None)))

    async def _with_body(request: Request, run) -> Any:
        try:
            body = await _json_object(request, ("update_info",))
        except WeightUpdateError as e:
            return error_response(e)
        out = await _call(run(body))
        if isinstance(out, Response):
            return out
        # encoded here: FastAPI's jsonable_encoder walk of the answer is skipped on the hot routes
        return Response(json.dumps(out, default=jsonable_encoder).encode(), media_type="application/json")

    @router.post("/update_weights", openapi_extra=_body_schema(UpdateBody))
    async def update_weights(request: Request):
        """Receive (and load or stage) the tensors described by ``update_info``."""
        return await _with_body(request, lambda b: _checked(b.get("session"),
                                                            lambda: manager.update_weights(b["update_info"])))

    @router.post("/sync_weights", openapi_extra=_body_schema(SyncBody))
    async def sync_weights(request: Request):
        """start + update + finish in one call (rlserve extension; the SDK's ipc per-tensor path)."""
        def run(b):
            v = b.get("weight_version")
            return _checked(b.get("session"), lambda: manager.sync_weights(b["update_info"], v))
        return await _with_body(request, run)

    @router.post("/finish_weight_update")
    async def finish_weight_update(body: Optional[FinishBody] = Body(None)):
        """Commit: staged copy (if staging), prefix-cache reset, weight version."""
        v = None if body is None else body.weight_version
        return await _call(_checked(body.session if body else None, lambda: manager.finish_update(v)))

    @router.post("/shutdown_weight_transfer_engine")
    async def shutdown_weight_transfer_engine():
        return await _call(manager.shutdown_engine())

    @router.get("/weight_info")
    async def weight_info():
        return manager.weight_info()

    @router.post("/weight_checker")
    async def weight_checker(body: Optional[CheckerBody] = Body(None)):
        """sha256 per Hugging Face tensor of the served model; ``compare`` checks a baseline."""
        return await _call(manager.checksums(body.compare if body else None))

    # ---- TRL vllm-serve protocol ---------------------------------------------------------
    @router.post("/init_communicator/")
    async def init_communicator(body: TRLInitBody):
        return await _call(manager.trl_init_communicator(body.host, body.port, body.world_size,
                                                         body.client_device_uuid, body.wire))

    @router.post("/update_named_param/")
    async def update_named_param(body: TRLUpdateBody):
        return await _call(manager.trl_update_named_param(body.name, body.dtype, body.shape))

    @router.post("/close_communicator/")
    async def close_communicator():
        return await _call(manager.trl_close_communicator())

    return router
