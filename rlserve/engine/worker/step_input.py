"""What one forward step needs, as plain Python lists (:class:`StepInput`): the engine core builds it from
the scheduled batch (:mod:`rlserve.engine.core.engine_step`), a tensor-parallel executor pickles it to every
worker, and :class:`~rlserve.engine.worker.model_runner.ModelRunner` turns it into model inputs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepInput:
    """One forward step, as plain lists (picklable).

    Attributes:
        input_ids / positions: ``T`` flat token ids and their positions.
        query_lens / seq_lens / block_tables: per sequence (see ``AttentionMetadata.build``).
        logits_indices: rows of the flat batch whose logits are wanted (the last token of
            each sequence, plus every prompt row of sequences asking prompt logprobs).
        is_prefill: a prefill step (decode steps may use CUDA graphs).
        input_ids_from: optional ``(tokens, rows)``: take the input ids from ``tokens[rows]``,
            a device tensor of an earlier step's sampled tokens (the engine's overlapped
            decode: the ids are not on the host yet); ``input_ids`` then holds placeholders.
            ``(tokens, rows, where)`` (a mixed prefill + decode step, or a decode step whose other
            rows' ids are on the host): only the flat rows ``where`` take ``tokens[rows]``, the
            others keep ``input_ids``.
            Only for in-process workers (a device tensor is not picklable across processes).
        lora_ids: per sequence its LoRA adapter id (0: base model), or None when every sequence
            runs on the base model (:mod:`rlserve.lora`). A step with adapters runs without CPU
            micro-batches; on the kernel path (CUDA) its decode steps replay CUDA graphs of their
            own (``lora_graphs``), on the dense CPU path it runs eagerly.
    """

    input_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    logits_indices: list[int]
    is_prefill: bool
    input_ids_from: tuple | None = None
    lora_ids: list[int] | None = None
