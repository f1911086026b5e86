"""Paged attention: the metadata contract between the model runner and the model, and
the pure-PyTorch backend (CPU, reference, and fallback on GPU).

The KV cache of one layer is two tensors ``k_cache`` and ``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]`` (dtype = the model dtype, or an fp8 type
with ``--kv-cache-dtype fp8``: then with per-layer ``k_scale`` / ``v_scale``, see
:mod:`rlserve.layers.kv_quant`), bound onto each :class:`Attention` module by the model runner
(``module.k_cache``, ``module.v_cache``). A token at position ``p`` of a sequence lives in block
``block_table[p // block_size]`` at offset ``p % block_size``; its flat *slot* is
``block_id * block_size + offset``.

A forward step works on a flat batch of ``T`` tokens from ``B`` sequences; sequence
``i`` contributes the query tokens ``query_start_loc[i]:query_start_loc[i+1]``, which are
the *last* tokens of a context of ``seq_lens[i]`` tokens (a prefill has many query
tokens; a decode has one; a prefix-cache hit makes a prefill start past 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rlserve.batch_invariant import cpu as bi_cpu, mode as bi_mode
from rlserve.h2d import to_device
from rlserve.layers import kv_quant


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
    # per-step scratch that backends share across layers (e.g. masks, gather indices)
    backend_cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1

    def writes_shared_block(self) -> bool:
        """True when a KV block this step writes is also in another sequence's block table.

        Prefix caching registers a full prompt block when it is allocated, so a sequence
        scheduled in the same step as the one computing that block reads it in this step:
        correct when every layer writes the whole step's K/V before any attention, wrong if the
        sequences ran separately (:meth:`sequences`, CPU micro-batches). Block tables are read
        on the host (CPU tensors; ``.cpu()`` copies others)."""
        bs = self.block_size
        seq = torch.tensor(self.seq_lens_cpu, dtype=torch.long)
        qsl = torch.tensor(self.query_start_loc_cpu, dtype=torch.long)
        bt = self.block_tables.cpu().long()
        cols = torch.arange(bt.shape[1])[None, :]
        read = cols < ((seq + bs - 1) // bs)[:, None]
        written = read & (cols >= ((seq - (qsl[1:] - qsl[:-1])) // bs)[:, None])
        counts = torch.bincount(bt[read])
        return bool((counts[bt[written]] > 1).any())

    def sequences(self, a: int, b: int) -> "AttentionMetadata":
        """The metadata of sequences ``a:b`` of this step alone (their query tokens are rows
        ``query_start_loc_cpu[a]:query_start_loc_cpu[b]`` of the step's inputs): tensor
        views (``query_start_loc`` rebased to 0), a fresh ``backend_cache``.

        Raises:
            ValueError: an empty or out-of-range slice.
        """
        if not 0 <= a < b <= self.num_seqs:
            raise ValueError(f"sequences({a}, {b}) of a step of {self.num_seqs} sequences")
        qsl = self.query_start_loc_cpu
        t0, t1 = qsl[a], qsl[b]
        seq_lens_cpu = self.seq_lens_cpu[a:b]
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[t0:t1],
            query_start_loc=self.query_start_loc[a:b + 1] - t0,
            seq_lens=self.seq_lens[a:b],
            block_tables=self.block_tables[a:b],
            max_query_len=max(qsl[i + 1] - qsl[i] for i in range(a, b)),
            max_seq_len=max(seq_lens_cpu),
            block_size=self.block_size,
            query_start_loc_cpu=[x - t0 for x in qsl[a:b + 1]],
            seq_lens_cpu=seq_lens_cpu,
        )

    def decode_split(self) -> "tuple[int, AttentionMetadata, AttentionMetadata] | None":
        """A mixed step's split (``--mixed-prefill-decode``: its decode rows come first): ``(d,
        metadata of sequences 0:d, of d:)`` where the first ``d`` sequences have one query token
        each and a later one more; None when no sequence leads with one token or every one has one
        (a pure decode step). The decode rows then run in the backend's decode kernel (for the
        Triton backend: flash-decoding with grouped-query packing, which reads each KV head once
        per group; the varlen prefill kernel would give each of them a ``BLOCK_M``-row tile per
        query head). Cached in ``backend_cache`` (one scan per step, sub-metadata shared by the layers)."""
        if self.max_query_len == 1:
            return None
        cached = self.backend_cache.get("decode_split", False)
        if cached is not False:
            return cached
        qsl, d = self.query_start_loc_cpu, 0
        while qsl[d + 1] - qsl[d] == 1:  # stops before num_seqs: max_query_len > 1
            d += 1
        split = (d, self.sequences(0, d), self.sequences(d, self.num_seqs)) if d else None
        self.backend_cache["decode_split"] = split
        return split

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
        parts: list = []  # runs of decode rows' slots (a list), a prefill's slots (an array)
        qsl = [0]
        offsets = None
        for q, s, bt in zip(query_lens, seq_lens, block_tables):
            if q < 1 or q > s:
                raise ValueError(f"query length {q} must be in [1, seq_len={s}]")
            if len(bt) * block_size < s:
                raise ValueError(f"block table of {len(bt)} blocks cannot hold {s} tokens")
            if q == 1:  # a decode row
                if not parts or type(parts[-1]) is not list:
                    parts.append([])
                parts[-1].append(bt[(s - 1) // block_size] * block_size + (s - 1) % block_size)
            else:  # a prefill: its blocks' slots at once (a Python step per token cost ~0.1 us a token)
                if offsets is None:
                    offsets = np.arange(block_size, dtype=np.int64)
                first, skip = divmod(s - q, block_size)
                blocks = np.asarray(bt[first:(s - 1) // block_size + 1], dtype=np.int64)
                parts.append((blocks[:, None] * block_size + offsets).ravel()[skip:skip + q])
            qsl.append(qsl[-1] + q)
        if len(parts) == 1 and type(parts[0]) is list:  # a decode step
            slots = parts[0]
        else:
            slots = torch.from_numpy(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
                                     if parts else np.zeros(0, dtype=np.int64))
        max_blocks = max(max((len(bt) for bt in block_tables), default=0), 1)
        # one tensor from a padded nested list (a per-row torch.tensor costs ~2 us x batch)
        bt_tensor = torch.tensor([list(bt) + [0] * (max_blocks - len(bt)) for bt in block_tables],
                                 dtype=torch.int32).reshape(len(block_tables), max_blocks)
        return AttentionMetadata(
            slot_mapping=to_device(slots, torch.int64, device),
            query_start_loc=to_device(qsl, torch.int32, device),
            seq_lens=to_device(seq_lens, torch.int32, device),
            block_tables=to_device(bt_tensor, torch.int32, device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            block_size=block_size,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=list(seq_lens),
        )


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter this step's keys/values into the paged cache.

    Args:
        k, v: ``[T, num_kv_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``; an fp8 cache
            stores ``saturate(x / scale)`` (:mod:`rlserve.layers.kv_quant`).
        slot_mapping: ``[T]`` int64; entries < 0 are skipped.
        k_scale, v_scale: float32 ``[1]`` scales of an fp8 cache (None: 1.0).
    """
    if kv_quant.is_fp8(k_cache.dtype):
        one = torch.ones(1, dtype=torch.float32, device=k.device)
        k = kv_quant.quantize(k, k_scale if k_scale is not None else one, k_cache.dtype).view(torch.uint8)
        v = kv_quant.quantize(v, v_scale if v_scale is not None else one, v_cache.dtype).view(torch.uint8)
    kc = kv_quant.as_bytes(k_cache).view(-1, *k_cache.shape[2:])
    vc = kv_quant.as_bytes(v_cache).view(-1, *v_cache.shape[2:])
    valid = slot_mapping >= 0
    if bool(valid.all()):
        kc.index_copy_(0, slot_mapping, k.to(kc.dtype))
        vc.index_copy_(0, slot_mapping, v.to(vc.dtype))
    else:
        idx = slot_mapping[valid]
        kc.index_copy_(0, idx, k[valid].to(kc.dtype))
        vc.index_copy_(0, idx, v[valid].to(vc.dtype))


def _to_compute(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cached K or V rows in the compute ``dtype``: fp8 rows dequantized (``x * scale``)."""
    if kv_quant.is_fp8(x.dtype):
        return kv_quant.dequantize(x, scale if scale is not None else torch.ones(1, device=x.device), dtype)
    return x.to(dtype)


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's first ``seq_len`` cached tokens: ``[seq_len, num_kv_heads, head_dim]``."""
    bs = cache.shape[1]
    n_blocks = (seq_len + bs - 1) // bs
    return cache[block_table[:n_blocks].long()].flatten(0, 1)[:seq_len]


def torch_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference paged attention in plain PyTorch (causal, grouped-query).

    Decode steps (one query token per sequence) on CPU in float32 run the native kernel of
    :mod:`rlserve.layers.cpu_attention`, which reads the blocks in place. Elsewhere (and when
    that kernel is off or cannot take the shapes) they gather every context through the
    block tables into one padded ``[B, n_blocks * block_size]`` batch and run a single
    ``F.scaled_dot_product_attention`` with a length mask (the mask and gather indices are
    built once per step and shared by all layers). Steps with prefills run one SDPA call per
    sequence over its own context (causal relative to the end of the context), so memory
    stays O(query_len x seq_len) per sequence instead of padding the batch to the longest
    prompt. Works on any device.

    Args:
        q: ``[T, num_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (already holding
            this step's K/V).
        meta: the step's metadata.
        scale: softmax scale (usually ``head_dim ** -0.5``).
        k_scale, v_scale: float32 ``[1]`` scales of an fp8 cache (:mod:`rlserve.layers.kv_quant`):
            its rows are dequantized to ``q.dtype`` (``fp8 * scale``) before the products.

    Returns:
        ``[T, num_heads, head_dim]`` in ``q.dtype``.
    """
    T, H, D = q.shape
    Hkv = k_cache.shape[2]
    gqa = Hkv != H
    if meta.max_query_len == 1:
        B = meta.num_seqs
        if q.device.type == "cpu":
            from rlserve.layers import cpu_attention

            out = cpu_attention.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
            if out is not None:
                return out
        cache = meta.backend_cache.get("torch_decode")
        if cache is None:
            n_blocks = (meta.max_seq_len + meta.block_size - 1) // meta.block_size
            bt = meta.block_tables[:, :n_blocks].reshape(-1).long()
            k_pos = torch.arange(n_blocks * meta.block_size, device=q.device)
            mask = (k_pos[None, :] < meta.seq_lens.to(device=q.device, dtype=torch.long)[:, None])[:, None, None, :]
            cache = meta.backend_cache["torch_decode"] = (bt, mask, n_blocks * meta.block_size)
        bt, mask, S = cache
        # index_select on whole blocks (a memcpy per block) measured ~1.7x faster on CPU than
        # advanced indexing of [B, n_blocks] followed by a slice
        k_sel = kv_quant.as_bytes(k_cache).index_select(0, bt).view(k_cache.dtype)
        v_sel = kv_quant.as_bytes(v_cache).index_select(0, bt).view(v_cache.dtype)
        k_ctx = _to_compute(k_sel.view(B, S, Hkv, D).transpose(1, 2), k_scale, q.dtype)  # [B, Hkv, S, D]
        v_ctx = _to_compute(v_sel.view(B, S, Hkv, D).transpose(1, 2), v_scale, q.dtype)
        out = F.scaled_dot_product_attention(q.view(B, 1, H, D).transpose(1, 2), k_ctx, v_ctx, attn_mask=mask,
                                             scale=scale, enable_gqa=gqa)
        return out.transpose(1, 2).reshape(T, H, D)
    if bi_mode.enabled() and q.device.type == "cpu":  # --batch-invariant: each query as a decode
        return bi_cpu.prefill_attention(q, k_cache, v_cache, meta, scale)
    # On CPU, SDPA takes its flash kernel only for 4-D inputs with as many K/V heads as query
    # heads: 3-D inputs or ``enable_gqa`` run the math path (a materialised [H, q, S] score
    # matrix, a masked softmax, two bmm). So the K/V heads are repeated to the query heads
    # (HF's repeat_kv) and a batch dim of 1 is added: SmolLM2's prefill attention measured
    # 2.0-2.4x less CPU time (9 heads, 3 KV heads, 128-256 tokens, one thread; 2026-12-01).
    expand = gqa and q.device.type == "cpu"
    rep = H // Hkv
    outs = []
    qsl = meta.query_start_loc_cpu
    for i, s_len in enumerate(meta.seq_lens_cpu):
        qi = q[qsl[i] : qsl[i + 1]].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        q_len = qi.shape[2]
        ki = _to_compute(_gather_context(k_cache, meta.block_tables[i], s_len).transpose(0, 1), k_scale,
                         q.dtype)  # [Hkv, S, D]
        vi = _to_compute(_gather_context(v_cache, meta.block_tables[i], s_len).transpose(0, 1), v_scale, q.dtype)
        if expand:
            ki, vi = ki.repeat_interleave(rep, dim=0), vi.repeat_interleave(rep, dim=0)
        ki, vi = ki.unsqueeze(0), vi.unsqueeze(0)
        g = gqa and not expand
        if q_len == s_len:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=g)
        else:  # queries are the last q_len positions of the context
            q_pos = torch.arange(s_len - q_len, s_len, device=q.device)
            mask = torch.arange(s_len, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=g)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs, dim=0)


# name -> fn(q, k_cache, v_cache, meta, scale[, k_scale=, v_scale=]) -> out (the scale keywords
# only for an fp8 cache). GPU backends register here.
ATTENTION_BACKENDS: dict[str, Callable[..., torch.Tensor]] = {"torch": torch_paged_attention}
# name -> fn(k, v, k_cache, v_cache, slot_mapping[, k_scale=, v_scale=]) -> None: a backend's own KV-cache writer
# (e.g. a fused, sync-free kernel usable inside CUDA graphs); backends without an entry use
# write_kv_cache.
KV_CACHE_WRITERS: dict[str, Callable[..., None]] = {}
# backends whose function also takes ``out=``: a ``[T, num_heads, head_dim]`` tensor of ``q``'s dtype (unit
# last stride) that the result is written into and returned (one kernel fewer than a copy; a mixed step's two
# calls write their halves of one output, no ``cat``)
OUT_BACKENDS: set[str] = set()
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
        # an fp8 cache's float32 [1] scales (None: the cache holds the model dtype), bound with
        # the cache; calculate_kv_scales: set them from the next forward's K/V, then clear it
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        self.calculate_kv_scales = False

    def kv_scale_kwargs(self) -> dict:
        """The backends' ``k_scale`` / ``v_scale`` keywords: empty for a cache in the model dtype
        (so a backend without fp8 support is called as before)."""
        if self.k_scale is None:
            return {}
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}

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
        if self.calculate_kv_scales and self.k_scale is not None:
            kv_quant.set_scales_from(k, v, self.k_scale, self.v_scale)
            self.calculate_kv_scales = False
        kw = self.kv_scale_kwargs()
        KV_CACHE_WRITERS.get(backend, write_kv_cache)(k, v, self.k_cache, self.v_cache, meta.slot_mapping, **kw)
        return self._attend(q, meta, kw).reshape(T, self.num_heads * self.head_dim)

    def _attend(self, q: torch.Tensor, meta: AttentionMetadata, kw: dict,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """The active backend over this step's cache: ``[T, heads, head_dim]`` (written into ``out`` when
        given, a tensor of that shape and ``q``'s dtype); a mixed step's leading decode rows and its prefill
        rows in two calls (:meth:`AttentionMetadata.decode_split`), into one output where the backend takes
        ``out`` (:data:`OUT_BACKENDS`)."""
        name = _active_backend[0]
        fn = ATTENTION_BACKENDS[name]
        takes_out = name in OUT_BACKENDS
        split = meta.decode_split()
        if split is None:
            parts = [(q, meta, out)]
        else:
            d, dec, pre = split  # d decode rows: the first d query tokens
            if out is None and not takes_out:
                return torch.cat((fn(q[:d], self.k_cache, self.v_cache, dec, self.scale, **kw),
                                  fn(q[d:], self.k_cache, self.v_cache, pre, self.scale, **kw)))
            if out is None:
                out = torch.empty_like(q)
            parts = [(q[:d], dec, out[:d]), (q[d:], pre, out[d:])]
        for qi, mi, oi in parts:
            res = fn(qi, self.k_cache, self.v_cache, mi, self.scale, **kw, **({"out": oi} if takes_out else {}))
            if oi is None:
                return res
            if res is not oi:
                oi.copy_(res)
        return out

    def forward_cached(self, q: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention when this step's K/V are already in the cache (a fused kernel wrote
        them, e.g. :func:`rlserve.layers.fused_ops.qkv_norm_rope_write`).

        Args: q ``[T, num_heads*head_dim]``; ``out``: optional, a contiguous tensor of that shape and dtype
        the result is written into. Returns ``[T, num_heads*head_dim]`` (``out`` when given).

        Raises:
            RuntimeError: if no KV cache was bound.
        """
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("Attention has no KV cache bound; the model runner must bind one")
        T = q.shape[0]
        o3 = out.view(T, self.num_heads, self.head_dim) if out is not None else None
        res = self._attend(q.view(T, self.num_heads, self.head_dim), meta, self.kv_scale_kwargs(), o3)
        return out if out is not None else res.reshape(T, self.num_heads * self.head_dim)
