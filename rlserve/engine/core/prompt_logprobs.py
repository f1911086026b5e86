"""Prompt logprobs and ranked logprob dicts in vLLM's format: per position ``{token id: score}`` of the
token the row predicts and the top-k, and that token's rank. The scores are ``log_softmax`` of the model's
logits, or the logits themselves in the ``*_logits`` modes of ``logprobs_mode``: prompt tokens skip the
sampling steps (vLLM's rule), so raw and processed are the same (the sampled tokens' logprobs:
:mod:`rlserve.engine.core.sampler`). All float32.

Memory: a step's prompt rows can be a whole long prompt (on CUDA with chunked prefill off a step takes
``max(8192, max_model_len)`` tokens), so the float32 scores are made :data:`ROWS_BYTES` of rows at a time
(:func:`block_rows`), never ``[rows, vocab]`` at once: a 40,960-token prompt of a 151,936-token vocabulary
needed ~62 GB of float32 scores, log-softmax and comparison temporaries beside its logits (session 21's
adversarial pass: a GPU out of memory fails every request of its step)."""

from __future__ import annotations

import torch

#: bytes of float32 scores made at once (a block of rows x the vocabulary): 441 rows of Qwen3's 151,936 tokens
ROWS_BYTES = 256 << 20


def block_rows(vocab: int) -> int:
    """Rows of a ``vocab``-wide float32 block within :data:`ROWS_BYTES` (at least 1)."""
    return max(1, ROWS_BYTES // (4 * max(1, int(vocab))))


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
        ``1..k``. Scored :func:`block_rows` rows at a time; one host transfer per column.
    """
    N = len(target_ids)
    if N == 0:
        return [], []
    if logits.shape[0] != N:
        raise ValueError(f"logits have {logits.shape[0]} rows, expected {N}")
    tgt = torch.tensor(target_ids, dtype=torch.long, device=logits.device)
    k = min(int(num_top or 0), logits.shape[1])
    step = block_rows(logits.shape[1])
    parts: list[tuple] = []  # per block of rows: (target score, rank, top scores, top ids), on the device
    for a in range(0, N, step):
        lp = _scores(logits[a : a + step], mode)
        tgt_col = lp.gather(1, tgt[a : a + step].unsqueeze(1))
        part = (tgt_col.squeeze(1), (lp >= tgt_col).sum(dim=-1))
        parts.append(part + (lp.topk(k, dim=-1) if k > 0 else ()))
        del lp, tgt_col
    cols = [torch.cat(c) if len(parts) > 1 else c[0] for c in zip(*parts)]
    tgt_lp, ranks = cols[0].tolist(), cols[1].tolist()
    if k > 0:
        top_lp, top_ids = cols[2].tolist(), cols[3].tolist()
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
