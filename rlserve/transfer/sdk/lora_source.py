"""Trainer SDK, adapter-only source: :class:`LoRASource` sends a PEFT model's LoRA factors, not its
weights (megabytes instead of gigabytes), into a new adapter version on the server
(:mod:`rlserve.lora.sync`; the server needs ``--enable-lora``)::

    engine = WeightTransferTrainerFactory.trainer_init(
        init_info=GlooTrainerInitInfo(master_port=port, world_size=2),
        client=HTTPWeightSyncClient(url), source=LoRASource(peft_model, "policy"))
    fin = engine.send_weights()        # {"lora_name": "policy", "lora_int_id": 3, "lora_version": "1", ...}
    # requests with "model": "policy" now run on the adapter just sent

Every engine (gloo, NCCL, ipc) sends it as it sends weights: same buckets, checksums, liveness.
"""

from __future__ import annotations

from typing import Iterator

import torch

from rlserve.transfer.sdk.sources import hf_name


class LoRASource:
    """The adapter ``adapter_name`` of a PEFT model as an adapter-only update.

    Args:
        model: a ``peft.PeftModel`` (DDP / torch.compile wrappers are stripped from names).
        lora_name: the served adapter's name (what requests put in ``"model"``).
        adapter_name: PEFT's adapter to send (``"default"``).
        load_inplace: replace the served adapter of that name (new version, new id); ``False``:
            the server refuses (400) if the name is loaded (publish ``policy-v7`` style names then).
        dtype: cast the factors to this dtype on the wire (``None``: as they are). The server
            folds ``scaling`` into ``B`` in float32 and keeps both in the model's dtype.
        version: label of the version sent (default: the server counts per name from "1").

    Attributes:
        lora: ``update_info.lora`` (``lora_name``, ``r``, ``lora_alpha``, ``use_rslora``,
            ``load_inplace``, ``version``), sent with the update's declaration.

    Raises:
        LoRAAdapterError: a config the server cannot serve (DoRA, biases, ``modules_to_save``,
            rank / alpha patterns, ...), or no ``lora_A`` / ``lora_B`` parameters.
    """

    def __init__(self, model, lora_name: str, adapter_name: str = "default", load_inplace: bool = True,
                 dtype: torch.dtype | None = None, version: str | None = None):
        from rlserve.errors import LoRAAdapterError
        from rlserve.lora.adapter import check_lora_config

        cfg = model.peft_config[adapter_name]
        check_lora_config(cfg, f"PEFT adapter {adapter_name!r}")
        self.model, self.adapter_name, self.dtype = model, adapter_name, dtype
        self._owners: list[tuple[str, torch.nn.Module, str]] | None = None  # (wire name, module, attribute)
        self.lora = {"lora_name": lora_name, "r": int(cfg.r), "lora_alpha": float(cfg.lora_alpha),
                     "use_rslora": bool(cfg.use_rslora), "load_inplace": bool(load_inplace)}
        if version is not None:
            self.lora["version"] = str(version)
        if not self._params():
            raise LoRAAdapterError(f"the model has no lora_A / lora_B parameters of adapter {adapter_name!r}")

    def _params(self) -> list[tuple[str, torch.Tensor]]:
        """``(wire name, parameter)``: PEFT's ``base_model.model.<module>.lora_A.<adapter>.weight``
        as ``<module>.lora_A.weight``. The factors' modules are found once (walking a PEFT
        model's parameters costs ~10-20 ms for a 36-layer model, as much as the rest of an IPC
        adapter sync); each call reads their ``weight`` attribute again, so a parameter replaced
        since (``load_state_dict(assign=True)``, a new ``nn.Parameter``) is the one sent."""
        if self._owners is None:
            owners = []
            for raw, _p in self.model.named_parameters():
                name = hf_name(raw).removeprefix("base_model.model.")
                for ab in ("lora_A", "lora_B"):
                    tail = f".{ab}.{self.adapter_name}.weight"
                    if name.endswith(tail):
                        mod_name, attr = raw.rsplit(".", 1)
                        owners.append((name[: -len(tail)] + f".{ab}.weight", self.model.get_submodule(mod_name),
                                       attr))
            self._owners = owners
        return [(name, getattr(mod, attr)) for name, mod, attr in self._owners]

    def metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``[(wire name, dtype on the wire, shape)]`` in send order."""
        return [(n, self.dtype or p.dtype, tuple(p.shape)) for n, p in self._params()]

    @property
    def module(self):
        """The PEFT model: the ipc engine exports its parameters' storages once (a LoRASource
        without ``dtype`` sends the factors themselves: one ``/sync_weights`` call per sync)."""
        return self.model

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(wire name, contiguous tensor)`` in :meth:`metadata` order: the parameters
        themselves, or their casts to ``dtype``."""
        for name, p in self._params():
            t = p.detach()
            if self.dtype is not None and t.dtype != self.dtype:
                t = t.to(self.dtype)
            yield name, t.contiguous()
