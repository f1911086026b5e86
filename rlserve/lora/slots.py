"""An adapter-only sync's commit on the kernel path in a few multi-tensor launches.

An adapter's factors end up in every layer's slot buffers (:meth:`rlserve.lora.layers.LoRALinear.
use_slots`): ``A`` rows ``i x max_rank .. + r`` of ``a_stack[slot]`` per slice ``i``, ``B' =
scaling x B`` (in float32, rounded once to the model's dtype) in columns ``0 .. r`` of rows
``offset .. offset + size`` of ``b_stack[slot]``, zeros elsewhere. Module by module
(:func:`rlserve.lora.adapter.adapter_from_parts` then :meth:`~rlserve.lora.layers.LoRALinear.add`)
that is ~6 small kernels per module: on Qwen3-8B (252 modules, 144 layers) ~1,500 launches, each
a few microseconds of Python and launch, whatever the rank -- most of the ~30 ms an adapter sync
cost on an H100 beyond its bytes (BENCHMARKS.md, LoRA). Here the same writes are four
``torch._foreach_*`` calls over lists (each a handful of launches on CUDA): zero the slot regions
the adapter does not overwrite, scale every ``B`` in place, copy (and cast) every ``A`` and ``B``
into its slot view. Same values bit for bit: a copy casts as ``Tensor.to`` does, and a float32 ``B``
is multiplied in float32 and rounded once, as ``(B.float() * scaling).to(dtype)``
(``tests/test_lora_sync.py::test_batched_slot_commit_equals_module_by_module``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def slots_ok(parts: dict[str, dict[str, torch.Tensor]], dtype: torch.dtype, device: torch.device) -> bool:
    """Whether :func:`write_slots` gives exactly what the module-by-module path gives for
    ``parts`` (``{hf_module: {"A", "B"}}``): every factor on ``device`` (an index-less device
    matches any index of its type), every ``A`` in float32 or ``dtype``, every ``B`` in float32
    (scaled in place in float32, then rounded once by the copy; a bfloat16 ``B`` scaled in place
    rounds the product to bfloat16 with the scalar's rounding on the CPU, not as the float32
    product: PEFT keeps its factors in float32 anyway), ``dtype`` float32 / bfloat16 / float16."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    for ab in parts.values():
        for key, t in ab.items():
            if t.dtype not in ((torch.float32, dtype) if key == "A" else (torch.float32,)) or \
                    t.device.type != device.type or (device.index is not None and t.device.index != device.index):
                return False
    return True


@dataclass
class SlotPlan:
    """The writes of one adapter into one slot of every layer.

    Attributes:
        layers: ``[(LoRALinear, targeted)]``: every layer, and whether the adapter has a factor in it.
        zero: slot views the adapter leaves (partly) unwritten: whole ``a_stack[slot]`` /
            ``b_stack[slot]`` of a layer with an untargeted slice or ``r < max_rank``.
        a_dst / a_src: ``[r, in]`` slot views and the received ``A`` factors, pairwise.
        b_dst / b_src: ``[size, r]`` slot views and the received ``B`` factors, pairwise.
    """

    layers: list = field(default_factory=list)
    zero: list = field(default_factory=list)
    a_dst: list = field(default_factory=list)
    a_src: list = field(default_factory=list)
    b_dst: list = field(default_factory=list)
    b_src: list = field(default_factory=list)


def slot_plan(layers, parts: dict[str, dict[str, torch.Tensor]], slot: int) -> SlotPlan:
    """The :class:`SlotPlan` of ``parts`` (checked shapes ``A [r, in]``, ``B [out_i, r]``) into
    ``slot`` of ``layers`` (kernel-path :class:`~rlserve.lora.layers.LoRALinear` s)."""
    plan = SlotPlan()
    for lin in layers:
        a_slot, b_slot = lin.a_stack[slot], lin.b_stack[slot]
        hit = 0
        for i, (module, offset, size) in enumerate(lin.slices):
            ab = parts.get(module)
            if ab is None:
                continue
            r = ab["A"].shape[0]
            plan.a_dst.append(a_slot[i * lin.max_rank:i * lin.max_rank + r])
            plan.a_src.append(ab["A"])
            plan.b_dst.append(b_slot[offset:offset + size, :r])
            plan.b_src.append(ab["B"])
            hit += 1 if r == lin.max_rank else 0.5  # a short rank leaves padding to zero
        if hit < len(lin.slices):
            plan.zero += [a_slot, b_slot]
        plan.layers.append((lin, hit > 0))
    return plan


@torch.no_grad()
def write_slots(plan: SlotPlan, scaling: float) -> None:
    """Run ``plan``: zero, ``B *= scaling`` in place (``plan.b_src``: the receive's float32
    staging buffers, :func:`slots_ok`), then copy ``A`` and ``B`` into their
    slot views (casting to the slots' dtype)."""
    if plan.zero:
        torch._foreach_zero_(plan.zero)
    if plan.b_src:
        torch._foreach_mul_(plan.b_src, float(scaling))
        torch._foreach_copy_(plan.b_dst, plan.b_src)
    if plan.a_src:
        torch._foreach_copy_(plan.a_dst, plan.a_src)
