"""The LoRA math of one step: each row of the flat batch runs under its own adapter (or none).

For a base linear ``y = x W^T`` whose output packs several checkpoint matrices (``qkv_proj`` =
``[q; k; v]``, ``gate_up_proj`` = ``[gate; up]``), each packed part ("slice", output columns
``offset : offset + size``) has, per adapter, its own factors ``A [r, in]`` and ``B' [size, r]``
(``B' = scaling x B``, :mod:`rlserve.lora.adapter`). Per row ``t`` under adapter ``a``:

    y[t, offset:offset+size] += (x[t] A_a^T) B'_a^T

Two paths behind :func:`apply_lora`, chosen per model (:class:`rlserve.lora.model.LoRAModel`):

- CPU (dense grouping): the step's rows are grouped by adapter once (:class:`LoRABatch`
  ``groups``); each group runs as two dense products added into ``y`` in place: shrink
  ``x A_cat^T`` with the slices' ``A`` stacked (``[sum r_i, in]``), expand with their ``B'``
  placed block-diagonally in one ``[out, sum r_i]`` matrix (zeros elsewhere): at decode sizes
  2-4 small kernels per layer instead of 2 per slice.
- kernel (CUDA; CPU only under ``TRITON_INTERPRET=1`` in tests): the adapters sit in per-layer
  slot buffers ``A_stack [slots, S x max_rank, in]`` / ``B_stack [slots, out, max_rank]`` and the
  step's rows are sorted into per-slot segments (:class:`LoRABatch` ``rows`` / ``seg_start`` /
  ``seg_slot``); two Triton launches per layer whatever the mix (:mod:`rlserve.lora.triton_ops`).
  Static segment buffers make the launches capturable in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoRABatch:
    """Which adapter each row of one forward step runs under.

    Attributes:
        token_adapters: ``[T]`` int64 on the model's device: the adapter id of every row
            (0: the base model, no delta); ``None`` in kernel mode.
        groups: CPU path: ``[(adapter_id, rows)]`` for every adapter id > 0 of the step: ``rows``
            an int64 index tensor ``[n]`` into the batch, or ``None`` when the adapter has every row.
        rows / seg_start / seg_slot: kernel path (:mod:`rlserve.lora.triton_ops`): int32 ``[T']``
            row indices sorted by slot (base rows left out), ``[G + 1]`` segment starts into
            ``rows``, ``[G]`` each segment's slot (-1: empty).
        max_rows: kernel path: a bound of any segment's row count (the launch grid's).
        static: the segment tensors are a CUDA graph's static buffers: every layer runs its
            kernels (also layers no adapter targets: their slots hold zeros).
    """

    token_adapters: torch.Tensor | None
    groups: list[tuple[int, torch.Tensor | None]]
    rows: torch.Tensor | None = None
    seg_start: torch.Tensor | None = None
    seg_slot: torch.Tensor | None = None
    max_rows: int = 0
    static: bool = False

    @classmethod
    def build(cls, seq_adapters: list[int], query_lens: list[int], device,
              slot_of: dict[int, int] | None = None) -> "LoRABatch | None":
        """The batch of a step of sequences ``seq_adapters[i]`` (adapter id, 0 = base) with
        ``query_lens[i]`` rows each (in order); ``None`` when every sequence is on the base model.
        ``slot_of`` (adapter id -> slot): build the kernel path's segments instead of groups."""
        if not any(seq_adapters):
            return None
        if slot_of is not None:
            rows, seg_start, seg_slot = segments(seq_adapters, query_lens, slot_of)
            meta = torch.tensor(rows + seg_start + seg_slot, dtype=torch.int32).to(device)
            n, g = len(rows), len(seg_slot)
            longest = max(b - a for a, b in zip(seg_start, seg_start[1:]))
            return cls(None, [], meta[:n], meta[n:n + g + 1], meta[n + g + 1:], longest)
        token = torch.repeat_interleave(torch.tensor(seq_adapters, dtype=torch.int64),
                                        torch.tensor(query_lens, dtype=torch.int64))
        ids = sorted(set(seq_adapters) - {0})
        if len(ids) == 1 and 0 not in seq_adapters:
            groups = [(ids[0], None)]
        else:
            groups = [(a, (token == a).nonzero().flatten().to(device)) for a in ids]
        return cls(token.to(device), groups)


def segments(seq_adapters: list[int], query_lens: list[int], slot_of: dict[int, int],
             num_slots: int | None = None) -> tuple[list[int], list[int], list[int]]:
    """``(rows, seg_start, seg_slot)`` of a step (see :class:`LoRABatch`): the rows of each
    adapter's sequences, adapters in slot order, base rows left out. With ``num_slots`` there is
    one segment per slot (empty ones get slot -1: a CUDA graph's fixed grid)."""
    by_slot: dict[int, list[int]] = {}
    row = 0
    for a, q in zip(seq_adapters, query_lens):
        if a:
            by_slot.setdefault(slot_of[a], []).extend(range(row, row + q))
        row += q
    rows, seg_start, seg_slot = [], [0], []
    for slot in (range(num_slots) if num_slots is not None else sorted(by_slot)):
        got = by_slot.get(slot, [])
        rows.extend(got)
        seg_start.append(len(rows))
        seg_slot.append(slot if got else -1)
    return rows, seg_start, seg_slot


class LoRALinear:
    """The adapters' factors of one base linear layer.

    Args:
        slices: ``[(hf_module, offset, size)]``: the checkpoint matrices packed in the layer's
            output, in order (``model.layers.0.self_attn.q_proj``, 0, q_size), ...
        in_features: the layer's input width.

    Attributes:
        adapters: CPU path: ``{adapter_id: (A_cat [sum r_i, in], B_cat [out, sum r_i])}`` over the
            slices that adapter targets (an adapter may target only some): ``B_cat[offset_i :
            offset_i + size_i, col_i : col_i + r_i] = B'_i``, zero elsewhere. Kernel path
            (:meth:`use_slots`): ``{adapter_id: slot}`` of the adapters that target this layer.
        a_stack / b_stack: kernel path: ``[slots, S x max_rank, in]`` / ``[slots, out, max_rank]``
            (zeros where an adapter has no factor, ranks padded with zeros).
    """

    def __init__(self, slices: list[tuple[str, int, int]], in_features: int):
        self.slices = slices
        self.in_features = in_features
        self.out_features = sum(size for _, _, size in slices)
        self.offsets = tuple(offset for _, offset, _ in slices)
        self.adapters: dict[int, object] = {}
        self.a_stack: torch.Tensor | None = None
        self.b_stack: torch.Tensor | None = None
        self.max_rank = 0

    def use_slots(self, slots: int, max_rank: int, dtype: torch.dtype, device) -> None:
        """Switch to the kernel path: allocate the zeroed slot buffers (``slots`` adapters of
        rank <= ``max_rank``)."""
        self.max_rank = int(max_rank)
        self.a_stack = torch.zeros((slots, len(self.slices) * self.max_rank, self.in_features), dtype=dtype,
                                   device=device)
        self.b_stack = torch.zeros((slots, self.out_features, self.max_rank), dtype=dtype, device=device)

    def add(self, adapter_id: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], slot: int = -1) -> None:
        """Hold ``adapter_id``'s factors of this layer's slices (``weights``: ``{hf_module: (A, B')}``,
        as :class:`rlserve.lora.adapter.LoRAAdapter`; kernel path: in ``slot``, zeroed first);
        nothing held when it targets none of them."""
        parts = [(i, offset, size, weights[module]) for i, (module, offset, size) in enumerate(self.slices)
                 if module in weights]
        if self.a_stack is not None:
            a_slot, b_slot = self.a_stack[slot], self.b_stack[slot]
            a_slot.zero_()
            b_slot.zero_()
            for i, offset, size, (a, b) in parts:
                r = a.shape[0]
                a_slot[i * self.max_rank:i * self.max_rank + r].copy_(a)
                b_slot[offset:offset + size, :r].copy_(b)
            if parts:
                self.adapters[adapter_id] = slot
            return
        if not parts:
            return
        a_cat = torch.cat([a for _, _, _, (a, _) in parts]).contiguous()
        b_cat = a_cat.new_zeros((self.out_features, a_cat.shape[0]))
        col = 0
        for _, offset, size, (a, b) in parts:
            b_cat[offset:offset + size, col:col + a.shape[0]] = b
            col += a.shape[0]
        self.adapters[adapter_id] = (a_cat, b_cat)

    def remove(self, adapter_id: int) -> None:
        self.adapters.pop(adapter_id, None)


def apply_lora(lin: LoRALinear, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    """Add every row's adapter delta into ``y`` in place and return it.

    Args:
        lin: the layer's adapters.
        x: ``[T, in]`` the layer's input (model dtype).
        y: ``[T, out]`` the base layer's output, same dtype.
        batch: the step's rows by adapter.

    Rows of an adapter that does not target this layer (or the base model) are left as they are.
    """
    if batch.rows is not None:
        from rlserve.lora.triton_ops import lora_expand, lora_shrink

        if x.stride(-1) != 1:
            x = x.contiguous()
        t = lora_shrink(x, lin.a_stack, batch.rows, batch.seg_start, batch.seg_slot, batch.max_rows)
        return lora_expand(t, lin.b_stack, y, lin.offsets, batch.rows, batch.seg_start, batch.seg_slot,
                           batch.max_rows)
    for adapter_id, rows in batch.groups:
        held = lin.adapters.get(adapter_id)
        if held is None:
            continue
        a_cat, b_cat = held
        if rows is None:
            y.addmm_(x @ a_cat.t(), b_cat.t())  # y += (x A^T) B^T
        else:
            y.index_add_(0, rows, (x.index_select(0, rows) @ a_cat.t()) @ b_cat.t())
    return y
