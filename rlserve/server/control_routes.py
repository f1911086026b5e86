"""Health, info, metrics (open) and generation control (admin): pause/resume, prefix-cache
reset, abort. Also TRL ``vllm-serve``'s aliases (``/health/``, ``/get_world_size/``,
``/reset_prefix_cache/``) and its ``/generate/``."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Literal, Optional

from fastapi import APIRouter, Body, Query, Request
from fastapi.responses import JSONResponse, Response

import rlserve
from rlserve.engine.sampling_params import SamplingParams
from rlserve.errors import APIServerTimeoutError, WeightUpdateStateError
from rlserve.server.errors import APIError
from rlserve.server.metrics import CONTENT_TYPE_LATEST
from rlserve.server.openai_answers import weight_versions
from rlserve.server.openai_routes import ClientDisconnected, collect_final, routed_b64, unless_disconnected
from rlserve.server.protocol import AbortRequestsBody, TRLGenerateRequest
from rlserve.server.request_body import FastJSONRoute
from rlserve.server.server_info import _world_size, server_info
from rlserve.server.sleep_routes import sleep_info
from rlserve.server.weight_routes import error_response
from rlserve.server.logprob_json import finite
from rlserve.server.state import ServerState

#: what TRL's ``generation_kwargs`` may set: vLLM's SamplingParams fields (``lora_int_id`` is the
#: server's, from the request's model name; ``structured_outputs`` comes as guided_decoding_regex)
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)} - {"structured_outputs", "lora_int_id"}


def make_public_router(state: ServerState) -> APIRouter:
    """Routes open to anyone who can reach the server (read-only)."""
    router = APIRouter()

    async def health():
        aeng = state.aengine
        # an engine-core process killed a moment ago: the kernel knows now (a pending SIGKILL, an
        # exit begun or done), the reader thread that flips is_alive() a little later
        # (is_alive read once: one answer from one reading of the replicas' flags)
        alive = aeng.is_alive()
        ended = getattr(aeng, "ended_now", lambda: None)() if alive else None
        if ended is not None or not alive:
            # 503 as vLLM's /health for an engine that cannot serve; "restarting" while the
            # engine core comes back (--max-engine-restarts), "dead" once it will not
            reason = ended or (aeng.dead_reason() if hasattr(aeng, "dead_reason") else None)
            restarting = getattr(aeng, "will_restart" if ended is not None else "is_restarting", lambda: False)()
            return JSONResponse({"status": "restarting" if restarting else "dead",
                                 "reason": reason or "the engine is not running"}, status_code=503)
        # asleep: 200 (healthy, just asleep; a level-2 sleep's weights count as lost until the wake)
        if aeng.unavailable_reason is not None and not (hasattr(aeng, "is_sleeping") and aeng.is_sleeping()):
            return JSONResponse({"status": "unavailable", "reason": aeng.unavailable_reason,
                                 "code": getattr(aeng, "unavailable_code", None)}, status_code=503)
        return {"status": "ok"}

    router.add_api_route("/health", health, methods=["GET"])
    router.add_api_route("/health/", health, methods=["GET"], include_in_schema=False)

    async def get_world_size():
        return {"world_size": _world_size(state)}

    router.add_api_route("/get_world_size", get_world_size, methods=["GET"])
    router.add_api_route("/get_world_size/", get_world_size, methods=["GET"], include_in_schema=False)

    @router.get("/server_info")
    async def get_server_info(config_format: Optional[Literal["text", "json"]] = Query(None)):
        """rlserve's fields plus ``vllm_config`` (see :mod:`rlserve.server.server_info`)."""
        return server_info(state, config_format, await sleep_info(state))

    @router.get("/version")
    async def version():
        return {"version": rlserve.__version__}

    @router.get("/is_paused")
    async def is_paused():
        return {"is_paused": state.aengine.is_paused(), "mode": state.aengine.pause_mode}

    @router.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(state.aengine, await sleep_info(state)), media_type=CONTENT_TYPE_LATEST)

    return router


def _check_weight_update(state: ServerState, action: str) -> None:
    """409 when an open in-place weight update refuses ``action`` (see
    ``WeightTransferManager.operator_generation_control``)."""
    manager = getattr(state, "weight_manager", None)
    if manager is None:
        return
    try:
        manager.operator_generation_control(action)
    except WeightUpdateStateError as e:
        raise APIError(409, str(e), code="weight_update_in_progress") from None


async def operator_pause(state: ServerState, mode: str, clear_cache: bool = False,
                         timeout: Optional[float] = None) -> None:
    """``POST /pause``'s work: the pause, checked against an open in-place weight update under the
    pause lock (409 for ``wait``; nothing can open or end an update between the check and the
    pause). Raises APIError (400 bad mode, 409, 504 ``timeout`` seconds passed: the pause undone; 504
    ``api_server_timeout``: with ``--api-server-count N`` another API process, named, did not apply it)."""
    if mode not in ("abort", "wait", "keep"):
        raise APIError(400, f"mode must be abort, wait or keep, got {mode!r}", param="mode")
    try:
        await state.aengine.pause(mode=mode, clear_cache=clear_cache, timeout_s=timeout,
                                  check=lambda: _check_weight_update(state, f"pause:{mode}"))
    except (APIServerTimeoutError, asyncio.TimeoutError) as e:  # (distinct classes before Python 3.11)
        now = (f"generation stays paused by the earlier pause (mode={state.aengine.pause_mode})"
               if state.aengine.is_paused() else "it was undone: generation continues")
        if isinstance(e, APIServerTimeoutError):  # --api-server-count: a process that did not apply it, named
            raise APIError(504, f"pause(mode={mode}) did not take effect: {e}; {now}",
                           code="api_server_timeout") from None
        raise APIError(504, f"pause(mode={mode}) did not take effect within {timeout}s; {now}",
                       code="timeout") from None


async def operator_resume(state: ServerState) -> None:
    """``POST /resume``'s work, checked under the pause lock: 409 (APIError) while an in-place
    weight update is open -- that update's end resumes generation then."""
    await state.aengine.resume(check=lambda: _check_weight_update(state, "resume"))


def make_admin_router(state: ServerState, dependencies: list) -> APIRouter:
    """Generation control, behind ``dependencies`` (the admin check)."""
    router = APIRouter(dependencies=dependencies, route_class=FastJSONRoute)

    @router.post("/pause")
    async def pause(mode: str = Query("abort", description="abort (the default, as vLLM's and the SDK's "
                                                           "client.pause()) | wait | keep"),
                    clear_cache: bool = Query(False), timeout: Optional[float] = Query(None, gt=0)):
        """Pause generation (see AsyncEngine.pause). Returns when the pause has taken
        effect. 400 for an unknown mode; 504 when ``timeout`` seconds pass first: the pause
        is undone (generation resumes, or stays under an earlier pause), ``/is_paused`` says
        which."""
        await operator_pause(state, mode, clear_cache, timeout)
        return {"status": "paused", "mode": mode, "clear_cache": clear_cache}

    @router.post("/resume")
    async def resume():
        """Resume generation. 409 while an in-place weight update is open (it resumes at its end)."""
        await operator_resume(state)
        return {"status": "resumed"}

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        await state.aengine.reset_prefix_cache()
        return {"status": "ok", "success": True}

    @router.post("/reset_prefix_cache/", include_in_schema=False)
    async def reset_prefix_cache_trl():
        # TRL's sync is update_named_param... then reset_prefix_cache: land the queued tensors
        # (and commit them as a new weight version) before the cache is reset
        manager = getattr(state, "weight_manager", None)
        if manager is not None:
            try:
                await manager.trl_flush()
            except Exception as e:  # noqa: BLE001 - the weight routes' statuses (504 timeout, 500 failed...)
                return error_response(e)
        await state.aengine.reset_prefix_cache()
        return {"message": "Request received, resetting prefix cache status: True"}

    @router.post("/abort_requests")
    async def abort_requests(body: Optional[AbortRequestsBody] = Body(None)):
        """Abort requests by id (a response id such as ``cmpl-...`` aborts all of its
        prompts), or every request when no ids are given. Returns how many were aborted (with
        ``--api-server-count N``: of every API process, each counting its own)."""
        aeng = state.aengine
        if body is None or body.request_ids is None:
            n = await aeng.abort_all()
            return {"status": "ok", "aborted": n}
        ids = aeng.ids_matching(body.request_ids)
        await aeng.abort(ids)
        theirs = await aeng.front_sync.publish(abort_ids=list(body.request_ids))  # --api-server-count: their own
        return {"status": "ok", "aborted": len(ids) + theirs}

    return router


def _check_trl_logprobs(k, param: str) -> None:
    """TRL's ``/generate/`` answers the sampled token's logprob per token (``logprobs`` 0, what
    TRL's server fixed) or none (null): any other value is a 400 naming ``param``, not a top-k
    silently dropped (top-k logprobs: ``/v1/completions``, which TRL 1.16's VLLMClient uses).
    ``k`` is the request's value after pydantic's lax parsing (``"0"`` reads as 0)."""
    if k is not None and (isinstance(k, bool) or k != 0):
        raise APIError(400, f"{param} must be 0 (the sampled token's logprob, TRL's /generate/ protocol) or null "
                            f"(none), got {k!r}; top-k logprobs: POST /v1/completions with logprobs k", param=param)


def make_trl_router(state: ServerState, dependencies: list) -> APIRouter:
    """TRL ``vllm-serve``'s ``POST /generate/`` (behind the API-key check; its body decoded by msgspec
    where it parses it: :class:`~rlserve.server.request_body.FastJSONRoute`)."""
    router = APIRouter(dependencies=dependencies, route_class=FastJSONRoute)

    @router.post("/generate/")
    async def generate(body: TRLGenerateRequest, raw: Request):
        """TRL protocol: ``prompts`` (strings or token-id lists) or ``prompt_ids`` plus
        sampling fields → ``{"prompt_ids", "completion_ids", "logprobs", "weight_version"}``
        (plus ``routed_experts`` with routed-experts replay on);
        ``completion_ids`` holds ``n`` entries per prompt, prompt-major; ``logprobs`` holds
        the sampled tokens' logprobs (None when ``logprobs`` is null)."""
        state.check_available()
        if body.images:
            raise APIError(400, "images are not supported", param="images")
        # errors name the field the prompts came in (pydantic's own name prompt_ids' elements prompt_ids.N)
        key = "prompt_ids" if body.prompt_ids is not None else "prompts"
        prompts = body.prompt_ids if body.prompt_ids is not None else body.prompts
        if not prompts:
            raise APIError(400, "prompts (or prompt_ids) must be a non-empty list", param=key)
        extra = dict(body.generation_kwargs or {})
        unknown = sorted(set(extra) - _SAMPLING_FIELDS)
        if unknown:
            raise APIError(400, f"unknown generation_kwargs {unknown}; allowed: {sorted(_SAMPLING_FIELDS)}",
                           param=f"generation_kwargs.{unknown[0]}", code="unknown_field")
        _check_trl_logprobs(body.logprobs, "logprobs")
        if "logprobs" in extra:
            _check_trl_logprobs(extra["logprobs"], "generation_kwargs.logprobs")
        fields = dict(n=body.n, repetition_penalty=body.repetition_penalty, temperature=body.temperature,
                      top_p=body.top_p, top_k=body.top_k, min_p=body.min_p, max_tokens=body.max_tokens,
                      logprobs=body.logprobs, structured_outputs=await state.structured_outputs(body))
        fields.update(extra)
        names = {k: f"generation_kwargs.{k}" for k in extra}
        params = state.sampling_params(names, **fields)  # every value typed and in range, before any work
        state.limits.check_sequences(len(prompts), params.n, param=key)
        items = []
        all_ids = await state.tokenize_many(prompts, [f"{key}.{i}" for i in range(len(prompts))])
        for i, ids in enumerate(all_ids):
            ids = state.truncate(ids, body.truncate_prompt_tokens)  # vLLM's rule (-1: max_model_len; 0, < -1: 400)
            max_tokens = state.check_length(len(ids), params.max_tokens, param=names.get("max_tokens", "max_tokens"),
                                            prompt_param=f"{key}.{i}")
            items.append((ids, dataclasses.replace(params, max_tokens=max_tokens)))  # (checked: an int in range)
        rid = f"trl-{uuid.uuid4().hex[:24]}"
        gens = [state.generate(ids, params, f"{rid}-{i}", "trl_generate", stream=False)
                for i, (ids, params) in enumerate(items)]
        try:
            finals = await unless_disconnected(raw, collect_final(gens))
        except ClientDisconnected:
            return Response(status_code=499)
        completion_ids, logprobs = [], []
        for out in finals:
            for c in sorted(out.outputs, key=lambda c: c.index):
                completion_ids.append(list(c.token_ids))
                if params.logprobs is not None:
                    logprobs.append([finite(d.get(t)) if d else None for t, d in zip(c.token_ids, c.logprobs or [])])
        version, versions = weight_versions(finals)
        answer = {
            "prompt_ids": [list(ids) for ids, _ in items],
            "completion_ids": completion_ids,
            "logprobs": logprobs if params.logprobs is not None else None,
            "weight_version": state.aengine.weight_version if version is None else version,
            "weight_versions": versions,
        }
        if getattr(state.aengine.config, "enable_return_routed_experts", False):
            # replay on: per completion (same order as completion_ids) vLLM's base64 .npy
            answer["routed_experts"] = [routed_b64(c) for out in finals
                                        for c in sorted(out.outputs, key=lambda c: c.index)]
        return answer

    return router
