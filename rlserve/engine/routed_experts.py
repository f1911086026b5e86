"""Routed-experts replay (vLLM's ``--enable-return-routed-experts``, the R3 of MoE RL training):
every choice returns, per token, per decoder layer, the ids of the experts its router picked, so
the trainer can route its forward the same way.

What a sample returns (vLLM 0.32's ``CompletionOutput.routed_experts``): a numpy array
``[num_tokens - 1 - routed_experts_prompt_start, num_hidden_layers, num_experts_per_tok]`` of
``uint8`` (``num_experts <= 256``) or ``uint16`` (more), rows in token order from prompt position
``routed_experts_prompt_start`` (a request field, default 0) to the second-to-last token of the
sample: the last sampled token was never forwarded, so it has no routing. Each row holds the
router's top-k in its order (largest probability first); a layer without experts
(``mlp_only_layers``, ``decoder_sparse_step``) is all zeros, as in vLLM. Set on the sample's
final output only. Over HTTP (completions, chat, TRL's ``/generate/``) the array travels as
vLLM's ``numpy2base64``: base64 of the ``.npy`` bytes (``np.save`` with ``allow_pickle=False``);
decode with ``np.load(io.BytesIO(base64.b64decode(s)), allow_pickle=False)``
(:func:`decode_routed_experts`). SGLang's raw int32 encoding was not taken: the ``.npy`` header
carries shape and dtype, and uint8 is 4x smaller.

Where the rows are kept: beside the KV cache. :class:`RoutedExpertsRecorder` holds a host array
of one row per KV slot (``num_blocks * block_size`` rows; ``num_hidden_layers * top_k`` bytes
each with uint8: Qwen3-30B-A3B 48 x 8 = 384 B per token against its 96 KiB of bf16 KV). Every
step writes each computed token's row at that token's KV slot, so a slot's row always belongs to
the token whose K/V the slot holds. A prefix-cache hit therefore finds the prompt's routing with
the reused blocks (computed by the request that filled them, the same tokens at the same
positions), and a preempted sequence's recomputation writes its rows again: prefix caching stays
on for replay requests.
"""

from __future__ import annotations

import base64
import io

import numpy as np


def routed_dtype(num_experts: int) -> np.dtype:
    """vLLM's choice: uint8 for at most 256 experts, else uint16."""
    return np.dtype(np.uint8 if num_experts <= 256 else np.uint16)


def encode_routed_experts(arr: np.ndarray) -> str:
    """vLLM's ``numpy2base64``: base64 (ASCII) of ``arr``'s ``.npy`` bytes, no pickle."""
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_routed_experts(s: str) -> np.ndarray:
    """Inverse of :func:`encode_routed_experts` (never unpickles).

    Raises:
        ValueError: not base64 of a ``.npy`` array without objects.
    """
    return np.load(io.BytesIO(base64.b64decode(s, validate=True)), allow_pickle=False)


def npy_bytes(arr: np.ndarray) -> bytes:
    """``arr`` as ``.npy`` bytes (the engine-core process sends these to the API process)."""
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def from_npy_bytes(b: bytes) -> np.ndarray:
    """Inverse of :func:`npy_bytes` (``allow_pickle=False``)."""
    return np.load(io.BytesIO(b), allow_pickle=False)


class RoutedExpertsRecorder:
    """One row of routed expert ids per KV slot (see the module docstring).

    Args:
        capture: the rank-0 model's :class:`rlserve.layers.moe.RoutedExpertsCapture` (its
            ``buffer`` holds the last forward's ``[T, num_layers, top_k]`` int32 ids).
        num_blocks / block_size: the KV cache's geometry.
    """

    def __init__(self, capture, num_blocks: int, block_size: int):
        self.capture = capture
        self.block_size = block_size
        self.dtype = routed_dtype(capture.num_experts)
        self.rows = np.zeros((num_blocks * block_size, capture.num_layers, capture.top_k), dtype=self.dtype)

    def _slots(self, block_table: list[int], start: int, end: int) -> np.ndarray:
        pos = np.arange(start, end, dtype=np.int64)
        return np.asarray(block_table, dtype=np.int64)[pos // self.block_size] * self.block_size + pos % self.block_size

    def record_step(self, step) -> None:
        """Store the routed ids of the forward that just ran ``step`` (a
        :class:`~rlserve.engine.worker.model_runner.StepInput`) at its tokens' KV slots.

        Raises:
            RuntimeError: the model captured no routing for this step (a forward path that
                bypasses the capture; a CUDA graph replay reports its rows through
                ``RoutedExpertsCapture.replayed``).
        """
        buf = self.capture.take()
        T = len(step.positions)
        if buf is None or buf.shape[0] != T:
            raise RuntimeError(f"routed-experts capture holds {None if buf is None else buf.shape[0]} rows for a "
                               f"step of {T} tokens")
        ids = buf.cpu().numpy().astype(self.dtype)
        r = 0
        for q, n, table in zip(step.query_lens, step.seq_lens, step.block_tables):
            self.rows[self._slots(table, n - q, n)] = ids[r:r + q]
            r += q

    def read(self, seq, start: int = 0, end: int | None = None) -> np.ndarray | None:
        """The routed ids of ``seq``'s tokens at positions ``[start, end)`` (default ``end``: the
        forwarded ones, ``len(seq) - 1``): ``[end - start, num_layers, top_k]`` (a copy), or
        ``None`` when its KV blocks do not cover them (preempted, not yet recomputed)."""
        end = len(seq) - 1 if end is None else end
        start = min(max(start, 0), max(end, 0))
        if len(seq.block_table) * self.block_size < end:
            return None
        return self.rows[self._slots(seq.block_table, start, end)]


def routed_delta(recorder: RoutedExpertsRecorder | None, seq, sent: int) -> tuple[np.ndarray | None, int]:
    """The rows of ``seq`` not sent yet, for the engine-core process's per-step deltas:
    ``(rows or None, positions sent after these)``. ``sent``: the next position to send
    (starts at ``routed_experts_prompt_start``). A finished sequence gives the rest of its
    final array (:attr:`Sequence.routed_experts`); a running one the rows of the tokens
    forwarded so far (``num_computed_tokens``)."""
    if recorder is None:
        return None, sent
    start = seq.params.routed_experts_prompt_start
    if seq.finish_reason is not None:
        final = seq.routed_experts
        if final is None:
            return None, sent
        return final[sent - start:], start + final.shape[0]
    end = seq.num_computed_tokens
    if end <= sent or not seq.block_table:
        return None, sent
    rows = recorder.read(seq, sent, end)
    return (None, sent) if rows is None else (rows, end)


class RoutedChunks:
    """API-process side: a sample's routed rows as they arrive, in order (vLLM's
    ``routed_experts_chunks``); :meth:`result` joins them at the finish, cut to the tokens the
    sample kept (a stop string matched here drops tokens the core sampled past it)."""

    __slots__ = ("chunks",)

    def __init__(self):
        self.chunks: list[np.ndarray] = []

    def add(self, b: bytes) -> None:
        self.chunks.append(from_npy_bytes(b))

    def result(self, rows: int) -> np.ndarray | None:
        """The first ``rows`` rows of everything received (None when nothing came)."""
        if not self.chunks:
            return None
        arr = self.chunks[0] if len(self.chunks) == 1 else np.concatenate(self.chunks, axis=0)
        return arr[:max(rows, 0)]
