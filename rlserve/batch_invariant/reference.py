"""The trainer-side reference: rlserve's model and kernels in the trainer's own process, in
the batch-invariant mode, so its logprobs of a rollout are bitwise those the server returned.

The server, in this mode, gives every token the same bits whatever step computed it (a
decode step, a prompt prefill, a prefix-cache hit, a recompute after preemption, and whatever
else shared the step: :mod:`rlserve.batch_invariant`). This module runs the same model code
(:class:`rlserve.engine.worker.model_runner.ModelRunner`, the same layers, one prefill step
over the whole sequence) with the same weights and reads ``log_softmax`` of the float32 logits
at every position, as the sampler does for ``raw_logprobs`` (its default ``logprobs_mode``).
So a rollout's train/rollout logprob mismatch is zero by construction; :func:`mismatch`
measures it (KL estimate and largest difference over the sampled tokens).

Same weights means the same values in the same dtype: a checkpoint directory, or a Hugging Face
model whose ``state_dict`` holds the weights the server serves (after a weight sync, those
synced). Same mode means the server ran ``--batch-invariant`` (or ``VLLM_BATCH_INVARIANT=1``)
on the same kind of device with the same dtype; ``logprobs_mode`` ``raw_logprobs``.
"""

from __future__ import annotations

import os
from typing import Iterable, Sequence

import torch
from torch import nn

from rlserve.batch_invariant import mode as bi_mode
from rlserve.config import EngineConfig, resolve_device, resolve_dtype
from rlserve.engine.worker.model_runner import ModelRunner, StepInput
from rlserve.loader.checkpoint import iterate_checkpoint
from rlserve.loader.model_loader import build_model, process_weights_after_loading

#: tokens per forward step at most (longer batches run in several steps; one sequence longer
#: than this runs alone)
MAX_STEP_TOKENS = 8192


class BatchInvariantReference:
    """rlserve's model for ``model`` in this process, ready for :meth:`logprobs`.

    Args:
        model: a Hugging Face model directory (``config.json`` + weights), or a Hugging Face
            ``PreTrainedModel`` (its ``config`` and ``state_dict()`` are read; the tensors are
            copied, later training steps do not reach this copy: call :meth:`load_weights`).
        device: ``"cpu"``, ``"cuda"``... (default: the HF model's device, else the server's
            ``"auto"``: CUDA when present).
        dtype: as the server's ``--dtype`` (default ``"auto"``: float32 on CPU, the checkpoint's
            dtype on GPU with float32 served as bfloat16).
        block_size: KV block size; keep the server's (``--block-size``, 16 by default): the
            attention kernel reads the context block by block.

    Raises:
        ValueError: weights missing from ``model``; a CPU dtype other than float32.
    """

    def __init__(self, model, device: str | torch.device | None = None, dtype: str | torch.dtype = "auto",
                 block_size: int = 16):
        from transformers import AutoConfig

        if isinstance(model, (str, os.PathLike)):
            hf_config, path = AutoConfig.from_pretrained(str(model)), str(model)
            weights = iterate_checkpoint(path, "auto")
        elif isinstance(model, nn.Module) and hasattr(model, "config"):
            hf_config, path = model.config, getattr(model.config, "_name_or_path", "") or "hf-model"
            weights = model.state_dict().items()
            if device is None:
                device = next(model.parameters()).device
        else:
            raise TypeError(f"model must be a model directory or a Hugging Face model, got {type(model).__name__}")
        self.device = torch.device(device) if device is not None else resolve_device("auto")
        self.dtype = resolve_dtype(dtype, self.device, hf_config)
        self.block_size = block_size
        self.model = build_model(hf_config, self.device, self.dtype)
        self.load_weights(weights)
        config = EngineConfig(model=path, device=str(self.device), batch_invariant=True, enforce_eager=True,
                              block_size=block_size, extra={"cpu_microbatches": 1})
        self.runner = ModelRunner(self.model, self.device, self.dtype, block_size, config=config)
        self.vocab_size = int(hf_config.vocab_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load ``(HF name, full tensor)`` pairs in place (a trainer's new weights), then rebuild
        what derives from them. Raises ValueError when a first load misses required names."""
        loaded = self.model.load_weights(weights)
        normalize = getattr(self.model, "normalize_checkpoint_name", lambda n: n)
        missing = sorted(self.model.required_checkpoint_names() - {normalize(n) for n in loaded})
        if missing and not getattr(self, "_loaded", False):
            raise ValueError(f"the model's weights miss {len(missing)} required tensor(s): {', '.join(missing[:8])}")
        self._loaded = True
        process_weights_after_loading(self.model)

    def _ensure_blocks(self, n: int) -> None:
        if self.runner.num_blocks < n:
            self.runner.allocate_kv_cache(max(n, 2 * self.runner.num_blocks))

    @torch.inference_mode()
    def logprobs(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Per sequence of ``n`` token ids, ``[n - 1]`` float32 (on CPU): entry ``i`` is the
        logprob of token ``i + 1`` after tokens ``0..i`` (``log_softmax`` of the float32 logits,
        the server's ``raw_logprobs``). Empty for a sequence of fewer than 2 tokens.

        Raises:
            ValueError: a token id outside ``[0, vocab_size)``.
        """
        out: list[torch.Tensor | None] = [None] * len(sequences)
        todo = []
        for i, seq in enumerate(sequences):
            ids = [int(t) for t in seq]
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"token ids out of the vocabulary [0, {self.vocab_size}): {bad[:5]}")
            if len(ids) < 2:
                out[i] = torch.empty(0, dtype=torch.float32)
            else:
                todo.append((i, ids))
        while todo:
            step = [todo.pop(0)]
            tokens = len(step[0][1])
            while todo and tokens + len(todo[0][1]) <= MAX_STEP_TOKENS:
                tokens += len(todo[0][1])
                step.append(todo.pop(0))
            for (i, ids), lp in zip(step, self._step([ids for _, ids in step])):
                out[i] = lp
        return out

    def _step(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        bs = self.block_size
        nblocks = [-(-len(s) // bs) for s in seqs]
        self._ensure_blocks(sum(nblocks))
        tables, start = [], 0
        for nb in nblocks:
            tables.append(list(range(start, start + nb)))
            start += nb
        ids = [t for s in seqs for t in s]
        step = StepInput(input_ids=ids, positions=[p for s in seqs for p in range(len(s))],
                         query_lens=[len(s) for s in seqs], seq_lens=[len(s) for s in seqs], block_tables=tables,
                         logits_indices=list(range(len(ids))), is_prefill=True)
        logits = self.runner.execute(step)
        lps = torch.log_softmax(logits.float()[:, : self.vocab_size], dim=-1)
        out, row = [], 0
        for s in seqs:
            n = len(s)
            tgt = torch.tensor(s[1:], dtype=torch.long, device=lps.device)
            out.append(lps[row: row + n - 1].gather(1, tgt[:, None])[:, 0].cpu())
            row += n
        return out


def reference_logprobs(model, token_ids, device=None, dtype: str | torch.dtype = "auto"):
    """Logprobs of ``token_ids`` under ``model`` with rlserve's batch-invariant kernels, in this
    process: bitwise the server's (``--batch-invariant``) for the same tokens and weights.

    Args:
        model: a model directory, a Hugging Face model, or a :class:`BatchInvariantReference`
            (built once and reused: building loads the weights).
        token_ids: one sequence (``list[int]``: prompt + completion) or a list of them.
        device / dtype: as :class:`BatchInvariantReference` (ignored for one).

    Returns:
        For one sequence of ``n`` tokens a ``[n - 1]`` float32 tensor (entry ``i``: the logprob
        of token ``i + 1``); for a list, a list of those. The completion's logprobs are the
        last ``len(completion)`` entries.
    """
    ref = model if isinstance(model, BatchInvariantReference) else BatchInvariantReference(model, device, dtype)
    with bi_mode.active(True):
        if token_ids and isinstance(token_ids[0], int):
            return ref.logprobs([token_ids])[0]
        return ref.logprobs(token_ids)


def mismatch(server_logprobs: Sequence[Sequence[float]], reference: Sequence[torch.Tensor]) -> dict:
    """The train/rollout mismatch over a rollout batch: per sample the server's logprobs of its
    sampled tokens and the reference's of the same tokens (equal lengths).

    Returns ``{"kl": mean over tokens of (server - reference), the sampled-token estimate of
    KL(server || reference) in nats; "max_abs_diff": largest |difference|; "tokens": count;
    "bitwise_equal": every pair has the same float32 bits}``.

    Raises:
        ValueError: the lengths differ.
    """
    if len(server_logprobs) != len(reference):
        raise ValueError(f"{len(server_logprobs)} server samples but {len(reference)} reference samples")
    s_all, r_all = [], []
    for s, r in zip(server_logprobs, reference):
        s = torch.as_tensor(list(s), dtype=torch.float32)
        r = torch.as_tensor(r, dtype=torch.float32).reshape(-1)
        if s.shape != r.shape:
            raise ValueError(f"a sample has {s.numel()} server logprobs but {r.numel()} reference logprobs")
        s_all.append(s)
        r_all.append(r)
    s, r = (torch.cat(s_all), torch.cat(r_all)) if s_all else (torch.empty(0), torch.empty(0))
    d = (s.double() - r.double())
    return {"kl": float(d.mean()) if d.numel() else 0.0, "max_abs_diff": float(d.abs().max()) if d.numel() else 0.0,
            "tokens": int(d.numel()), "bitwise_equal": bool(torch.equal(s, r))}
