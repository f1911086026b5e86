"""Prompt logprobs and ranked logprob dicts in vLLM's format: per position ``{token id: score}`` of the
token the row predicts and the top-k, and that token's rank. The scores are ``log_softmax`` of the model's
logits, or the logits themselves in the ``*_logits`` modes of ``logprobs_mode``: prompt tokens skip the
sampling steps (vLLM's rule), so raw and processed are the same (the sampled tokens' logprobs:
:mod:`rlserve.engine.core.sampler`). All float32."""

from __future__ import annotations

import torch


def _scores(logits: torch.Tensor, mode: str) -> torch.Tensor:
    """Prompt scores: the logits themselves in the ``*_logits`` modes, else ``log_softmax``
    (prompt tokens skip the sampling steps, so raw and processed are the same: vLLM's rule)."""
    return logits.float() if mode.endswith("_logits") else torch.log_softmax(logits.float(), dim=-1)


def ranked_logprob_dicts(
    logits: torch.Tensor, target_ids: list[int], num_top: int, mode: str = "raw_logprobs"
) -> tuple[list[dict[int, float]], list[int]]:
    """Per-position ``{target token: score, top-k tokens: scores}`` and the target's rank.

    Args:
        logits: ``[N, V]`` logits; row ``i`` predicts ``target_ids[i]``.
        target_ids: ``N`` token ids.
        num_top: number of top alternatives (0 = only the target).
        mode: a ``logprobs_mode`` (:data:`~rlserve.engine.core.sampler.LOGPROBS_MODES`): scores are logprobs or logits.
    Returns:
        ``(dicts, ranks)``: ``N`` dicts, the target first, then the top-k in descending order
        (a target that is also in the top-k appears once); ``ranks[i]`` is the target's
        1-based rank in its row, ``#{tokens scoring >= it}`` (vLLM's
        ``batched_count_greater_than``). The top-k entries' ranks are their positions
        ``1..k``. One host transfer in total.
    """
    N = len(target_ids)
    if N == 0:
        return [], []
    if logits.shape[0] != N:
        raise ValueError(f"logits have {logits.shape[0]} rows, expected {N}")
    lp = _scores(logits, mode)
    tgt = torch.tensor(target_ids, dtype=torch.long, device=lp.device)
    tgt_col = lp.gather(1, tgt.unsqueeze(1))
    ranks = (lp >= tgt_col).sum(dim=-1).tolist()
    tgt_lp = tgt_col.squeeze(1).tolist()
    k = min(int(num_top or 0), lp.shape[1])
    if k > 0:
        top_lp, top_ids = lp.topk(k, dim=-1)
        top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    out: list[dict[int, float]] = []
    for i, t in enumerate(target_ids):
        d = {int(t): tgt_lp[i]}
        if k > 0:
            for tid, v in zip(top_ids[i], top_lp[i]):
                d.setdefault(tid, v)
        out.append(d)
    return out, [int(r) for r in ranks]


def logprob_dicts(
    logits: torch.Tensor, target_ids: list[int], num_top: int
) -> list[dict[int, float]]:
    """:func:`ranked_logprob_dicts` without the ranks (raw logprobs)."""
    return ranked_logprob_dicts(logits, target_ids, num_top)[0]


def compute_prompt_logprobs(
    logits: torch.Tensor, prompt_token_ids: list[int], num_top: int, mode: str = "raw_logprobs",
    with_ranks: bool = False,
):
    """vLLM-format prompt logprobs.

    Args:
        logits: ``[P-1, V]`` float32 logits at prompt positions ``0..P-2`` (row ``i``
            predicts prompt token ``i+1``).
        prompt_token_ids: the ``P`` prompt ids.
        num_top: top alternatives per position (``SamplingParams.prompt_logprobs``).
        mode: the server's ``logprobs_mode`` (logits in the ``*_logits`` modes, else logprobs).
        with_ranks: also return the prompt tokens' ranks.
    Returns:
        ``P`` entries: ``None`` for the first token, then per token a dict holding the
        actual token's score and the ``num_top`` best tokens' scores; with ``with_ranks``,
        ``(entries, ranks)`` where ``ranks`` is ``[None, rank of token 1, ...]``.
    """
    if not prompt_token_ids:
        return ([], []) if with_ranks else []
    dicts, ranks = ranked_logprob_dicts(logits, list(prompt_token_ids[1:]), num_top, mode)
    if with_ranks:
        return [None, *dicts], [None, *ranks]
    return [None, *dicts]
