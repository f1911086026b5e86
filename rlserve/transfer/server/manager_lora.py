"""The manager's adapter-only updates (an ``update_info`` with ``lora``, :mod:`rlserve.lora.sync`):
validation against the served model's LoRA-capable layers before a byte moves, staging whatever
``--weight-staging`` says, and a finish that makes the received factors a new adapter version
(:meth:`rlserve.lora.registry.LoRARegistry.add_synced`) instead of loading base weights. Mixed
into :class:`~rlserve.transfer.server.manager.WeightTransferManager`."""

from __future__ import annotations

import time

from rlserve.errors import LoRAAdapterError, WeightUpdateError
from rlserve.lora.sync import check_pairs, lora_fields, scaling_of, update_spec
from rlserve.transfer.server.session import _Session


class LoRASyncRoutes:
    """Adapter-only sessions of the weight-sync manager (see the module docstring)."""

    #: the server's :class:`~rlserve.lora.registry.LoRARegistry` with ``--enable-lora`` (set by
    #: the server, :func:`rlserve.server.lora_routes.make_lora_registry`), else ``None``
    lora = None
    _lora_spec: dict | None = None

    def _staging_of(self, s: _Session | None) -> str:
        """The staging of session ``s``'s receive: ``"lora"`` (staging tensors on the worker's
        device, the wire dtype kept) for an adapter-only update, else ``--weight-staging``."""
        return "lora" if s is not None and s.lora is not None else self.staging

    async def _lora_fields(self, raw) -> dict:
        """``update_info.lora`` checked against the server: ``--enable-lora``, ``--max-lora-rank``,
        the adapter table (a name loaded without ``load_inplace``, ``--max-loras``).

        Raises:
            WeightUpdateError (400): any of these.
        """
        if self.lora is None:
            raise WeightUpdateError("an adapter-only update (update_info.lora) needs a server started with "
                                    "--enable-lora")
        if self._lora_spec is None:
            res = await self.aengine.call_engines("rlserve.lora.sync:lora_targets", timeout_s=self.rpc_timeout_s)
            self._lora_spec = {"targets": {k: tuple(v) for k, v in res[0]["targets"].items()},
                               "max_lora_rank": int(res[0]["max_lora_rank"])}
        fields = lora_fields(raw, self._lora_spec["max_lora_rank"])
        try:
            self.lora.check_add(fields["lora_name"], fields["load_inplace"])
        except LoRAAdapterError as e:
            raise WeightUpdateError(f"update_info.lora refused, nothing was changed: {e}") from None
        return fields

    async def _spec_for(self, lora: dict | None) -> tuple[dict, set]:
        """``(names -> shapes, required names)`` an update is validated against: the model's
        checkpoint, or for an adapter-only update the factors of rank ``lora["r"]`` of every
        LoRA-capable layer (none required: an adapter may target a subset)."""
        if lora is None:
            return await self._model_spec()
        spec = self._lora_spec.setdefault("by_rank", {}).get(lora["r"])
        if spec is None:  # (504 names for Qwen3-8B: built once per rank)
            spec = self._lora_spec["by_rank"][lora["r"]] = update_spec(self._lora_spec["targets"], lora["r"])
        return spec, set()

    async def _finish_lora(self, s: _Session, weight_version: str | None) -> dict:
        """``finish_weight_update`` of an adapter-only session: every replica turns its staged
        factors into a new adapter (a new ``lora_int_id``, so no prefix-cache entry of another
        version is reused), the name points at it, the previous version finishes its running
        requests. Labelled ``weight_version`` or ``lora.version`` (default: the name's previous
        label + 1). A failure drops the staged factors and changes nothing served.

        Raises:
            WeightUpdateError (400): a module with one factor; what
                :meth:`~rlserve.lora.registry.LoRARegistry.add_synced` raises.
        """
        fields = s.lora
        try:
            check_pairs(sorted(s.received))
            rec = await self.lora.add_synced(fields["lora_name"], fields["r"], scaling_of(fields),
                                             fields["load_inplace"], weight_version or fields["version"],
                                             timeout_s=max(self.rpc_timeout_s, self._timeout()))
        except BaseException as e:
            await self._fail(s, e, teardown=False)
            raise
        await self._end_session(s)
        self.num_updates += 1
        total = time.monotonic() - s.started
        self._record(ok=True, lora_name=rec.name, lora_int_id=rec.lora_int_id, lora_version=rec.version,
                     tensors=len(s.received), bytes=s.bytes, transfer_seconds=round(s.seconds, 6),
                     total_seconds=round(total, 6), staging="lora",
                     backend=self._init.backend if self._init else self.backend)
        return {"status": "ok", "lora_name": rec.name, "lora_int_id": rec.lora_int_id, "lora_version": rec.version,
                "rank": rec.rank, "adapter_bytes": rec.bytes, "tensors": len(s.received), "bytes": s.bytes,
                "transfer_seconds": round(s.seconds, 6), "total_seconds": round(total, 6)}
