"""The batch-invariant mode's sampling: each row takes the sampler path its own parameters
allow, whatever its neighbours ask for.

The one-pass fused sampler (:mod:`rlserve.engine.core.fused_sampling`, CUDA) and the general
one draw and score a row differently (Philox Gumbel noise and its own log-sum-exp against a
torch generator and ``log_softmax``), and without the mode a batch takes the fused one only
when every row allows it: a row's token and logprob then depended on its neighbours. In the
mode (:mod:`rlserve.batch_invariant`) a mixed batch is split: the rows the fused sampler takes
go through it, the others through the general sampler, and the results are put back in batch
order. Both paths compute each row from that row alone.
"""

from __future__ import annotations

import dataclasses

import torch

from rlserve.engine.core import fused_sampling


def split_sample(sampler, logits: torch.Tensor, meta, rows: list[bool]):
    """One token per row of ``logits [B, >= V]``: rows with ``rows[i]`` True through
    :func:`rlserve.engine.core.fused_sampling.sample`, the others through ``sampler`` itself
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
    tok_f, lp_f = fused_sampling.sample(logits.index_select(0, f_idx), [meta.params[i] for i in fused],
                                        [meta.output_token_ids[i] for i in fused], sampler.vocab_size,
                                        sampler._fused_rng)
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
