"""Turns a scheduled batch into model inputs, owns the KV cache, runs the forward pass.

Everything a step needs crosses process boundaries as a :class:`StepInput` of plain
Python lists, so tensor-parallel workers run the same step from a pickled copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from rlserve.layers.attention import Attention, AttentionMetadata


@dataclass
class StepInput:
    """One forward step, as plain lists (picklable).

    Attributes:
        input_ids / positions: ``T`` flat token ids and their positions.
        query_lens / seq_lens / block_tables: per sequence (see ``AttentionMetadata.build``).
        logits_indices: rows of the flat batch whose logits are wanted (the last token of
            each sequence, plus every prompt row of sequences asking prompt logprobs).
        is_prefill: a prefill step (decode steps may use CUDA graphs).
    """

    input_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    logits_indices: list[int]
    is_prefill: bool


def kv_cache_bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes across all layers of this rank: 2 (K and V) x layers x
    block_size x kv_heads x head_dim x itemsize."""
    total = 0
    for m in model.modules():
        if isinstance(m, Attention):
            total += 2 * block_size * m.num_kv_heads * m.head_dim * torch.tensor([], dtype=dtype).element_size()
    return total


class ModelRunner:
    """Runs the model for one TP rank.

    Args:
        model: a model following the contract in docs/INTERFACES.md.
        device / dtype: where the model and KV cache live.
        block_size: tokens per KV block.
    """

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype, block_size: int):
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.num_blocks = 0
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate and bind ``[num_blocks, block_size, kv_heads, head_dim]`` K and V caches
        for every attention layer (zeros)."""
        self.num_blocks = num_blocks
        self.kv_caches = []
        for layer in self.attn_layers:
            shape = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            v = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.k_cache, layer.v_cache = k, v
            self.kv_caches.append((k, v))

    def build_metadata(self, step: StepInput) -> AttentionMetadata:
        return AttentionMetadata.build(step.query_lens, step.seq_lens, step.block_tables, self.block_size, self.device)

    @torch.inference_mode()
    def execute(self, step: StepInput) -> torch.Tensor:
        """Run one forward step.

        Returns:
            ``[len(step.logits_indices), vocab]`` float32 logits (full vocabulary).
        """
        input_ids = torch.tensor(step.input_ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(step.positions, dtype=torch.long, device=self.device)
        meta = self.build_metadata(step)
        hidden = self.model(input_ids, positions, meta)
        idx = torch.tensor(step.logits_indices, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, idx))
