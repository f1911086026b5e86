"""vLLM's ``LoRARequest`` for the offline API: ``LLM(model, enable_lora=True).generate(prompts, params,
lora_request=LoRARequest("name", 1, "/path/to/adapter"))``."""

from __future__ import annotations

import dataclasses

from rlserve.errors import LoRAAdapterError
from rlserve.lora.model import lora_of


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter for offline requests (vLLM's fields): ``lora_name``, ``lora_int_id`` (>= 1; the
    adapter's key: a request with an id already loaded reuses it, whatever its path), ``lora_path``
    (a PEFT adapter directory, read the first time the id is seen)."""

    lora_name: str
    lora_int_id: int
    lora_path: str


def with_adapters(engine, params: list, lora_request) -> list:
    """``params`` with ``lora_int_id`` set from ``lora_request`` (one for all, one per prompt, or
    None), loading every adapter the engine does not hold yet.

    Raises:
        LoRAAdapterError: the engine runs without ``enable_lora``, an id < 1, a list of another
            length, or an adapter that cannot be served (nothing is queued then).
    """
    if lora_request is None:
        return params
    reqs = lora_request if isinstance(lora_request, list) else [lora_request] * len(params)
    if len(reqs) != len(params):
        raise LoRAAdapterError(f"{len(reqs)} LoRA requests for {len(params)} prompts")
    lora = lora_of(engine.model)
    if lora is None:
        raise LoRAAdapterError("LoRA is not enabled: build the LLM with enable_lora=True")
    for r in {r.lora_int_id: r for r in reqs if r is not None}.values():
        if not isinstance(r.lora_int_id, int) or r.lora_int_id < 1:
            raise LoRAAdapterError(f"lora_int_id must be an integer >= 1, got {r.lora_int_id!r}")
        if not lora.has(r.lora_int_id):
            lora.load(r.lora_int_id, r.lora_path, name=r.lora_name)
    return [p if r is None else dataclasses.replace(p, lora_int_id=r.lora_int_id) for p, r in zip(params, reqs)]
