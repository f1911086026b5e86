"""The LoRA math of one step: each row of the flat batch runs under its own adapter (or none).

For a base linear ``y = x W^T`` whose output packs several checkpoint matrices (``qkv_proj`` =
``[q; k; v]``, ``gate_up_proj`` = ``[gate; up]``), each packed part ("slice", output columns
``offset : offset + size``) has, per adapter, its own factors ``A [r, in]`` and ``B' [size, r]``
(``B' = scaling x B``, :mod:`rlserve.lora.adapter`). Per row ``t`` under adapter ``a``:

    y[t, offset:offset+size] += (x[t] A_a^T) B'_a^T

The step's rows are grouped by adapter once (:class:`LoRABatch`); :func:`apply_lora` runs each
group as two dense products and adds the result into ``y`` in place: shrink ``x A_cat^T`` with the
slices' ``A`` stacked (``[sum r_i, in]``), expand with their ``B'`` placed block-diagonally in one
``[out, sum r_i]`` matrix (zeros elsewhere). This is the CPU path: at decode sizes a layer's hook is
then 2-4 small kernels instead of 2 per slice (the zero blocks cost ``T x sum r_i x out`` extra
multiply-adds, a few microseconds). A batched GPU kernel (punica-style SGMV for
prefill, BGMV for decode) replaces :func:`apply_lora` with the same inputs: ``LoRABatch.token_adapters``
(the adapter per row) and ``LoRABatch.groups`` (rows sorted by adapter, i.e. SGMV's segments), with
the per-adapter factors moved into stacked ``[slots, r, in]`` / ``[slots, size, r]`` buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoRABatch:
    """Which adapter each row of one forward step runs under.

    Attributes:
        token_adapters: ``[T]`` int64 on the model's device: the adapter id of every row
            (0: the base model, no delta).
        groups: ``[(adapter_id, rows)]`` for every adapter id > 0 of the step: ``rows`` an int64
            index tensor ``[n]`` into the batch, or ``None`` when the adapter has every row.
    """

    token_adapters: torch.Tensor
    groups: list[tuple[int, torch.Tensor | None]]

    @classmethod
    def build(cls, seq_adapters: list[int], query_lens: list[int], device) -> "LoRABatch | None":
        """The batch of a step of sequences ``seq_adapters[i]`` (adapter id, 0 = base) with
        ``query_lens[i]`` rows each (in order); ``None`` when every sequence is on the base model."""
        if not any(seq_adapters):
            return None
        token = torch.repeat_interleave(torch.tensor(seq_adapters, dtype=torch.int64),
                                        torch.tensor(query_lens, dtype=torch.int64))
        ids = sorted(set(seq_adapters) - {0})
        if len(ids) == 1 and 0 not in seq_adapters:
            groups = [(ids[0], None)]
        else:
            groups = [(a, (token == a).nonzero().flatten().to(device)) for a in ids]
        return cls(token.to(device), groups)


class LoRALinear:
    """The adapters' factors of one base linear layer.

    Args:
        slices: ``[(hf_module, offset, size)]``: the checkpoint matrices packed in the layer's
            output, in order (``model.layers.0.self_attn.q_proj``, 0, q_size), ...
        in_features: the layer's input width.

    Attributes:
        adapters: ``{adapter_id: (A_cat [sum r_i, in], B_cat [out, sum r_i])}`` over the slices that
            adapter targets (an adapter may target only some): ``B_cat[offset_i : offset_i + size_i,
            col_i : col_i + r_i] = B'_i``, zero elsewhere.
    """

    def __init__(self, slices: list[tuple[str, int, int]], in_features: int):
        self.slices = slices
        self.in_features = in_features
        self.out_features = sum(size for _, _, size in slices)
        self.adapters: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def add(self, adapter_id: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Hold ``adapter_id``'s factors of this layer's slices (``weights``: ``{hf_module: (A, B')}``,
        as :class:`rlserve.lora.adapter.LoRAAdapter`); no-op when it targets none of them."""
        parts = [(offset, size, weights[module]) for module, offset, size in self.slices if module in weights]
        if not parts:
            return
        a_cat = torch.cat([a for _, _, (a, _) in parts]).contiguous()
        b_cat = a_cat.new_zeros((self.out_features, a_cat.shape[0]))
        col = 0
        for offset, size, (a, b) in parts:
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
