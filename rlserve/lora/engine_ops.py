"""Engine-side entry points of the LoRA routes, run on every data-parallel replica between two
steps through :meth:`rlserve.engine.front.async_engine.AsyncEngine.call_engines` (also while paused; in
process mode inside the engine-core process, arguments and results as MessagePack). ``core`` is
the replica's :class:`~rlserve.engine.core.engine_core.EngineCore`; ``core.engine`` its ``LLMEngine``.

An adapter unloaded while requests of that replica still run on it stays held ("retired") until
they finish: unload never changes the outputs of a request already running (vLLM's unload does not
touch running requests either). Retired adapters are dropped at the next load or unload.
"""

from __future__ import annotations

from rlserve.errors import InvalidRequestError, LoRAAdapterError
from rlserve.lora.model import LoRAModel, lora_of


def _lora(engine) -> LoRAModel:
    lora = lora_of(engine.model)
    if lora is None:
        raise LoRAAdapterError("LoRA is not enabled: start the server with --enable-lora")
    return lora


def _in_use(engine) -> set[int]:
    """Adapter ids of the replica's unfinished requests."""
    return {getattr(r.params, "lora_int_id", 0) for r in engine.requests.values() if not r.finished}


def sweep(engine, lora: LoRAModel) -> None:
    """Free the retired adapters no unfinished request of ``engine`` runs on any more."""
    used = _in_use(engine)
    for adapter_id in [a for a in lora.retired if a not in used]:
        lora.remove(adapter_id)


def load_lora(core, adapter_id: int, path: str, name: str) -> dict:
    """Read the adapter at ``path`` and hold it as ``adapter_id``. Returns its info (rank, modules,
    bytes, path). Raises LoRAAdapterError / LoRAAdapterNotFoundError (nothing loaded)."""
    engine = core.engine
    lora = _lora(engine)
    sweep(engine, lora)
    return lora.load(int(adapter_id), str(path), name=str(name))


def unload_lora(core, adapter_id: int) -> bool:
    """Stop serving ``adapter_id`` to new requests; its memory goes once no request runs on it.
    Returns whether it was freed now. An id this replica does not hold is not an error (a load
    that failed on another replica is undone with this)."""
    engine = core.engine
    lora = _lora(engine)
    adapter_id = int(adapter_id)
    if adapter_id not in lora.adapters:
        return True
    lora.retired.add(adapter_id)
    sweep(engine, lora)
    return adapter_id not in lora.adapters


def held_adapters(core) -> list[int]:
    """Ids held by this replica, retired ones included (tests, stats)."""
    lora = lora_of(core.engine.model)
    return sorted(lora.adapters) if lora is not None else []


def check_request_adapter(engine, params) -> None:
    """``LLMEngine.add_request``'s check: a request's ``lora_int_id`` names an adapter this
    replica serves. Raises InvalidRequestError otherwise (the adapter was unloaded meanwhile, or
    the server runs without ``--enable-lora``)."""
    adapter_id = getattr(params, "lora_int_id", 0)
    if not adapter_id:
        return
    lora = lora_of(engine.model)
    if lora is None or not lora.has(adapter_id):
        raise InvalidRequestError(f"LoRA adapter id {adapter_id} is not loaded on this engine (unloaded meanwhile, "
                                  "or the server was started without --enable-lora)")
