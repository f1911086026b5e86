"""Token sampling: logits processing, seeded/unseeded draws, logprobs (prompt logprobs:
:mod:`rlserve.engine.core.prompt_logprobs`).

The processing pipeline follows vLLM (``vllm/model_executor/layers/sampler.py`` of v0 and
``vllm/v1/sample/sampler.py``), applied row-wise to a ``[B, V]`` float32 logits tensor:

1. **allowed_token_ids** — rows with the list get ``-inf`` everywhere else (vLLM's
   ``allowed_token_ids_mask``, applied first); **bad_words** — a banned sequence's last id
   gets ``-inf`` when the output ends with the rest of it (vLLM's ``apply_bad_words``); **min_tokens** — while ``len(output) < min_tokens`` the EOS ids (unless ``ignore_eos``)
   and ``stop_token_ids`` get ``-inf`` (vLLM's ``MinTokensLogitsProcessor``); **logit_bias**
   — ``l[t] += bias[t]`` (OpenAI's field; vLLM's ``LogitBiasLogitsProcessor``, applied with
   min_tokens before the penalties, so greedy rows see it too).
2. **repetition penalty** — CTRL rule (Keskar et al. 2019, as in HF
   ``RepetitionPenaltyLogitsProcessor`` and vLLM ``apply_penalties``): for every token that
   appears in prompt *or* output, ``l = l / p if l > 0 else l * p``.
3. **frequency / presence penalties** — OpenAI's definition over *output* tokens only:
   ``l -= frequency_penalty * count(token) + presence_penalty * (count(token) > 0)``.
4. **temperature** — ``l /= T`` (greedy rows, ``T < 1e-5``, take the argmax of the
   logits after step 3 instead).
5. **top-k** — keep the k largest (``k = 0`` or ``k >= V`` disables); exactly k survive
   when combined with top-p (sort path), ties with the k-th value survive when alone
   (``torch.topk`` path).
6. **top-p** — nucleus over the top-k-truncated distribution: a token survives if the
   probability mass of the tokens strictly more likely than it is ``< top_p``; the most
   likely token always survives (vLLM ``apply_top_k_top_p``).
7. **min-p** — drop tokens with ``prob < min_p * max_prob`` (computed after 4-6, as vLLM v0).
8. **draw** — exponential race (equivalent to Gumbel-max / multinomial):
   ``token = argmax(probs / q)``, ``q ~ Exp(1)`` i.i.d. per vocabulary entry. Rows with a
   ``seed`` draw ``q`` from their own ``torch.Generator`` seeded with
   :func:`~rlserve.engine.sampling_params.derive_seed` ``(seed, len(output_token_ids))``, so
   the token depends only on the row's own logits, seed and position — not on the batch, the
   row's place in it, or on whether the sequence was preempted and recomputed. Unseeded rows
   share the sampler's generator.

0. **structured outputs** (before everything, as vLLM applies its grammar bitmask to the
   logits it hands the sampler) -- rows with a constraint get ``-inf`` at every token it
   does not allow next (:func:`rlserve.engine.core.structured.apply_grammar_masks`).

What ``logprobs`` (the sampled token's and the top-k) hold is the server's ``logprobs_mode``
(vLLM's ``--logprobs-mode``, same names and meaning as ``vllm/v1/sample/sampler.py``):

* ``raw_logprobs`` (default): ``log_softmax`` of the logits the model produced (after step 0).
* ``raw_logits``: those logits themselves.
* ``processed_logprobs``: ``log_softmax`` of the logits after steps 1-7 -- penalties,
  temperature, top-k, top-p, min-p (removed tokens are ``-inf``): the distribution the token
  was actually drawn from, which is what an importance ratio (GRPO's) needs. Greedy rows:
  after the penalties only (temperature 1), as vLLM.
* ``processed_logits``: the logits after steps 1-7.

Only the rows whose request set ``logprobs`` (0 included) are scored, on their own sub-batch;
a batch of greedy rows with nothing to process is read without a copy
(:mod:`rlserve.engine.core.lean_sampling`).

All float32. Prompt logprobs skip the sampling steps (vLLM's rule): ``log_softmax`` of the
model's logits, or the logits themselves in the two ``*_logits`` modes.

On CUDA, batches whose rows need only temperature (or greedy), with no structured output,
no top logprobs and ``raw_logprobs`` mode go through :mod:`rlserve.engine.core.fused_sampling`
instead: the same distribution in one pass over the logits (Gumbel-max with Philox noise
rather than the exponential race's torch generator).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from rlserve.batch_invariant import mode as bi_mode
from rlserve.engine.core import fused_sampling, lean_sampling
from rlserve.engine.core.sample_split import raw_logprob_of, split_sample
from rlserve.h2d import to_device
from rlserve.config import LOGPROBS_MODES
from rlserve.engine.sampling_params import SamplingParams, derive_seed
from rlserve.engine.core.prompt_logprobs import (  # noqa: F401 - importable here, as before
    compute_prompt_logprobs,
    logprob_dicts,
    ranked_logprob_dicts,
)


@dataclass
class SamplingMetadata:
    """Per-row inputs of one sampling call; one entry per sequence, in batch order.

    Attributes:
        params: the sequence's :class:`SamplingParams`.
        prompt_token_ids: the prompt's token ids (used by the repetition penalty).
        output_token_ids: tokens generated so far, *before* this step (penalties,
            ``min_tokens``, and the seeded-draw index ``len(output_token_ids)``).
        grammars: per row, the structured-output state
            (:class:`~rlserve.engine.core.structured.GrammarState`) or None; None: no row has one.
    """

    params: list[SamplingParams]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    grammars: list | None = None


@dataclass
class SamplerOutput:
    """Result of one sampling call; tensors live on the logits' device.

    Attributes:
        token_ids: ``LongTensor [B]`` sampled token per row.
        logprobs: ``FloatTensor [B]`` float32 score of the sampled token in the sampler's
            ``logprobs_mode`` (default: logprob under the raw model distribution); NaN in the
            rows whose ``params.logprobs`` is None (not computed:
            :mod:`rlserve.engine.core.lean_sampling`; the one-pass CUDA sampler fills them).
        topk_token_ids: ``LongTensor [B, K]``, ``K = max(params.logprobs or 0)`` over the
            batch (0 columns when no row asked). Rows that asked for fewer should use only
            their first ``params.logprobs`` columns; rows that did not ask hold zeros.
        topk_logprobs: ``FloatTensor [B, K]`` scores of those tokens (same mode), descending.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    topk_token_ids: torch.Tensor
    topk_logprobs: torch.Tensor


# --------------------------------------------------------------------------- processors


def _row_token_index(rows: list[list[int]], row_ids: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten ``rows[i]`` for ``i in row_ids`` into (row index, token id) LongTensors."""
    r: list[int] = []
    t: list[int] = []
    for i in row_ids:
        toks = rows[i]
        r.extend([i] * len(toks))
        t.extend(toks)
    return (
        to_device(r, torch.long, device),
        to_device(t, torch.long, device),
    )


def apply_min_tokens(logits: torch.Tensor, meta: SamplingMetadata, eos_token_ids: set[int]) -> torch.Tensor:
    """In place: ``-inf`` for EOS ids (unless ``ignore_eos``) and ``stop_token_ids`` in rows
    whose output is still shorter than ``min_tokens``. ``logits``: ``[B, V]`` float32."""
    V = logits.shape[1]
    rows: list[int] = []
    toks: list[int] = []
    for i, p in enumerate(meta.params):
        if p.min_tokens and len(meta.output_token_ids[i]) < p.min_tokens:
            stop_ids = set(p.stop_token_ids)
            if not p.ignore_eos:
                stop_ids |= eos_token_ids
            for t in stop_ids:
                if 0 <= t < V:
                    rows.append(i)
                    toks.append(t)
    if rows:
        r = to_device(rows, torch.long, logits.device)
        t = to_device(toks, torch.long, logits.device)
        logits[r, t] = float("-inf")
    return logits


def apply_allowed_token_ids(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """In place: ``-inf`` at every token outside ``params[i].allowed_token_ids`` in the rows
    that have the list (``[B, V]`` float32; ids ``>= V`` are skipped: the engine refuses them).
    One host-to-device copy of the (row, id) pairs and of the row flags."""
    B, V = logits.shape
    rows: list[int] = []
    toks: list[int] = []
    flagged = [False] * B
    for i, p in enumerate(meta.params):
        if p.allowed_token_ids:
            flagged[i] = True
            for t in p.allowed_token_ids:
                if 0 <= t < V:
                    rows.append(i)
                    toks.append(t)
    if not any(flagged):
        return logits
    allowed = torch.zeros(B, V, dtype=torch.bool, device=logits.device)
    if rows:
        idx = to_device([rows, toks], torch.long, logits.device)
        allowed[idx[0], idx[1]] = True
    row = to_device(flagged, torch.bool, logits.device).unsqueeze(1)
    logits.masked_fill_(row & ~allowed, float("-inf"))
    return logits


def apply_bad_words(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """In place: ``-inf`` at the last id of each of ``params[i].bad_words_token_ids`` whose
    other ids end the row's output so far (vLLM's ``apply_bad_words``: a one-token word is
    always banned; ``[B, V]`` float32, ids ``>= V`` skipped). One host-to-device copy of the
    (row, id) pairs."""
    V = logits.shape[1]
    rows: list[int] = []
    toks: list[int] = []
    for i, p in enumerate(meta.params):
        past = meta.output_token_ids[i]
        for word in p.bad_words_token_ids or ():
            k = len(word) - 1
            if k <= len(past) and (k == 0 or past[-k:] == word[:-1]) and word[-1] < V:
                rows.append(i)
                toks.append(word[-1])
    if rows:
        idx = to_device([rows, toks], torch.long, logits.device)
        logits[idx[0], idx[1]] = float("-inf")
    return logits


def apply_logit_bias(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """In place: ``logits[i, t] += params[i].logit_bias[t]`` (``[B, V]`` float32; ids
    ``>= V`` are skipped: the engine refuses them before they get here). One host-to-device
    copy of the (row, id, bias) triples; rows without a bias are untouched."""
    V = logits.shape[1]
    rows: list[int] = []
    toks: list[int] = []
    vals: list[float] = []
    for i, p in enumerate(meta.params):
        for t, b in (p.logit_bias or {}).items():
            if 0 <= t < V:
                rows.append(i)
                toks.append(t)
                vals.append(b)
    if rows:
        idx = to_device([rows, toks], torch.long, logits.device)
        logits.index_put_((idx[0], idx[1]), to_device(vals, torch.float32, logits.device), accumulate=True)
    return logits


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """In place: repetition (CTRL), then frequency and presence (OpenAI) penalties.

    ``logits``: ``[B, V]`` float32. Repetition: tokens seen in prompt or output get
    ``l / p`` where ``l > 0`` and ``l * p`` otherwise. Frequency/presence over output tokens:
    ``l -= f * count + pr * (count > 0)``. Rows with default values are untouched.
    """
    B, V = logits.shape
    device = logits.device
    rep_rows = [i for i, p in enumerate(meta.params) if p.repetition_penalty != 1.0]
    fp_rows = [
        i for i, p in enumerate(meta.params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    ]
    if not rep_rows and not fp_rows:
        return logits
    out_rows = sorted(set(rep_rows) | set(fp_rows))
    counts = None
    if out_rows:
        r, t = _row_token_index(meta.output_token_ids, out_rows, device)
        keep = t < V
        r, t = r[keep], t[keep]
        counts = torch.zeros(B, V, dtype=torch.float32, device=device)
        counts.index_put_((r, t), torch.ones_like(t, dtype=torch.float32), accumulate=True)
    if rep_rows:
        seen = counts > 0
        r, t = _row_token_index(meta.prompt_token_ids, rep_rows, device)
        keep = t < V
        seen[r[keep], t[keep]] = True
        pen = to_device([[p.repetition_penalty] for p in meta.params], torch.float32, device)
        pen_full = torch.where(seen, pen, torch.ones((), dtype=torch.float32, device=device))
        logits.copy_(torch.where(logits > 0, logits / pen_full, logits * pen_full))
    if fp_rows:
        freq = to_device([[p.frequency_penalty] for p in meta.params], torch.float32, device)
        pres = to_device([[p.presence_penalty] for p in meta.params], torch.float32, device)
        logits.sub_(freq * counts + pres * (counts > 0).float())
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None
) -> torch.Tensor:
    """Mask logits outside each row's top-k, then outside its nucleus (top-p).

    Args:
        logits: ``[B, V]`` float32 (temperature already applied).
        k: ``LongTensor [B]`` in ``[1, V]`` (``V`` = disabled) or None.
        p: ``FloatTensor [B]`` in ``(0, 1]`` (1 = disabled) or None.
    Returns:
        a new ``[B, V]`` tensor with ``-inf`` at removed entries. Follows vLLM's
        ``apply_top_k_top_p`` (ascending sort; top-p over the top-k-truncated softmax; the
        most likely token is always kept); top-k keeps exactly k entries (ties broken by
        the sort order).
    """
    if k is None and p is None:
        return logits
    V = logits.shape[1]
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        pos = torch.arange(V, device=logits.device).unsqueeze(0)
        logits_sort.masked_fill_(pos < (V - k).unsqueeze(1), float("-inf"))
    if p is not None:
        probs_sum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
        mask = probs_sum <= (1 - p).unsqueeze(1)
        mask[:, -1] = False
        logits_sort.masked_fill_(mask, float("-inf"))
    return torch.empty_like(logits_sort).scatter_(1, logits_idx, logits_sort)


def apply_top_k_only(logits: torch.Tensor, k: torch.Tensor, max_k: int) -> torch.Tensor:
    """In place top-k without a full sort: ``torch.topk(max_k)`` gives each row's k-th
    largest value; entries below it get ``-inf`` (entries tied with it are kept).

    ``logits``: ``[B, V]`` float32; ``k``: ``LongTensor [B]`` in ``[1, V]`` (``V`` =
    unrestricted row); ``max_k``: the largest ``k < V``, known on the host (no device sync).
    """
    V = logits.shape[1]
    top = logits.topk(max_k, dim=-1, sorted=True).values
    thresh = top.gather(1, (k.clamp(max=max_k) - 1).unsqueeze(1))
    thresh = torch.where((k >= V).unsqueeze(1), torch.full_like(thresh, float("-inf")), thresh)
    logits.masked_fill_(logits < thresh, float("-inf"))
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """In place: ``-inf`` where ``softmax(logits) < min_p * max(softmax(logits))``.

    ``logits``: ``[B, V]`` float32; ``min_p``: ``FloatTensor [B]`` (0 = disabled).
    """
    probs = logits.softmax(dim=-1)
    top = probs.amax(dim=-1, keepdim=True)
    logits.masked_fill_(probs < min_p.unsqueeze(1) * top, float("-inf"))
    return logits


# --------------------------------------------------------------------------- sampler


class Sampler:
    """Turns ``[B, V]`` logits into one token per row (see the module docstring).

    Args:
        eos_token_ids: ids that end a sequence (masked by ``min_tokens``).
        vocab_size: number of real token ids; logits columns beyond it (padded
            embeddings) are dropped before anything else.
        generator_seed: seed of the generator shared by unseeded rows.
        logprobs_mode: what logprobs hold, one of :data:`LOGPROBS_MODES` (module docstring).

    Raises:
        ValueError: an unknown ``logprobs_mode``.
    """

    def __init__(self, eos_token_ids: set[int], vocab_size: int, generator_seed: int = 0,
                 logprobs_mode: str = "raw_logprobs"):
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
        self.eos_token_ids = set(int(t) for t in (eos_token_ids or ()))
        self.vocab_size = int(vocab_size)
        self.generator_seed = int(generator_seed)
        self.logprobs_mode = logprobs_mode
        self._generators: dict[str, torch.Generator] = {}
        self._fused_rng = random.Random(self.generator_seed)  # keys of the one-pass path's unseeded rows

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        g = self._generators.get(key)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(self.generator_seed)
            self._generators[key] = g
        return g

    def _trim(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.dtype != torch.float32:
            logits = logits.float()
        if logits.shape[1] > self.vocab_size:
            logits = logits[:, : self.vocab_size]
        return logits

    def process_logits(
        self, logits: torch.Tensor, meta: SamplingMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Apply steps 1-7 of the module docstring.

        Args:
            logits: ``[B, V]`` raw logits (not modified).
        Returns:
            ``(processed, greedy_tokens)``: processed float32 ``[B, V]`` logits (after
            temperature / top-k / top-p / min-p; greedy rows are left at temperature 1), and
            ``LongTensor [B]`` argmax after the penalties (valid for greedy rows) or None
            when no row is greedy. ``processed`` is a copy, except for a batch of greedy rows
            with nothing to apply (:func:`~rlserve.engine.core.lean_sampling.greedy_in_place`):
            then it is ``logits`` (float32, trimmed) itself; do not modify it.
        """
        params = meta.params
        B = len(params)
        if logits.shape[0] != B:
            raise ValueError(f"logits have {logits.shape[0]} rows but metadata has {B}")
        x = self._trim(logits)
        if lean_sampling.greedy_in_place(meta):  # every row greedy, nothing to apply: no copy
            return x, lean_sampling.argmax(x)
        x = x.clone()
        V = x.shape[1]
        device = x.device
        apply_allowed_token_ids(x, meta)
        apply_bad_words(x, meta)
        apply_min_tokens(x, meta, self.eos_token_ids)
        apply_logit_bias(x, meta)
        apply_penalties(x, meta)
        greedy = [p.greedy for p in params]
        greedy_tokens = lean_sampling.argmax(x) if any(greedy) else None
        if all(greedy):
            return x, greedy_tokens
        temps = [1.0 if g else float(p.temperature) for g, p in zip(greedy, params)]
        if any(t != 1.0 for t in temps):
            x.div_(to_device(temps, torch.float32, device).unsqueeze(1))
        ks = [p.top_k if (not g and 0 < p.top_k < V) else V for g, p in zip(greedy, params)]
        ps = [p.top_p if not g else 1.0 for g, p in zip(greedy, params)]
        k_t = to_device(ks, torch.long, device) if any(k < V for k in ks) else None
        p_t = to_device(ps, torch.float32, device) if any(q < 1.0 for q in ps) else None
        if k_t is not None and p_t is None:
            x = apply_top_k_only(x, k_t, max(k for k in ks if k < V))
        else:
            x = apply_top_k_top_p(x, k_t, p_t)
        mps = [p.min_p if not g else 0.0 for g, p in zip(greedy, params)]
        if any(m > 0 for m in mps):
            apply_min_p(x, to_device(mps, torch.float32, device))
        return x, greedy_tokens

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: ``[B, V]`` float logits on any device (not modified; other dtypes than
                float32 -- the engine hands over the model dtype -- are widened as they are read).
            meta: per-row params and token histories.
        Returns:
            :class:`SamplerOutput` on the logits' device (no host sync here).
        """
        params = meta.params
        fused_ok = self.logprobs_mode == "raw_logprobs" and not (meta.grammars and any(g is not None for g in meta.grammars))
        if fused_ok and bi_mode.enabled() and len(params) > 1 and fused_sampling.runs_on(logits):
            rows = fused_sampling.eligible_rows(params, meta.output_token_ids, self.vocab_size)
            if any(rows) and not all(rows):  # --batch-invariant: each row's path by its own params
                return SamplerOutput(*split_sample(self, logits, meta, rows))
        if fused_ok and fused_sampling.eligible(logits, params, meta.output_token_ids, self.vocab_size):
            # temperature / greedy only: one pass over the logits on the GPU
            tok, lp = fused_sampling.sample(logits, params, meta.output_token_ids, self.vocab_size, self._fused_rng)
            if bi_mode.enabled():  # --batch-invariant: the general sampler's (the reference's) logprob
                lp = raw_logprob_of(self._trim(logits), tok)
            return SamplerOutput(tok, lp, torch.empty(len(params), 0, dtype=torch.long, device=tok.device),
                                 lp.new_empty(len(params), 0))
        raw = self._trim(logits)
        B, V = raw.shape
        device = raw.device
        if meta.grammars is not None and any(g is not None for g in meta.grammars):
            from rlserve.engine.core.structured import apply_grammar_masks

            raw = apply_grammar_masks(raw.clone(), meta.grammars)
        processed, greedy_tokens = self.process_logits(raw, meta)
        greedy = [p.greedy for p in params]
        if all(greedy):
            token_ids = greedy_tokens
        else:
            probs = processed.softmax(dim=-1)
            unseeded = [i for i, p in enumerate(params) if p.seed is None]
            if len(unseeded) == B:
                q = torch.empty_like(probs).exponential_(generator=self._generator(device))
            else:
                q = torch.ones_like(probs)  # greedy rows keep 1 (their draw is replaced below)
                if unseeded:
                    idx = to_device(unseeded, torch.long, device)
                    qu = torch.empty(len(unseeded), V, dtype=probs.dtype, device=device)
                    qu.exponential_(generator=self._generator(device))
                    q[idx] = qu
                for i, p in enumerate(params):
                    if p.seed is not None and not greedy[i]:
                        g = torch.Generator(device=device)
                        g.manual_seed(derive_seed(p.seed, len(meta.output_token_ids[i])))
                        q[i].exponential_(generator=g)
            # Exp(1) can round to 0; keep 0/0 out of the argmax.
            q.clamp_min_(torch.finfo(q.dtype).tiny)
            token_ids = lean_sampling.argmax(probs.div_(q))
            if greedy_tokens is not None:
                gmask = to_device(greedy, torch.bool, device)
                token_ids = torch.where(gmask, greedy_tokens, token_ids)

        # the scores of the rows that asked for logprobs only (the others: NaN, zeros)
        sampled_logprobs, topk_ids, topk_logprobs = lean_sampling.scores(
            self.logprobs_mode, raw, processed, token_ids, params)
        return SamplerOutput(
            token_ids=token_ids,
            logprobs=sampled_logprobs,
            topk_token_ids=topk_ids,
            topk_logprobs=topk_logprobs,
        )
