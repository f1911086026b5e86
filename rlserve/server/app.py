"""The FastAPI application: OpenAI routes (``rlserve.server.openai_routes``, the Responses API of
``rlserve.server.responses_routes``), TRL routes, control routes, metrics, and (with
``--weight-transfer-config``) the weight-sync routes of ``rlserve.server.weight_routes``.

Route protection:

=========================================  ==================
``/v1/*``, ``/generate/``                   ``--api-key``
``/pause``, ``/resume``,                    ``--admin-key`` (or loopback bind,
``/reset_prefix_cache[/]``,                 or ``--insecure-control-routes``)
``/abort_requests``, weight-sync routes,
``/sleep``, ``/wake_up``,
``/v1/load_lora_adapter``,
``/v1/unload_lora_adapter``
``/health[/]``, ``/get_world_size[/]``,     open
``/server_info``, ``/is_paused``,
``/is_sleeping``,
``/metrics``, ``/version``,
``/tokenize``, ``/detokenize`` (as vLLM)
=========================================  ==================
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import Depends, FastAPI

import rlserve
from rlserve.server.auth import require_admin, require_api_key
from rlserve.server.control_routes import make_admin_router, make_public_router, make_trl_router
from rlserve.server.errors import install_error_handlers
from rlserve.server.limits import BodySizeLimit
from rlserve.server import metrics_mp
from rlserve.server.metrics import ServerMetrics
from rlserve.server.openai_routes import make_openai_router
from rlserve.server.responses_routes import make_responses_router
from rlserve.server.sleep_routes import connect_weight_manager, make_sleep_routers
from rlserve.server.openapi import ADMIN_ERRORS, GENERATION_ERRORS, TOKENIZE_ERRORS, WEIGHT_SYNC_ERRORS, \
    error_answers
from rlserve.server.state import ServerSettings, ServerState
from rlserve.server.text_check import LoneSurrogateCheck
from rlserve.server.tokenize_routes import make_tokenize_router

logger = logging.getLogger(__name__)


def build_app(aengine, settings: ServerSettings, weight_manager=None) -> FastAPI:
    """Build the HTTP app around a started :class:`~rlserve.engine.front.async_engine.AsyncEngine`.

    Args:
        aengine: the async engine (owned by the caller, who shuts it down).
        settings: HTTP settings (keys, names, bind address, weight-transfer config).
        weight_manager: the weight-sync manager to expose; default: built from
            ``settings.weight_transfer_config`` when it is set (see :func:`mount_weight_routes`).

    Returns:
        the FastAPI app; ``app.state.rlserve`` is the :class:`ServerState`.
    """
    metrics = ServerMetrics(settings.served_model_names[0], int(aengine.engine.max_model_len),
                            multiprocess_dir=settings.metrics_multiproc_dir)
    state = ServerState(aengine, settings, metrics)
    app = FastAPI(title="rlserve", version=rlserve.__version__)
    app.state.rlserve = state
    install_error_handlers(app, on_error=metrics.record_error)
    # the last added runs first: the size limit, then the text check over the (bounded) body
    app.add_middleware(LoneSurrogateCheck, on_error=metrics.record_error)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_body_bytes, on_error=metrics.record_error)
    # without --api-key the check is a no-op: left out, FastAPI does not solve it for every request
    api_deps = [Depends(require_api_key(settings))] if settings.api_key is not None else []
    admin_deps = [Depends(require_admin(settings))]
    # the generation routes first: a request is matched against the routes in order (issue 37's
    # admission profile: the public router's eight were matched before /v1/completions; no path is in both)
    app.include_router(make_openai_router(state, api_deps), responses=error_answers(GENERATION_ERRORS))
    app.include_router(make_public_router(state))
    app.include_router(make_responses_router(state, api_deps), responses=error_answers(GENERATION_ERRORS))
    app.include_router(make_tokenize_router(state), responses=error_answers(TOKENIZE_ERRORS))
    app.include_router(make_trl_router(state, api_deps), responses=error_answers(GENERATION_ERRORS))
    app.include_router(make_admin_router(state, admin_deps), responses=error_answers(ADMIN_ERRORS))
    if settings.weight_transfer_config is not None or weight_manager is not None:
        mount_weight_routes(app, state, admin_deps, weight_manager)
    sleep_public, sleep_admin = make_sleep_routers(state, admin_deps)
    app.include_router(sleep_public)
    app.include_router(sleep_admin, responses=error_answers(ADMIN_ERRORS))
    connect_weight_manager(state)

    async def bind_serving_loop():  # the engine's loop from the start, whatever other loop calls in later
        aengine.bind_loop()

    app.router.on_startup.append(bind_serving_loop)

    async def start_template_workers():  # warm before the first request needs one
        await asyncio.to_thread(state.start_template_workers)

    app.router.on_startup.append(start_template_workers)
    if metrics.multiprocess:  # this process's live counts for the others' scrapes (metrics_mp)
        publisher: list = []

        async def start_publisher():
            publisher.append(asyncio.create_task(metrics_mp.publish_live(metrics, aengine)))

        async def stop_publisher():
            for task in publisher:
                task.cancel()
        app.router.on_startup.append(start_publisher)
        app.router.on_shutdown.append(stop_publisher)
    if getattr(aengine.config, "enable_lora", False):
        mount_lora_routes(app, state, admin_deps)
    return app


def mount_lora_routes(app: FastAPI, state: ServerState, admin_deps: list) -> None:
    """``--enable-lora``: the adapter table, vLLM's load/unload routes (behind the admin check) and
    the ``--lora-modules`` loaded at startup (a failure stops the server's start-up)."""
    from rlserve.server.lora_routes import load_static_adapters, make_lora_registry, make_lora_router

    registry = make_lora_registry(state)
    app.include_router(make_lora_router(state, admin_deps), responses=error_answers(ADMIN_ERRORS))
    if state.settings.lora_modules:
        modules = list(state.settings.lora_modules)

        async def load_modules():
            await load_static_adapters(registry, modules)

        app.router.on_startup.append(load_modules)


def mount_weight_routes(app: FastAPI, state: ServerState, admin_deps: list, weight_manager=None) -> None:
    """Mount the weight-sync router (owned by the transfer layer) behind the admin check.

    ---- WEIGHT-SYNC HOOK ----------------------------------------------------------------
    The transfer layer provides ``rlserve.server.weight_routes.make_weight_router(manager,
    dependencies=[...])`` and a manager built from the async engine and the
    ``--weight-transfer-config`` / ``--weight-staging`` settings. Until that module exists the
    server starts without the weight routes and logs a warning.
    ----------------------------------------------------------------------------------------

    Raises:
        RuntimeError: the transfer layer is present but refuses the configuration.
    """
    try:
        from rlserve.server import weight_routes
    except ImportError as e:
        logger.warning("weight-sync routes are not available (%s); serving without them", e)
        return
    if weight_manager is None:
        make_manager = getattr(weight_routes, "make_weight_manager", None)
        if make_manager is None:
            logger.warning("rlserve.server.weight_routes has no make_weight_manager(); weight routes not mounted")
            return
        weight_manager = make_manager(state.aengine, state.settings.weight_transfer_config,
                                      staging=state.settings.weight_staging,
                                      check_finite=state.settings.weight_check_finite)
    state.weight_manager = weight_manager
    listeners = getattr(weight_manager, "update_listeners", None)
    if listeners is not None:
        listeners.append(state.metrics.record_weight_sync)
    app.include_router(weight_routes.make_weight_router(weight_manager, dependencies=admin_deps),
                       responses=error_answers(WEIGHT_SYNC_ERRORS))
    logger.info("weight-sync routes mounted (config %s, staging %s)", state.settings.weight_transfer_config,
                state.settings.weight_staging)
