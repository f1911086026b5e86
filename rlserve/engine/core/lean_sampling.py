"""The general sampler's less work per step (:class:`rlserve.engine.core.sampler.Sampler`, the
path every CPU step takes): no copy of the logits when no row needs one, a one-pass argmax, and
scores only for the rows that asked for them.

* **Greedy batches with nothing to process.** When every row is greedy (temperature 0) and no row
  has a logits processor to apply (:func:`processes`: ``logit_bias``, ``allowed_token_ids``,
  ``bad_words``, an active ``min_tokens``, penalties), the token is the argmax of the model's
  logits read in place, no copy (before: a copy, then ``torch.argmax`` of the copy).
* **One-pass argmax.** On float32 CPU rows every argmax of the sampler (greedy and drawn rows) is
  :func:`argmax`: the C kernel of :mod:`rlserve.layers.cpu_argmax`, with ``torch.argmax``'s result
  (the first index on ties, a row's first NaN where it has one, 0 for a row of ``-inf``).
* **Scores of the rows that asked.** A row's sampled-token logprob and top logprobs
  (:func:`scores`, in the sampler's ``logprobs_mode``) are computed only when its request set
  ``SamplingParams.logprobs`` (0: the sampled token's only), on the sub-batch of those rows.
  Before, ``log_softmax`` ran over the whole batch every step (``raw_logprobs`` mode): with the
  copy and the argmax, ~5 passes over the logits for a greedy row. The other rows get NaN as their
  sampled logprob and zeros as top logprobs; nothing reads them: a sample that did not ask for
  logprobs has ``cumulative_logprob`` None (vLLM's rule, ``vllm/v1/engine/logprobs.py``).
  ``log_softmax`` and ``topk`` work row by row on the CPU and on CUDA, so a sub-batch row's scores
  are bit-equal to the same row's in the whole batch (``tests/test_lean_sampling.py`` checks it
  against the full-batch path).

Measured (BENCHMARKS.md, "Issue 37 (s22)", ``benchmarks/cpu_sampler_step.py``): SmolLM2-135M's
batch-16 greedy decode step on the 2-core Xeon, sampler included.

:func:`set_lean` (A/B benchmarks, tests) turns all three off: the copy, ``torch.argmax`` and the
whole-batch scores, as before session 22.
"""

from __future__ import annotations

import torch

from rlserve.h2d import to_device
from rlserve.layers import cpu_argmax

_LEAN = [True]


def set_lean(on: bool) -> bool:
    """Switch the lean paths on or off (off: copy the logits, ``torch.argmax``, score every row,
    as before session 22); returns the previous setting."""
    prev = _LEAN[0]
    _LEAN[0] = bool(on)
    return prev


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of ``[B, V]`` ``x`` (LongTensor ``[B]``, the same indices: first on ties,
    a row's first NaN): with the lean paths on, float32 CPU rows go through the C kernel of
    :mod:`rlserve.layers.cpu_argmax` (one read of each row for its maximum; torch's CPU argmax
    costs ~6x as much at ``[16, 49152]``)."""
    return cpu_argmax.argmax_rows(x) if _LEAN[0] else x.argmax(dim=-1)


def processes(p, output_token_ids: list[int]) -> bool:
    """Whether the sampler's steps 1-3 (``allowed_token_ids``, ``bad_words``, ``min_tokens``
    while the output is shorter, ``logit_bias``, repetition / frequency / presence penalties) may
    change the row's logits. ``p``: the row's ``SamplingParams``; ``output_token_ids``: its
    tokens so far. Conservative: True where a processor is set even if it changes nothing."""
    return bool(p.logit_bias or p.allowed_token_ids or p.bad_words_token_ids
                or (p.min_tokens and len(output_token_ids) < p.min_tokens)
                or p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0)


def greedy_in_place(meta) -> bool:
    """Whether a batch's processed logits are the model's own, read without a copy: lean on,
    every row greedy, and no row :func:`processes`. ``meta``: the step's ``SamplingMetadata``
    (its structured-output masks are applied before, on the sampler's own copy)."""
    return _LEAN[0] and all(p.greedy and not processes(p, out)
                            for p, out in zip(meta.params, meta.output_token_ids))


def scores(mode: str, raw: torch.Tensor, processed: torch.Tensor, token_ids: torch.Tensor,
           params: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sampled tokens' scores and the top-``K`` scores of the rows that asked for logprobs.

    Args:
        mode: the sampler's ``logprobs_mode`` (``raw_logprobs``, ``raw_logits``,
            ``processed_logprobs``, ``processed_logits``: see :mod:`rlserve.engine.core.sampler`).
        raw: ``[B, V]`` float32 logits as the model gave them (structured-output masks applied).
        processed: ``[B, V]`` float32 logits after the sampler's steps 1-7.
        token_ids: ``LongTensor [B]`` sampled tokens.
        params: per row its ``SamplingParams``; a row asked when ``logprobs`` is not None
            (every row when :func:`set_lean` is off).

    Returns:
        ``(logprobs [B] float32, topk_ids [B, K] int64, topk_scores [B, K] float32)`` on the
        logits' device, ``K = min(max(params[i].logprobs or 0), V)``, top-K descending. Rows
        that did not ask: NaN and zeros. No host sync.
    """
    B, V = raw.shape
    dev = raw.device
    rows = list(range(B)) if not _LEAN[0] else [i for i, p in enumerate(params) if p.logprobs is not None]
    K = min(max((params[i].logprobs or 0 for i in rows), default=0), V)
    src = raw if mode.startswith("raw_") else processed
    if len(rows) < B:
        lp_all = torch.full((B,), float("nan"), dtype=torch.float32, device=dev)
        ids_all = torch.zeros(B, K, dtype=torch.long, device=dev)
        top_all = torch.zeros(B, K, dtype=torch.float32, device=dev)
        if not rows:
            return lp_all, ids_all, top_all
        idx = to_device(rows, torch.long, dev)
        src, token_ids = src.index_select(0, idx), token_ids.index_select(0, idx)
    s = torch.log_softmax(src, dim=-1) if mode.endswith("_logprobs") else src
    lp = s.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    if K > 0:
        top, ids = s.topk(K, dim=-1, sorted=True)
    else:
        top, ids = s.new_empty(len(rows), 0), torch.empty(len(rows), 0, dtype=torch.long, device=dev)
    if len(rows) == B:
        return lp, ids, top
    lp_all[idx], ids_all[idx], top_all[idx] = lp, ids, top
    return lp_all, ids_all, top_all
