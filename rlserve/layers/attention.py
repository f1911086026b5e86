"""Paged attention: the metadata contract between the model runner and the model, and
the pure-PyTorch backend (CPU, reference, and fallback on GPU).

The KV cache of one layer is two tensors ``k_cache`` and ``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]`` (dtype = the model dtype), bound
onto each :class:`Attention` module by the model runner (``module.k_cache``,
``module.v_cache``). A token at position ``p`` of a sequence lives in block
``block_table[p // block_size]`` at offset ``p % block_size``; its flat *slot* is
``block_id * block_size + offset``.

A forward step works on a flat batch of ``T`` tokens from ``B`` sequences; sequence
``i`` contributes the query tokens ``query_start_loc[i]:query_start_loc[i+1]``, which are
the *last* tokens of a context of ``seq_lens[i]`` tokens (a prefill has many query
tokens; a decode has one; a prefix-cache hit makes a prefill start past 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class AttentionMetadata:
    """Describes one forward step's batch to the attention layers.

    Attributes:
        slot_mapping: ``[T]`` int64, flat KV-cache slot for each query token's K/V; -1 means
            "do not write" (padding, e.g. in CUDA-graph batches).
        query_start_loc: ``[B+1]`` int32 cumulative query lengths (``query_start_loc[0] == 0``).
        seq_lens: ``[B]`` int32, context length of each sequence *after* this step's tokens.
        block_tables: ``[B, max_blocks]`` int32 block ids; padding entries are 0 and never read
            past ``seq_lens``.
        max_query_len: largest query length in the batch (tokens).
        max_seq_len: largest ``seq_lens`` entry (tokens).
        block_size: tokens per KV block.
        query_start_loc_cpu / seq_lens_cpu: the same as Python lists, so the backend can plan
            without a device-to-host sync.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    block_size: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1

    @staticmethod
    def build(
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """Build metadata from per-sequence Python lists.

        Args:
            query_lens: new tokens per sequence this step (each >= 1).
            seq_lens: context length per sequence after this step (>= query_len).
            block_tables: block ids per sequence, enough to hold ``seq_lens[i]`` tokens.
            block_size: tokens per block.
            device: where the tensors go.

        Raises:
            ValueError: if the lists disagree in length, a query is longer than its context,
                or a block table is too short.
        """
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        slots: list[int] = []
        qsl = [0]
        for q, s, bt in zip(query_lens, seq_lens, block_tables):
            if q < 1 or q > s:
                raise ValueError(f"query length {q} must be in [1, seq_len={s}]")
            if len(bt) * block_size < s:
                raise ValueError(f"block table of {len(bt)} blocks cannot hold {s} tokens")
            for pos in range(s - q, s):
                slots.append(bt[pos // block_size] * block_size + pos % block_size)
            qsl.append(qsl[-1] + q)
        max_blocks = max((len(bt) for bt in block_tables), default=0)
        bt_tensor = torch.zeros((len(block_tables), max(max_blocks, 1)), dtype=torch.int32)
        for i, bt in enumerate(block_tables):
            if bt:
                bt_tensor[i, : len(bt)] = torch.tensor(bt, dtype=torch.int32)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=bt_tensor.to(device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            block_size=block_size,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=list(seq_lens),
        )


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter this step's keys/values into the paged cache.

    Args:
        k, v: ``[T, num_kv_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: ``[T]`` int64; entries < 0 are skipped.
    """
    kc = k_cache.view(-1, *k_cache.shape[2:])
    vc = v_cache.view(-1, *v_cache.shape[2:])
    valid = slot_mapping >= 0
    if bool(valid.all()):
        kc.index_copy_(0, slot_mapping, k.to(kc.dtype))
        vc.index_copy_(0, slot_mapping, v.to(vc.dtype))
    else:
        idx = slot_mapping[valid]
        kc.index_copy_(0, idx, k[valid].to(kc.dtype))
        vc.index_copy_(0, idx, v[valid].to(vc.dtype))


def torch_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Reference paged attention in plain PyTorch (causal, grouped-query).

    Gathers each sequence's context from the cache through its block table, pads the
    batch to ``max_query_len`` x ``max_seq_len`` and runs
    ``F.scaled_dot_product_attention`` with a mask that is causal relative to the end of
    each context. Works on any device; O(B * max_query_len * max_seq_len) memory.

    Args:
        q: ``[T, num_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (already holding
            this step's K/V).
        meta: the step's metadata.
        scale: softmax scale (usually ``head_dim ** -0.5``).

    Returns:
        ``[T, num_heads, head_dim]`` in ``q.dtype``.
    """
    T, H, D = q.shape
    B = meta.num_seqs
    Hkv = k_cache.shape[2]
    bs = meta.block_size
    max_q, max_s = meta.max_query_len, meta.max_seq_len
    device = q.device
    n_blocks = (max_s + bs - 1) // bs
    bt = meta.block_tables[:, :n_blocks].long()  # [B, nb]
    # gather context: [B, nb*bs, Hkv, D]
    k_ctx = k_cache[bt].reshape(B, n_blocks * bs, Hkv, D)[:, :max_s]
    v_ctx = v_cache[bt].reshape(B, n_blocks * bs, Hkv, D)[:, :max_s]
    qsl = meta.query_start_loc_cpu
    q_lens = [qsl[i + 1] - qsl[i] for i in range(B)]
    if max_q == 1:
        q_pad = q.view(B, 1, H, D)
    else:
        q_pad = q.new_zeros(B, max_q, H, D)
        for i in range(B):
            q_pad[i, : q_lens[i]] = q[qsl[i] : qsl[i + 1]]
    seq_lens = meta.seq_lens.to(device=device, dtype=torch.long)
    q_lens_t = torch.tensor(q_lens, device=device, dtype=torch.long)
    # absolute position of each padded query row: seq_len - q_len + row
    q_pos = (seq_lens - q_lens_t)[:, None] + torch.arange(max_q, device=device)[None, :]  # [B, max_q]
    k_pos = torch.arange(max_s, device=device)
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < seq_lens[:, None, None])
    qh = q_pad.transpose(1, 2)  # [B, H, max_q, D]
    kh = k_ctx.transpose(1, 2).to(q.dtype)  # [B, Hkv, max_s, D]
    vh = v_ctx.transpose(1, 2).to(q.dtype)
    # grouped-query attention without materialising repeated K/V (query head h reads KV head h // (H/Hkv))
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask[:, None], scale=scale, enable_gqa=Hkv != H)
    out = out.transpose(1, 2)  # [B, max_q, H, D]
    if max_q == 1:
        return out.reshape(T, H, D)
    return torch.cat([out[i, : q_lens[i]] for i in range(B)], dim=0)


# name -> fn(q, k_cache, v_cache, meta, scale) -> out. GPU backends register here.
ATTENTION_BACKENDS: dict[str, Callable[..., torch.Tensor]] = {"torch": torch_paged_attention}
# name -> fn(k, v, k_cache, v_cache, slot_mapping) -> None: a backend's own KV-cache writer
# (e.g. a fused, sync-free kernel usable inside CUDA graphs); backends without an entry use
# write_kv_cache.
KV_CACHE_WRITERS: dict[str, Callable[..., None]] = {}
_active_backend = ["torch"]


def set_attention_backend(name: str) -> None:
    """Select the attention backend used by every :class:`Attention` module.

    Raises:
        ValueError: if ``name`` is not registered in ``ATTENTION_BACKENDS``.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(ATTENTION_BACKENDS)}")
    _active_backend[0] = name


def get_attention_backend() -> str:
    return _active_backend[0]


class Attention(nn.Module):
    """Paged causal self-attention over this rank's heads.

    The model runner binds ``k_cache`` / ``v_cache`` (see module docstring) before the
    first forward. Inputs are already projected and rotated.

    Args:
        num_heads: query heads on this TP rank.
        head_dim: per-head size.
        scale: softmax scale.
        num_kv_heads: KV heads on this TP rank (divides ``num_heads``).
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Args: q ``[T, num_heads*head_dim]``, k/v ``[T, num_kv_heads*head_dim]``.
        Returns ``[T, num_heads*head_dim]``.

        Raises:
            RuntimeError: if no KV cache was bound.
        """
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("Attention has no KV cache bound; the model runner must bind one")
        T = q.shape[0]
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        backend = _active_backend[0]
        KV_CACHE_WRITERS.get(backend, write_kv_cache)(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = ATTENTION_BACKENDS[backend](q, self.k_cache, self.v_cache, meta, self.scale)
        return out.reshape(T, self.num_heads * self.head_dim)
