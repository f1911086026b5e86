"""The API server's table of loaded LoRA adapters: name -> integer id, path, rank.

vLLM's ``OpenAIServingModels`` keeps the same table (``lora_requests``); rlserve differs where
vLLM's behaviour hurts RL training:

- a load reaches every data-parallel replica before it answers (vLLM: only the replica that
  answered the request, which TRL warns about), through ``AsyncEngine.call_engines``; if one
  replica refuses, the others drop it again and the name is not registered;
- every load (``load_inplace`` included) gets a new id, never reused: the KV prefix cache is
  keyed by the id (:func:`rlserve.engine.core.block_manager.prefix_root`), so a request never reuses
  KV computed under other adapter weights (vLLM keys it by name, vllm#42125);
- ``max_loras`` bounds the adapters loaded at once: a load beyond it is refused (400) instead of
  silently evicting the oldest one;
- an engine-core process restarted after a crash gets every adapter loaded from a file again, under
  its id, before it serves (:meth:`LoRARegistry.restore`); an adapter pushed by an adapter-only sync
  died with the process and is dropped (404, as unloaded);
- a request whose route read an adapter's id before a reload (in place, or unload + load) reached
  the engines runs on the name's current id (:meth:`LoRARegistry.current_id`, asked when the
  request is submitted: :attr:`AsyncEngine.lora_resolver`), not on an id the engines dropped.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from dataclasses import dataclass, field

from rlserve.errors import LoRAAdapterError, LoRAAdapterNotFoundError

logger = logging.getLogger(__name__)

OPS = "rlserve.lora.engine_ops"
#: ids whose names :meth:`LoRARegistry.current_id` remembers (the newest; one per load: a
#: request's id read before that many later loads is answered as unloaded)
NAMES_KEPT = 4096


@dataclass
class LoRARecord:
    """One loaded adapter: ``name`` (what requests put in ``model``), ``lora_int_id`` (the engines'
    id), ``path`` (empty for a synced adapter), ``rank``, ``bytes`` (its factors, per replica), ``version``
    (a synced adapter's label, :mod:`rlserve.lora.sync`; empty for a file) and ``created`` (unix seconds)."""

    name: str
    lora_int_id: int
    path: str
    rank: int
    bytes: int
    version: str = ""
    created: int = field(default_factory=lambda: int(time.time()))


class LoRARegistry:
    """Adapters by name (see the module docstring).

    Args:
        aengine: the :class:`~rlserve.engine.front.async_engine.AsyncEngine` (``call_engines``).
        base_names: the served model names (an adapter may not take one).
        max_loras: ``--max-loras``.
        max_lora_rank: ``--max-lora-rank``.
    """

    def __init__(self, aengine, base_names: list[str], max_loras: int, max_lora_rank: int):
        self.aengine = aengine
        self.base_names = set(base_names)
        self.max_loras = int(max_loras)
        self.max_lora_rank = int(max_lora_rank)
        self.adapters: dict[str, LoRARecord] = {}
        self._ids = itertools.count(1)
        self._names: collections.OrderedDict[int, str] = collections.OrderedDict()  # id -> name, every load
        self._lock = asyncio.Lock()  # one load / unload at a time: the capacity check holds

    def lora_int_id(self, model: str | None) -> int:
        """The id of the adapter named ``model``; 0 for anything else (the base model)."""
        rec = self.adapters.get(model) if model else None
        return rec.lora_int_id if rec is not None else 0

    def current_id(self, adapter_id: int) -> int | None:
        """The id a request that read ``adapter_id`` runs on now: ``adapter_id`` while its name
        still maps to it, the name's new id after a reload (``load_inplace``, or unload then
        load), ``None`` when the name is not loaded any more (or ``adapter_id`` was never issued)."""
        rec = self.adapters.get(self.name_of(adapter_id))
        return rec.lora_int_id if rec is not None else None

    def name_of(self, adapter_id: int) -> str:
        """The name ``adapter_id`` was loaded under ("" if unknown)."""
        return self._names.get(adapter_id, "")

    async def load(self, name: str, path: str, load_inplace: bool = False) -> LoRARecord:
        """Load the PEFT adapter at ``path`` (read by every engine replica) as ``name``.

        ``load_inplace``: replace an adapter of that name (it gets a new id; requests running on
        the old one finish on it).

        Raises:
            LoRAAdapterError (400): a name or path missing, a base model's name, a name already
                loaded without ``load_inplace``, ``max_loras`` adapters loaded, or an adapter the
                engines refuse (message from :func:`rlserve.lora.adapter.read_adapter`).
            LoRAAdapterNotFoundError (404): no adapter at ``path``.
        """
        if not name or not path:
            raise LoRAAdapterError("Both 'lora_name' and 'lora_path' must be provided.")
        return await self._add(name, load_inplace, path, None, f"{OPS}:load_lora", path, name)

    async def add_synced(self, name: str, rank: int, scaling: float, load_inplace: bool = True,
                         version: str | None = None, timeout_s: float = 60.0) -> LoRARecord:
        """An adapter-only weight sync's finish (:mod:`rlserve.lora.sync`): the factors every
        replica's worker staged become a new adapter (a new id) named ``name``, labelled
        ``version`` (default: the name's previous label + 1, from "1"). Same checks and rollback
        as :meth:`load`. Raises what it raises."""
        if not name:
            raise LoRAAdapterError("an adapter-only weight update needs a lora_name")
        old = self.adapters.get(name)
        if version is None:
            prev = old.version if old is not None else "0"
            version = str(int(prev) + 1) if prev.isdigit() else "1"
        return await self._add(name, load_inplace, "", version, "rlserve.lora.sync:commit_synced", int(rank),
                               float(scaling), float(timeout_s))

    async def _add(self, name: str, load_inplace: bool, path: str, version: str | None, target: str,
                   *args) -> LoRARecord:
        """Register ``name`` under a new id once ``target(core, id, *args)`` made every replica
        hold it; a failure on one replica unloads it from the others."""
        async with self._lock:
            self.check_add(name, load_inplace)
            old = self.adapters.get(name)
            adapter_id = next(self._ids)
            try:
                infos = await self.aengine.call_engines(target, adapter_id, *args)
            except BaseException:
                await self._drop(adapter_id)  # replicas that loaded it
                raise
            info = infos[0] if infos else {}
            rec = LoRARecord(name, adapter_id, path, int(info.get("rank", 0)), int(info.get("bytes", 0)),
                             version=version or "")
            self.adapters[name] = rec
            self._names[adapter_id] = name
            while len(self._names) > NAMES_KEPT:
                self._names.popitem(last=False)
            if old is not None:
                await self._drop(old.lora_int_id)
            return rec

    def check_add(self, name: str, load_inplace: bool) -> None:
        """Whether ``name`` may be added now (also asked before an adapter-only sync moves a byte).

        Raises:
            LoRAAdapterError (400): a base model's name, a name already loaded without
                ``load_inplace``, ``max_loras`` adapters loaded.
        """
        if name in self.base_names:
            raise LoRAAdapterError(f"The lora adapter '{name}' conflicts with a served base model.")
        old = self.adapters.get(name)
        if old is not None and not load_inplace:
            raise LoRAAdapterError(f"The lora adapter '{name}' has already been loaded. If you want to load the "
                                   "adapter in place, set 'load_inplace' to True.")
        if old is None and len(self.adapters) >= self.max_loras:
            raise LoRAAdapterError(f"{len(self.adapters)} LoRA adapters are loaded, the most --max-loras "
                                   f"{self.max_loras} allows: unload one first "
                                   f"({', '.join(sorted(self.adapters))}), or restart with a larger --max-loras")

    async def unload(self, name: str) -> LoRARecord:
        """Stop serving ``name``: new requests naming it get 404; requests already running on it
        finish on it (each replica frees it then).

        Raises:
            LoRAAdapterError (400): no name. LoRAAdapterNotFoundError (404): not loaded.
        """
        if not name:
            raise LoRAAdapterError("'lora_name' needs to be provided to unload a LoRA adapter.")
        async with self._lock:
            rec = self.adapters.pop(name, None)
            if rec is None:
                raise LoRAAdapterNotFoundError(f"The lora adapter '{name}' cannot be found.")
            await self._drop(rec.lora_int_id)
            return rec

    async def restore(self, replica) -> None:
        """A restarted engine-core replica, not yet serving (a
        :attr:`~rlserve.engine.front.core_restart.CoreRestarter.adopters` entry): load every adapter
        read from a file into it again, under the id the table holds, so requests naming it answer as
        before the crash. An adapter with no file (an adapter-only weight sync's: its factors died with
        the process) or one whose file no longer loads is dropped from the table (its requests: 404
        ``model_not_found``; its name free again), with a warning naming it. Raises nothing."""
        async with self._lock:
            for name, rec in list(self.adapters.items()):
                why = "pushed by an adapter-only weight sync, its factors died with the process"
                if rec.path:
                    try:
                        await asyncio.wrap_future(replica.call(f"{OPS}:load_lora", rec.lora_int_id, rec.path, name))
                        continue
                    except Exception as e:  # noqa: BLE001 - e.g. the file was removed since
                        why = f"its file no longer loads ({type(e).__name__}: {e})"
                del self.adapters[name]
                logger.warning("LoRA adapter '%s' (id %d, version %r) dropped after the engine-core restart: %s; "
                               "load it again", name, rec.lora_int_id, rec.version, why)

    async def _drop(self, adapter_id: int) -> None:
        try:
            await self.aengine.call_engines(f"{OPS}:unload_lora", adapter_id)
        except Exception:  # noqa: BLE001 - a dead replica holds nothing; the name is gone either way
            pass

    def model_cards(self, parent: str, permission) -> list[dict]:
        """vLLM's ``ModelCard`` of each adapter (``/v1/models``): ``root`` the adapter's path,
        ``parent`` the base model's served name, ``max_model_len`` null, ``owned_by`` as the base's.
        ``permission()``: a fresh permission list."""
        return [{"id": r.name, "object": "model", "created": r.created, "owned_by": "rlserve", "root": r.path,
                 "parent": parent, "max_model_len": None, "permission": permission(r.created)}
                for r in self.adapters.values()]
