"""vLLM's LoRA routes (``vllm/entrypoints/serve/lora/api_router.py``), mounted with ``--enable-lora``
behind the control-route check (they make the server read files from its own disk):

- ``POST /v1/load_lora_adapter`` ``{lora_name, lora_path, load_inplace=false, is_3d_lora_weight=false}``
  -> 200 ``text/plain`` "Success: LoRA adapter 'NAME' added successfully." once every engine
  replica holds it;
- ``POST /v1/unload_lora_adapter`` ``{lora_name, lora_int_id=null}`` -> 200 "Success: LoRA adapter
  'NAME' removed successfully.".

Errors carry vLLM's statuses and messages (in rlserve's error body): 400 for a missing name or
path, a base model's name, a name already loaded without ``load_inplace``, an adapter that cannot be
served (:mod:`rlserve.lora.adapter`), ``--max-loras`` adapters already loaded; 404 for no adapter at
the path ("Loading lora NAME failed: No adapter found for PATH") or an unknown name on unload.
vLLM answers 500 for an adapter its engine refuses; rlserve says 400 (the request is at fault).
A request selects an adapter with ``"model": "NAME"`` (:meth:`ServerState.lora_int_id`);
``/v1/models`` lists the adapters after the base model.
"""

from __future__ import annotations

import logging
from typing import Optional

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from rlserve.errors import LoRAAdapterError
from rlserve.lora.registry import LoRARegistry
from rlserve.server.errors import APIError
from rlserve.server.request_body import FastJSONRoute
from rlserve.server.state import ServerState

logger = logging.getLogger(__name__)


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's ``LoadLoRAAdapterRequest``."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    load_inplace: bool = False
    is_3d_lora_weight: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's ``UnloadLoRAAdapterRequest`` (``lora_int_id`` accepted and not needed)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: Optional[int] = None


def make_lora_registry(state: ServerState) -> LoRARegistry:
    """The server's :class:`LoRARegistry`, attached as ``state.lora``; its ids are resolved again
    when a request is submitted (``aengine.lora_resolver``: a reload between the route and the
    engine runs it on the new id; an unload makes it a 404 ``model_not_found``)."""
    cfg = state.aengine.config
    state.lora = LoRARegistry(state.aengine, list(state.settings.served_model_names) + [state.settings.model],
                              cfg.max_loras, cfg.max_lora_rank)
    registry = state.lora

    def resolve(adapter_id: int) -> int:
        current = registry.current_id(adapter_id)
        if current is None:  # unloaded after the route read its id: as if it had been gone then
            raise APIError(404, f"The model `{registry.name_of(adapter_id)}` does not exist (its LoRA adapter was "
                           "unloaded before the request started).", param="model", code="model_not_found")
        return current

    state.aengine.lora_resolver = resolve
    restarter = getattr(state.aengine, "restarter", None)
    if restarter is not None:  # a restarted engine core gets the adapters back before it serves
        restarter.adopters.append(registry.restore)
    manager = getattr(state, "weight_manager", None)
    if manager is not None and hasattr(manager, "lora"):
        manager.lora = state.lora  # adapter-only weight syncs (rlserve.lora.sync) register here
    return state.lora


def make_lora_router(state: ServerState, dependencies: list) -> APIRouter:
    """The two routes (see the module docstring), behind ``dependencies``."""
    router = APIRouter(dependencies=dependencies, route_class=FastJSONRoute)
    registry = state.lora

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        if body.is_3d_lora_weight:
            raise LoRAAdapterError("is_3d_lora_weight (fused-MoE adapters) is not supported")
        rec = await registry.load(body.lora_name, body.lora_path, body.load_inplace)
        logger.info("Loaded new LoRA adapter: name '%s', path '%s' (id %d, rank %d, %d bytes per replica)",
                    rec.name, rec.path, rec.lora_int_id, rec.rank, rec.bytes)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        await registry.unload(body.lora_name)
        logger.info("Removed LoRA adapter: name '%s'", body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    return router


async def load_static_adapters(registry: LoRARegistry, modules: list[tuple[str, str]]) -> None:
    """``--lora-modules NAME=PATH ...`` at startup; raises what :meth:`LoRARegistry.load` raises
    (the server then does not start)."""
    for name, path in modules:
        await registry.load(name, path)
        logger.info("LoRA adapter '%s' loaded from %s", name, path)
