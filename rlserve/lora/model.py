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
On CUDA (Triton importable) the model runs the kernel path (:mod:`rlserve.lora.triton_ops`): each
adapter gets a slot in every layer's slot buffers (``max_loras + 1`` slots: one more than the
served adapters, for a version still finishing its requests while its successor serves), the
hooks stay registered (they do nothing while no step with adapters runs) and decode steps with
adapters replay CUDA graphs of their own (:meth:`static_step`, :meth:`fill_static`: the segment
tensors are static buffers). Limits: tensor parallel size 1; on the CPU, steps with adapters run
without the fast decode layer and CPU micro-batches.
"""

from __future__ import annotations

import contextlib
import logging
import re

import torch
from torch import nn

from rlserve.errors import LoRAAdapterError
from rlserve.lora import ATTR, lora_of  # noqa: F401 (lora_of: importable here, as before)
from rlserve.lora.adapter import LoRAAdapter, read_adapter
from rlserve.lora.layers import LoRABatch, LoRALinear, apply_lora, segments
from rlserve.lora.merge import MergedAdapter, mergeable
from rlserve.lora.merge import policy as merge_policy
from rlserve.lora.slots import slots_ok

logger = logging.getLogger(__name__)

_DECODER_LINEAR = re.compile(r"(^|\.)layers\.\d+\.")


class LoRAModel:
    """LoRA state of one model replica (see the module docstring).

    Args:
        model: the built model (``checkpoint_spec()``, ``packed_modules_mapping``).
        max_lora_rank: ``--max-lora-rank``.
        dtype / device: the model's; adapters are kept in them.
        max_loras: ``--max-loras`` (kernel path: ``max_loras + 1`` slots).
        kernel: use the Triton kernels (default: on CUDA when Triton imports).

    Raises:
        LoRAAdapterError: a tensor-parallel model (not supported yet) or no decoder linear found.
    """

    def __init__(self, model: nn.Module, max_lora_rank: int, dtype: torch.dtype, device: torch.device,
                 max_loras: int = 1, kernel: bool | None = None):
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
        self.kernel = _triton_ok() if kernel is None and self.device.type == "cuda" else bool(kernel)
        self.num_slots = int(max_loras) + 1
        self.slot_of: dict[int, int] = {}  # kernel path: adapter id -> slot
        self._static: torch.Tensor | None = None  # kernel path: a CUDA graph's segment buffers
        # the one-adapter fast path (rlserve.lora.merge), or None
        merge = merge_policy(self.device)
        self.merge = MergedAdapter(self, auto=merge == "auto") \
            if merge != "off" and mergeable(self._linears) else None
        if self.kernel:
            for mod, lin in self._linears:
                lin.use_slots(self.num_slots, self.max_lora_rank, dtype, self.device)
                mod.register_forward_hook(self._hook(lin))  # permanent: graphs capture the kernels

    @classmethod
    def install(cls, model: nn.Module, max_lora_rank: int, dtype: torch.dtype, device, max_loras: int = 1,
                kernel: bool | None = None) -> "LoRAModel":
        """Build the state, hook ``model``'s linears and attach it as ``model.rlserve_lora``."""
        lora = cls(model, max_lora_rank, dtype, device, max_loras, kernel)
        object.__setattr__(model, ATTR, lora)
        logger.info("LoRA: %d linear layers can take adapters (max rank %d, %s)", len(lora.layers),
                    lora.max_lora_rank, f"Triton kernels, {lora.num_slots} slots" if lora.kernel else "dense grouping")
        return lora

    def _hook(self, lin: LoRALinear):
        def hook(module, args, out):
            batch = self.current
            if batch is None or (not lin.adapters and not batch.static):
                return None
            return apply_lora(lin, args[0], out, batch)

        # no step with adapters runs: the hook does nothing, so a direct kernel call that skips
        # hooks (the batch-1 GEMV, rlserve.layers.gemv.no_hooks) may take the layer
        hook.idle = lambda: self.current is None
        return hook

    # ---- adapters ------------------------------------------------------------------------
    def has(self, adapter_id: int) -> bool:
        """Whether ``adapter_id`` is loaded and not unloaded."""
        return adapter_id in self.adapters and adapter_id not in self.retired

    def add(self, adapter_id: int, adapter: LoRAAdapter, path: str = "") -> dict:
        """Hold ``adapter`` under ``adapter_id`` (a new id: ids are never reused). Returns its
        info ``{"rank", "modules", "bytes", "path"}``."""
        slot = self._take_slot(adapter_id)
        for lin in self.layers:
            lin.add(adapter_id, adapter.weights, slot)
        info = {"rank": adapter.rank, "modules": len(adapter.weights), "bytes": adapter.nbytes, "path": path}
        self.adapters[adapter_id] = info
        return info

    def _take_slot(self, adapter_id: int) -> int:
        """Check ``adapter_id`` is new; kernel path: give it the lowest free slot (else -1).

        Raises:
            LoRAAdapterError: an id < 1 or already held; every slot taken."""
        if adapter_id < 1 or adapter_id in self.adapters:
            raise LoRAAdapterError(f"LoRA adapter id {adapter_id} is invalid or already loaded")
        if not self.kernel:
            return -1
        free = sorted(set(range(self.num_slots)) - set(self.slot_of.values()))
        if not free:
            raise LoRAAdapterError(f"all {self.num_slots} LoRA slots hold adapters that requests still run on "
                                   "(unloaded ones finish their requests first): retry shortly")
        self.slot_of[adapter_id] = free[0]
        return free[0]

    def add_staged(self, adapter_id: int, parts: dict[str, dict[str, torch.Tensor]], rank: int,
                   scaling: float) -> dict | None:
        """Kernel path: an adapter-only sync's received factors (``parts``: ``{hf_module: {"A":
        [rank, in], "B": [out, rank]}}``, on this model's device, already checked for shapes,
        pairs and NaN / inf) written straight into a free slot of every layer as :meth:`add` of
        :func:`~rlserve.lora.adapter.adapter_from_parts`'s adapter would, bit for bit, but in a
        few multi-tensor launches instead of ~6 per module (:func:`rlserve.lora.slots.write_slots`;
        on Qwen3-8B's 252 modules ~1,500 launches were most of a sync's fixed cost). ``parts``'
        ``B`` tensors are scaled in place (they are the receive's staging buffers).

        Returns:
            ``{"rank", "modules", "bytes", "path": ""}`` as :meth:`add`, or ``None`` (nothing
            done) when this model or these factors need the general path: not the kernel path,
            factors of another device, or dtypes other than float32 / the model's.
        Raises:
            LoRAAdapterError: as :meth:`add` (nothing held then).
        """
        from rlserve.lora.slots import slot_plan, write_slots

        if not self.kernel or not slots_ok(parts, self.dtype, self.device):
            return None
        slot = self._take_slot(adapter_id)
        try:
            plan = slot_plan(self.layers, parts, slot)
            write_slots(plan, float(scaling))
        except BaseException:
            self.slot_of.pop(adapter_id, None)
            raise
        for lin, targeted in plan.layers:
            if targeted:
                lin.adapters[adapter_id] = slot
        nbytes = sum((ab["A"].numel() + ab["B"].numel()) for ab in parts.values()) * self.dtype.itemsize
        info = {"rank": int(rank), "modules": len(parts), "bytes": nbytes, "path": ""}
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
        self.slot_of.pop(adapter_id, None)  # its slot's contents are overwritten by the next add

    # ---- steps ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, seq_adapters: list[int] | None, query_lens: list[int]):
        """The forward pass inside runs sequence ``i`` (``query_lens[i]`` rows) under adapter
        ``seq_adapters[i]`` (0 or ``None`` for all: the base model)."""
        self.current = None if not seq_adapters else LoRABatch.build(
            seq_adapters, query_lens, self.device, self.slot_of if self.kernel else None)
        if self.current is not None and not self.kernel:
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

    # ---- CUDA graphs (kernel path) ----------------------------------------------------------
    def prepare_static(self, max_bs: int) -> None:
        """Allocate the static segment buffers of decode graphs up to ``max_bs`` rows (all
        segments empty)."""
        if self._static is None or self._static.numel() < max_bs + 2 * self.num_slots + 1:
            self._static = torch.zeros(max_bs + 2 * self.num_slots + 1, dtype=torch.int32, device=self.device)
            self._static[max_bs + self.num_slots + 1:].fill_(-1)

    @contextlib.contextmanager
    def static_step(self, bs: int):
        """The forward inside (a decode graph's capture, or its CPU emulation) runs every layer's
        kernels on the static segment buffers (:meth:`prepare_static`) of a ``bs``-row batch;
        :meth:`fill_static` sets them before each replay."""
        n = self._static.numel() - 2 * self.num_slots - 1
        st = self._static
        prev = self.current
        self.current = LoRABatch(None, [], st[:n], st[n:n + self.num_slots + 1], st[n + self.num_slots + 1:],
                                 bs, static=True)
        try:
            yield self.current
        finally:
            self.current = prev

    def fill_static(self, seq_adapters: list[int]) -> None:
        """Write a decode step's segments (one row per sequence, ``seq_adapters[i]`` its adapter
        id, 0 = base) into the static buffers a captured graph reads."""
        rows, seg_start, seg_slot = segments(seq_adapters, [1] * len(seq_adapters), self.slot_of, self.num_slots)
        n = self._static.numel() - 2 * self.num_slots - 1
        host = torch.tensor(rows + [0] * (n - len(rows)) + seg_start + seg_slot, dtype=torch.int32)
        self._static.copy_(host)  # pageable source: the copy has read it when this returns

    def _forget_fast_layer_checks(self) -> None:
        """Drop every layer's cached fast-path check (it looks at the hooks, which just changed)."""
        for m in self._modules:
            m.__dict__.pop("_cpu_fast_ok", None)


def _triton_ok() -> bool:
    """Whether the Triton kernels can be built here (Triton importable)."""
    try:
        import triton  # noqa: F401
    except ImportError:  # pragma: no cover - the device image has it
        logger.warning("LoRA: Triton is not installed; adapters run as dense grouped products")
        return False
    return True
