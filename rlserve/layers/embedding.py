"""Vocabulary-parallel token embedding and LM head.

The vocabulary of ``V`` rows is padded to a multiple of 64 and then to a multiple of the TP
size, and split into equal contiguous ranges: rank ``r`` holds rows
``[r*per, (r+1)*per)`` of the padded table (``per = padded / tp``); rows ``>= V`` are zero
padding. A lookup masks ids outside the local range and sums the ranks' partial results
with :func:`tp_all_reduce`; :meth:`VocabParallelEmbedding.compute_logits` gathers the
per-rank logits along the vocabulary so every rank gets ``[N, V]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import Parameter

from rlserve.batch_invariant import mode as bi_mode, ops as bi_ops
from rlserve.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_gather_last_dim, tp_all_reduce
from rlserve.layers import cpu_gemm
from rlserve.layers.cpu_linear import cpu_linear, packed_linear
from rlserve.layers.linear import UnquantizedLinearMethod
from rlserve.loader.weight_utils import check_float, default_weight_loader, set_weight_attrs

DEFAULT_VOCAB_PADDING = 64


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary sharded over TP ranks.

    Args:
        num_embeddings: vocabulary size ``V`` (of the checkpoint).
        embedding_dim: embedding width ``D``.
        params_dtype: parameter dtype (default: ``torch.get_default_dtype()``).
        padding_size: pad the vocabulary to a multiple of this before splitting.

    Attributes:
        weight: ``[per, D]`` this rank's rows (``weight.full_shape == (V, D)``).
        vocab_start, vocab_end: the real (unpadded) vocabulary range ``[start, end)`` held here.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype: torch.dtype | None = None,
                 padding_size: int = DEFAULT_VOCAB_PADDING, prefix: str = ""):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.prefix = prefix
        padded = _round_up(_round_up(num_embeddings, padding_size), self.tp_size)
        self.num_embeddings_padded = padded
        self.num_embeddings_per_partition = padded // self.tp_size
        self.vocab_start = min(self.tp_rank * self.num_embeddings_per_partition, num_embeddings)
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = Parameter(torch.zeros(self.num_embeddings_per_partition, embedding_dim, dtype=dtype),
                                requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader, "output_dim": 0,
                                       "full_shape": (num_embeddings, embedding_dim)})

    def checkpoint_shapes(self, param_name: str) -> dict:
        """``{None: full shape}`` of the HF tensor feeding ``param_name``."""
        param = getattr(self, param_name)
        return {None: tuple(getattr(param, "full_shape", param.shape))}

    def weight_loader(self, param: Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        """Copy rows ``[vocab_start, vocab_end)`` of the full ``[V, D]`` tensor in place and zero
        the padding rows. A 1-D parameter (an LM-head bias ``[per]``) is sliced the same way.

        Raises:
            ValueError: shape mismatch, non-float tensor or a shard id (nothing copied).
        """
        if shard_id is not None:
            raise ValueError(f"{self.prefix}: vocabulary embedding takes no shard id, got {shard_id!r}")
        check_float(loaded_weight, self.prefix or "embedding")
        full = tuple(getattr(param, "full_shape", (self.num_embeddings, *param.shape[1:])))
        if tuple(loaded_weight.shape) != full:
            raise ValueError(f"{self.prefix or 'embedding'}: expected full shape {full}, "
                             f"got {tuple(loaded_weight.shape)}")
        n = self.vocab_end - self.vocab_start
        param.data[:n].copy_(loaded_weight[self.vocab_start:self.vocab_end])
        param.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [...] int64`` (in ``[0, V)``) -> ``[..., D]`` in the parameter dtype."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(mask, input_ids - self.vocab_start, torch.zeros_like(input_ids))
        out = F.embedding(local, self.weight)
        out = out * mask.unsqueeze(-1).to(out.dtype)
        return tp_all_reduce(out)

    def serve_as_lm_head(self) -> None:
        """Mark this table as the model's output projection (models call it on their LM head,
        tied or not). On CPU in float32 :meth:`compute_logits` then runs on a oneDNN pre-packed
        copy of the weight (:func:`rlserve.layers.cpu_linear.pack_weight`), which
        ``process_weights_after_loading`` (after the initial load and every weight sync)
        rebuilds through this ``quant_method``, as for the decoder's linears; a second copy of
        the table in memory (113 MB for SmolLM2-135M); ``RLSERVE_CPU_PACKED_LINEAR=0`` turns
        it off. SmolLM2's ``[N, 576] x [576, 49152]`` head, one thread, CPU time, medians of
        interleaved calls on the 2-core Zen 5 machine (2026-12-02, load 2-3): N=1 plain 5.23 ->
        packed 4.61 ms (a plain read of the 113 MB: 4.03), N=16 11.06 -> 8.50, N=64 23.42 ->
        20.01; the whole decode step (paired medians, in-process alternation, three runs,
        ``BENCHMARKS.md``) -1.4 to -1.7 ms at batch 1 (~27 ms), -2.8 to -4.1 at 16, -2.3 to -3.3
        at 64. Logits equal to the plain weight's up to summation order (bit-equal at 16 and 64
        rows, max |diff| 2.3e-5 at 1 row, same argmax)."""
        self.quant_method = UnquantizedLinearMethod()

    def compute_logits(self, hidden: torch.Tensor, bias: torch.Tensor | None = None,
                       float32: bool = True) -> torch.Tensor:
        """Use this table as the output projection (tied or untied LM head).

        Args:
            hidden: ``[N, D]``.
            bias: optional ``[per]`` local bias.
            float32: return float32 (a copy of the ``[N, V]`` logits); False returns the
                projection's own dtype (the model dtype; the same values, not yet widened: the
                engine's samplers widen them as they read them, which saves the copy -- ~59 us
                per step at 256 x 151,936 on an H200).
        Returns:
            ``[N, V]`` logits over the full vocabulary, on every TP rank (last dim contiguous;
            a view past a padded vocabulary when not float32).
        """
        if bi_mode.enabled():  # --batch-invariant (rlserve.batch_invariant)
            logits = bi_ops.linear(hidden, self.weight, UnquantizedLinearMethod.packed_weight(self), bias, layer=self)
        elif hidden.device.type != "cpu":
            logits = F.linear(hidden, self.weight, bias)
        elif cpu_gemm.team_weight(self) is not None and cpu_gemm.takes(hidden):  # decode rows: CPU team
            logits = cpu_gemm.linear(hidden, cpu_gemm.team_weight(self), self.weight.shape[0], bias)
        else:  # the packed copy exists after serve_as_lm_head + a load; else oneDNN on the plain weight
            packed = UnquantizedLinearMethod.packed_weight(self)
            logits = packed_linear(hidden, self.weight, packed, bias, fallback=cpu_linear)
        logits = tp_all_gather_last_dim(logits)
        logits = logits[..., : self.num_embeddings]
        return logits.float() if float32 else logits


class ParallelLMHead(VocabParallelEmbedding):
    """Untied output projection ``hidden [N, D] -> logits [N, V]`` (float32), vocab-sharded.

    Args: as :class:`VocabParallelEmbedding`, plus ``bias`` (an ``[V]`` HF bias, sharded).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False,
                 params_dtype: torch.dtype | None = None, padding_size: int = DEFAULT_VOCAB_PADDING,
                 prefix: str = ""):
        super().__init__(num_embeddings, embedding_dim, params_dtype, padding_size, prefix)
        self.serve_as_lm_head()
        if bias:
            self.bias = Parameter(torch.zeros(self.num_embeddings_per_partition, dtype=self.weight.dtype),
                                  requires_grad=False)
            set_weight_attrs(self.bias, {"weight_loader": self.weight_loader, "output_dim": 0,
                                         "full_shape": (num_embeddings,)})
        else:
            self.register_parameter("bias", None)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is an output projection; call compute_logits(hidden)")

    def compute_logits(self, hidden: torch.Tensor, bias: torch.Tensor | None = None,
                       float32: bool = True) -> torch.Tensor:
        """``hidden [N, D]`` -> ``[N, V]`` float32 (full vocabulary on every rank); ``float32``
        as in :meth:`VocabParallelEmbedding.compute_logits`."""
        return super().compute_logits(hidden, self.bias if bias is None else bias, float32=float32)


__all__ = ["VocabParallelEmbedding", "ParallelLMHead", "default_weight_loader"]
