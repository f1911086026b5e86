"""The batch-invariant mode's sampling: each row takes the sampler path its own parameters
allow, whatever its neighbours ask for.

The one-pass fused sampler (:mod:`rlserve.engine.core.fused_sampling`, CUDA) and the general
one draw and score a row differently (Philox Gumbel noise and its own log-sum-exp against a
torch generator and ``log_softmax``), and without the mode a batch takes the fused one only
when every row allows it: a row's token and logprob then depended on its neighbours. In the
mode (:mod:`rlserve.batch_invariant`) a mixed batch is split: the rows the fused sampler takes
go through it, the others through the general sampler, and the results are put back in batch
order. Both paths compute each row from that row alone.

The fused sampler's logprob comes from its own chunked log-sum-exp, which is not bitwise the
general sampler's ``log_softmax`` (nor the trainer-side reference's,
:func:`rlserve.batch_invariant.reference_logprobs`): in the mode a fused row's logprob is read
from ``log_softmax`` of its float32 logits as the general sampler's (:func:`raw_logprob_of`;
one more pass over the ``[B, V]`` logits per step), so every row's logprob is the reference's
whichever path drew its token.
"""

from __future__ import annotations

import dataclasses

import torch

from rlserve.engine.core import fused_sampling


def raw_logprob_of(raw: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``log_softmax(raw)[i, token_ids[i]]``: ``raw [B, V]`` float32 logits (the sampler's
    trimmed view), ``token_ids [B]`` integer -> ``[B]`` float32; the general sampler's and the
    reference's ``raw_logprobs`` computation, row by row."""
    return torch.log_softmax(raw, dim=-1).gather(1, token_ids.view(-1, 1).long()).squeeze(1)


def split_sample(sampler, logits: torch.Tensor, meta, rows: list[bool]):
    """One token per row of ``logits [B, >= V]``: rows with ``rows[i]`` True through
    :func:`rlserve.engine.core.fused_sampling.sample` (their logprobs through
    :func:`raw_logprob_of`), the others through ``sampler`` itself
    (a :class:`rlserve.engine.core.sampler.Sampler`, on the sub-batch of its rows and the
    matching slice of ``meta``, a ``SamplingMetadata``).

    Returns ``(token_ids [B] int64, logprobs [B] float32, topk_token_ids [B, K] int64,
    topk_logprobs [B, K] float32)`` on the logits' device, ``K`` the general rows' top-k width
    (the fused rows asked for none: zeros there)."""
    dev = logits.device
    fused = [i for i, ok in enumerate(rows) if ok]
    other = [i for i, ok in enumerate(rows) if not ok]
    f_idx = torch.tensor(fused, dtype=torch.long).to(dev)
    o_idx = torch.tensor(other, dtype=torch.long).to(dev)
    logits_f = logits.index_select(0, f_idx)
    tok_f, _ = fused_sampling.sample(logits_f, [meta.params[i] for i in fused],
                                     [meta.output_token_ids[i] for i in fused], sampler.vocab_size,
                                     sampler._fused_rng)
    lp_f = raw_logprob_of(sampler._trim(logits_f), tok_f)
    B = len(rows)
    sub = dataclasses.replace(meta, **{
        f.name: [getattr(meta, f.name)[i] for i in other]
        for f in dataclasses.fields(meta) if isinstance(getattr(meta, f.name), list) and len(getattr(meta, f.name)) == B})
    out = sampler(logits.index_select(0, o_idx), sub)
    token_ids = torch.empty(B, dtype=torch.long, device=dev)
    logprobs = torch.empty(B, dtype=torch.float32, device=dev)
    token_ids[f_idx], token_ids[o_idx] = tok_f.long(), out.token_ids
    logprobs[f_idx], logprobs[o_idx] = lp_f.float(), out.logprobs.float()
    K = out.topk_token_ids.shape[1]
    topk_ids = torch.zeros(B, K, dtype=torch.long, device=dev)
    topk_lp = torch.zeros(B, K, dtype=out.topk_logprobs.dtype, device=dev)
    if K:
        topk_ids[o_idx], topk_lp[o_idx] = out.topk_token_ids, out.topk_logprobs
    return token_ids, logprobs, topk_ids, topk_lp
