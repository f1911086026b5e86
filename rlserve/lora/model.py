"""The adapters one engine replica holds, and the hooks that apply them to its model.

:meth:`LoRAModel.install` (the worker calls it after the model is built, with ``--enable-lora``)
finds every linear layer of the decoder (``*.layers.N.*``), maps the checkpoint matrices packed in
it (``packed_modules_mapping``: ``qkv_proj`` = q/k/v, ``gate_up_proj`` = gate/up) onto output
slices. The model runner sets the step's :class:`LoRABatch` around the forward pass
(:meth:`LoRAModel.step`); for a step with adapters that registers, for the step only, a forward hook
on each linear some loaded adapter targets, which adds the rows' deltas
(:func:`rlserve.lora.layers.apply_lora`). A step with every row on the base model runs the model
as without ``--enable-lora``, the CPU fast decode layer included: registering and removing the
hooks drops the layers' cached ``_cpu_fast_ok`` (:func:`rlserve.models.llama_cpu._layer_ok`), so the
fast layer, which calls the kernels directly and would skip a hook, is re-checked and steps aside
while the hooks are there.

Adapters are held by integer id (the API server's ``lora_int_id``, unique per load: a reloaded
adapter gets a new id, so its KV-cache prefix hashes differ, :mod:`rlserve.engine.core.block_manager`).
Limits of this first round: tensor parallel size 1; steps with adapters run without the CPU fast
decode layer, CPU micro-batches and CUDA graphs.
"""

from __future__ import annotations

import contextlib
import logging
import re

import torch
from torch import nn

from rlserve.errors import LoRAAdapterError
from rlserve.lora.adapter import LoRAAdapter, read_adapter
from rlserve.lora.layers import LoRABatch, LoRALinear, apply_lora

logger = logging.getLogger(__name__)

ATTR = "rlserve_lora"  # the model's attribute holding its LoRAModel
_DECODER_LINEAR = re.compile(r"(^|\.)layers\.\d+\.")


class LoRAModel:
    """LoRA state of one model replica (see the module docstring).

    Args:
        model: the built model (``checkpoint_spec()``, ``packed_modules_mapping``).
        max_lora_rank: ``--max-lora-rank``.
        dtype / device: the model's; adapters are kept in them.

    Raises:
        LoRAAdapterError: a tensor-parallel model (not supported yet) or no decoder linear found.
    """

    def __init__(self, model: nn.Module, max_lora_rank: int, dtype: torch.dtype, device: torch.device):
        from rlserve.layers.linear import LinearBase

        self.max_lora_rank = int(max_lora_rank)
        self.dtype, self.device = dtype, torch.device(device)
        self.current: LoRABatch | None = None
        self.adapters: dict[int, dict] = {}  # id -> {"rank", "modules", "bytes", "path"}
        self.retired: set[int] = set()  # unloaded while requests still run on them
        spec = model.checkpoint_spec()
        packed = getattr(model, "packed_modules_mapping", {}) or {}
        self.targets: dict[str, tuple[int, int]] = {}  # hf_module -> (out, in)
        self.layers: list[LoRALinear] = []
        self._linears: list[tuple[nn.Module, LoRALinear]] = []
        self._handles: list = []  # this step's hooks
        self._modules = list(model.modules())  # where _cpu_fast_ok may be cached
        for name, mod in model.named_modules():
            if not isinstance(mod, LinearBase) or not _DECODER_LINEAR.search(name):
                continue
            if getattr(mod, "tp_size", 1) != 1:
                raise LoRAAdapterError("--enable-lora needs --tensor-parallel-size 1 in this version")
            prefix, leaf = name.rsplit(".", 1)
            slices, offset = [], 0
            for part in packed.get(leaf, [leaf]):
                shape = spec.get(f"{prefix}.{part}.weight")
                if shape is None or len(shape) != 2:
                    slices = []
                    break
                slices.append((f"{prefix}.{part}", offset, int(shape[0])))
                self.targets[f"{prefix}.{part}"] = (int(shape[0]), int(shape[1]))
                offset += int(shape[0])
            if not slices or offset != mod.output_size:
                continue
            lin = LoRALinear(slices, mod.input_size)
            self.layers.append(lin)
            self._linears.append((mod, lin))
        if not self.layers:
            raise LoRAAdapterError(f"{type(model).__name__} has no decoder linear layer LoRA can target")

    @classmethod
    def install(cls, model: nn.Module, max_lora_rank: int, dtype: torch.dtype, device) -> "LoRAModel":
        """Build the state, hook ``model``'s linears and attach it as ``model.rlserve_lora``."""
        lora = cls(model, max_lora_rank, dtype, device)
        object.__setattr__(model, ATTR, lora)
        logger.info("LoRA: %d linear layers can take adapters (max rank %d)", len(lora.layers), lora.max_lora_rank)
        return lora

    def _hook(self, lin: LoRALinear):
        def hook(module, args, out):
            batch = self.current
            if batch is None or not lin.adapters:
                return None
            return apply_lora(lin, args[0], out, batch)

        return hook

    # ---- adapters ------------------------------------------------------------------------
    def has(self, adapter_id: int) -> bool:
        """Whether ``adapter_id`` is loaded and not unloaded."""
        return adapter_id in self.adapters and adapter_id not in self.retired

    def add(self, adapter_id: int, adapter: LoRAAdapter, path: str = "") -> dict:
        """Hold ``adapter`` under ``adapter_id`` (a new id: ids are never reused). Returns its
        info ``{"rank", "modules", "bytes", "path"}``."""
        if adapter_id < 1 or adapter_id in self.adapters:
            raise LoRAAdapterError(f"LoRA adapter id {adapter_id} is invalid or already loaded")
        for lin in self.layers:
            lin.add(adapter_id, adapter.weights)
        info = {"rank": adapter.rank, "modules": len(adapter.weights), "bytes": adapter.nbytes, "path": path}
        self.adapters[adapter_id] = info
        return info

    def load(self, adapter_id: int, path: str, name: str | None = None) -> dict:
        """:func:`~rlserve.lora.adapter.read_adapter` then :meth:`add`; raises what they raise."""
        adapter = read_adapter(path, self.targets, self.max_lora_rank, self.dtype, self.device, name=name)
        return self.add(adapter_id, adapter, path)

    def remove(self, adapter_id: int) -> None:
        for lin in self.layers:
            lin.remove(adapter_id)
        self.adapters.pop(adapter_id, None)
        self.retired.discard(adapter_id)

    # ---- steps ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, seq_adapters: list[int] | None, query_lens: list[int]):
        """The forward pass inside runs sequence ``i`` (``query_lens[i]`` rows) under adapter
        ``seq_adapters[i]`` (0 or ``None`` for all: the base model)."""
        self.current = None if not seq_adapters else LoRABatch.build(seq_adapters, query_lens, self.device)
        if self.current is not None:
            self._handles = [mod.register_forward_hook(self._hook(lin)) for mod, lin in self._linears if lin.adapters]
            self._forget_fast_layer_checks()
        try:
            yield self.current
        finally:
            self.current = None
            if self._handles:
                for h in self._handles:
                    h.remove()
                self._handles = []
                self._forget_fast_layer_checks()

    def _forget_fast_layer_checks(self) -> None:
        """Drop every layer's cached fast-path check (it looks at the hooks, which just changed)."""
        for m in self._modules:
            m.__dict__.pop("_cpu_fast_ok", None)


def lora_of(model) -> LoRAModel | None:
    """The model's :class:`LoRAModel`, or None without ``--enable-lora``."""
    return getattr(model, ATTR, None)
