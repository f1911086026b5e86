"""CUDA graphs for decode steps: capture once per batch size, replay every step.

The scheme follows nano-vllm / vLLM (``capture_model``): graphs are captured for a
ladder of batch sizes ``1, 2, 4, 8, 16, 32, 48, ...`` (multiples of 16) up to
``max_num_seqs``, largest first, all sharing one memory pool. A decode step of ``B``
sequences replays the smallest captured size ``bs >= B``; rows ``B..bs`` are padding
with context length 0, so their K/V write is skipped (slot -1) and their attention
reads nothing, and their hidden states are ignored.

Static inputs live in one int32 device buffer, filled by a single host-to-device copy
from a pinned staging buffer per step::

    [ input_ids (max_bs) | seq_lens (max_bs) | block_tables (max_bs x max_blocks) ]

Everything else a decode step needs is derived on the device *inside* the graph, so no
per-step Python value reaches a kernel: ``positions = seq_lens - 1``;
``slot_mapping = block_tables[b, pos // block_size] * block_size + pos % block_size``
(-1 where ``seq_lens == 0``). The attention metadata handed to the model carries
``max_seq_len = max_model_len``, a static upper bound that fixes the decode kernel's
split plan per batch size (see :func:`rlserve.layers.triton_attention.plan_num_splits`).

What a graph bakes in, and why it stays valid:
- parameter storage: weight updates copy **in place** (``param.data.copy_``), never
  re-assign tensors, so a replay always reads the current weights;
- the KV-cache tensors: :meth:`DecodeCUDAGraphs` is rebuilt whenever the runner
  re-allocates the cache;
- the attention backend: graphs are only used with a backend whose KV write and decode
  attention are free of host syncs and of per-step Python values (``"triton"``).

The logits head is not in the graph: :meth:`run` returns hidden states ``[B, hidden]``
and the runner applies ``compute_logits`` to the rows it wants.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from rlserve.h2d import fill_rows, gather_rows
from rlserve.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch-size ladder: 1, 2, 4, 8, then multiples of 16 up to ``max_num_seqs``
    (which is always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


def specialization_representatives(sizes: list[int]) -> list[int]:
    """One batch size per class of sizes that Triton may compile apart, the largest of each: Triton
    specializes an integer argument by whether it equals 1 and whether it is divisible by 16, so a
    size's class is ``(size == 1, its power-of-two factor capped at 16)`` (which also decides those
    properties for ``size * k`` of a power-of-two ``k``). E.g. the default ladder 1, 2, 4, 8, 16,
    32, ..., 256 -> [256, 8, 4, 2, 1]. Kernel choices that follow the size's magnitude (split or
    not) are covered by the largest and the smallest sizes only: anything this misses compiles
    where it is first launched, as before."""
    best: dict[tuple[bool, int], int] = {}
    for s in sizes:
        key = (s == 1, min((s & -s), 16))
        best[key] = max(best.get(key, 0), s)
    return sorted(best.values(), reverse=True)


def decode_positions_and_slots(
    seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and KV slots of a decode batch, computed on the device.

    Args:
        seq_lens: ``[B]`` int32 context lengths including the new token (0 = padding row).
        block_tables: ``[B, max_blocks]`` int32.
        block_size: tokens per block.

    Returns:
        ``(positions [B] int64 = seq_lens - 1 (0 for padding), slot_mapping [B] int64``
        with -1 for padding rows).
    """
    pos = (seq_lens - 1).clamp_min(0).long()
    blk = block_tables.gather(1, (pos // block_size).unsqueeze(1)).squeeze(1).long()
    slot = torch.where(seq_lens > 0, blk * block_size + pos % block_size, torch.full_like(pos, -1))
    return pos, slot


class DecodeCUDAGraphs:
    """Captured decode graphs of one model runner.

    Args:
        model: the model (``forward(input_ids, positions, meta) -> hidden [T, H]``) with its
            KV caches already bound.
        device: the CUDA device.
        block_size: tokens per KV block.
        max_num_seqs: largest decode batch; graphs are captured up to this size.
        max_model_len: context length bound (tokens); fixes the block-table width
            ``ceil(max_model_len / block_size)`` and the attention split plan.
        sizes: batch sizes to capture (default :func:`capture_sizes`).
        lora: a :class:`rlserve.lora.model.LoRAModel` on the kernel path: these graphs run decode
            steps with adapters (its kernels read static segment buffers that :meth:`run` fills
            from ``lora_ids``); ``None``: base-model graphs.

    On a CPU device nothing is captured: :meth:`run` executes the same static-buffer
    forward eagerly. That is only for testing the padding and input derivation without a
    GPU (with Triton's interpreter standing in for the kernels).
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        sizes: list[int] | None = None,
        lora=None,
    ):
        self.model = model
        self.lora = lora
        self.device = device
        self.block_size = block_size
        self.max_model_len = int(max_model_len)
        self.sizes = sorted(sizes or capture_sizes(max_num_seqs))
        self.max_bs = self.sizes[-1]
        self.max_blocks = -(-self.max_model_len // block_size)
        mb = self.max_bs
        n = 2 * mb + mb * self.max_blocks
        self.emulate = device.type != "cuda"
        self._host = torch.zeros(n, dtype=torch.int32)
        if not self.emulate:
            self._host = self._host.pin_memory()
        self._host_np = self._host.numpy()
        self._ids_np = self._host_np[:mb]
        self._seq_np = self._host_np[mb : 2 * mb]
        self._bt_np = self._host_np[2 * mb :].reshape(mb, self.max_blocks)
        self._dev = torch.zeros(n, dtype=torch.int32, device=device)
        self.input_ids = self._dev[:mb]
        self.seq_lens = self._dev[mb : 2 * mb]
        self.block_tables = self._dev[2 * mb :].view(mb, self.max_blocks)
        self.query_start_loc = torch.arange(mb + 1, dtype=torch.int32, device=device)
        self._copy_done = None if self.emulate else torch.cuda.Event()
        self._copy_pending = False
        if lora is not None:
            lora.prepare_static(mb)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.capture_seconds = 0.0
        self.num_replays = 0

    # ---- the captured computation ------------------------------------------------------
    def _forward(self, bs: int) -> torch.Tensor:
        """Model forward for ``bs`` padded rows, reading only the static buffers."""
        P = self.block_size
        seq = self.seq_lens[:bs]
        bt = self.block_tables[:bs]
        pos, slot = decode_positions_and_slots(seq, bt, P)
        meta = AttentionMetadata(
            slot_mapping=slot,
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=seq,
            block_tables=bt,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            block_size=P,
            # not read by graph-safe backends; present to honour the contract's types
            query_start_loc_cpu=list(range(bs + 1)),
            seq_lens_cpu=[self.max_model_len] * bs,
        )
        if self.lora is None:
            return self.model(self.input_ids[:bs].long(), pos, meta)
        with self.lora.static_step(bs):
            return self.model(self.input_ids[:bs].long(), pos, meta)

    def forward_eager(self, bs: int) -> torch.Tensor:
        """The captured computation for ``bs`` padded rows (``bs`` one of :attr:`sizes`), run
        eagerly on whatever the static buffers hold (zeros before any :meth:`run`: padding rows,
        no KV write): a warm-up's forward. Returns hidden states ``[bs, hidden]``."""
        return self._forward(bs)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per size (largest first, one shared memory pool). The static
        buffers hold padding (context 0) during capture, so nothing is written to the KV
        cache."""
        t0 = time.perf_counter()
        self._dev.zero_()
        if self.emulate:
            return
        for bs in reversed(self.sizes):
            self._forward(bs)  # warm-up: compiles kernels, initialises cuBLAS workspaces
            torch.cuda.synchronize(self.device)
            g = torch.cuda.CUDAGraph()
            # thread_local: other engine threads (data-parallel replicas) may keep running
            with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"):
                out = self._forward(bs)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[bs] = g
            self.outputs[bs] = out
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        logger.info("captured %d decode CUDA graphs (batch %d..%d) in %.2fs",
                    len(self.sizes), self.sizes[0], self.max_bs, self.capture_seconds)

    # ---- replay ------------------------------------------------------------------------
    def can_run(self, num_seqs: int, max_seq_len: int) -> bool:
        return 0 < num_seqs <= self.max_bs and max_seq_len <= self.max_model_len

    def padded_size(self, num_seqs: int) -> int:
        for s in self.sizes:
            if s >= num_seqs:
                return s
        raise ValueError(f"batch of {num_seqs} exceeds the largest captured size {self.max_bs}")

    def run(self, input_ids: list[int], seq_lens: list[int], block_tables: list[list[int]],
            ids_from: tuple | None = None, lora_ids: list[int] | None = None) -> torch.Tensor:
        """Replay the graph for a decode batch.

        Args:
            input_ids: ``B`` token ids (the last token of each sequence).
            ids_from: optional ``(tokens, rows)``: the ids are ``tokens[rows]`` on the device
                instead (``StepInput.input_ids_from``; ``input_ids`` holds placeholders);
                ``(tokens, rows, where)``: only rows ``where`` take ``tokens[rows]``.
            seq_lens: ``B`` context lengths including that token (``<= max_model_len``).
            block_tables: ``B`` block-id lists, each covering its ``seq_lens`` entry.
            lora_ids: LoRA graphs: each sequence's adapter id (0: base).

        Returns:
            hidden states ``[B, hidden]`` (a view into the graph's output; valid until the
            next replay).
        """
        B = len(input_ids)
        bs = self.padded_size(B)
        if self.emulate:
            pass
        elif self._copy_pending:
            self._copy_done.synchronize()  # the staging buffer is free again
        self._ids_np[:B] = input_ids
        self._ids_np[B:bs] = 0
        self._seq_np[:B] = seq_lens
        self._seq_np[B:bs] = 0
        bt_np = self._bt_np
        mb = self.max_blocks
        for i, row in enumerate(block_tables):
            k = len(row)
            if k > mb:  # blocks past max_model_len are never read
                row, k = row[:mb], mb
            bt_np[i, :k] = row
        n = 2 * self.max_bs + bs * self.max_blocks
        self._dev[:n].copy_(self._host[:n], non_blocking=True)
        if ids_from is not None and len(ids_from) == 3:  # some rows from the host, the rest from the device
            fill_rows(self.input_ids, *ids_from)
        elif ids_from is not None:  # stream-ordered after the staging copy, before the replay
            self.input_ids[:B].copy_(gather_rows(*ids_from))
        if self.lora is not None:
            self.lora.fill_static(lora_ids or [0] * B)
        if self.emulate:
            self.num_replays += 1
            with torch.inference_mode():
                return self._forward(bs)[:B]
        self._copy_done.record()
        self._copy_pending = True
        self.graphs[bs].replay()
        self.num_replays += 1
        return self.outputs[bs][:B]

    def memory_bytes(self) -> int:
        """Bytes of the static input buffers (the graph pool is not counted)."""
        return self._dev.numel() * 4 + self.query_start_loc.numel() * 4
