"""The logprobs of an answer as vLLM 0.32 writes them: token texts (decoded after their context, or
``"token_id:<id>"`` labels), OpenAI's completions and chat ``logprobs`` objects and vLLM's ``prompt_logprobs``,
with JSON-safe floats (:func:`finite`). Mixed into :class:`~rlserve.server.state.ServerState`."""

from __future__ import annotations

import math


def finite(x: float | None, floor: float = -9999.0) -> float | None:
    """JSON-safe float: -inf → ``floor``, NaN → None."""
    if x is None:
        return None
    x = float(x)
    if math.isnan(x):
        return None
    if math.isinf(x):
        return floor if x < 0 else 9999.0
    return x


class LogprobJSON:
    """Token texts and logprob objects; uses the state's ``tokenizer`` and its ``_token_text`` cache
    (``{token id: text}``)."""

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (cached)."""
        s = self._token_text.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id])
            if len(self._token_text) < 1_000_000:
                self._token_text[token_id] = s
        return s

    def token_text_after(self, token_id: int, context) -> str:
        """The text of ``token_id`` in logprobs as vLLM 0.32 gives it
        (``LogprobsProcessor._correct_decoded_token``): its own text, unless that ends in
        U+FFFD (a byte of a multi-byte character); then decoded after the last 1..4 ids of
        ``context`` (the sampled ids before it) until the character completes: the text past
        the context's own complete text, or ``""`` when it never completes."""
        s = self.token_text(token_id)
        if not s.endswith("\ufffd"):
            return s
        ctx = list(context)[-4:]
        for n in range(1, len(ctx) + 1):
            c = ctx[-n:]
            full = self.tokenizer.decode(c + [token_id])
            if full.endswith("\ufffd"):
                continue
            clean = len(c)
            while clean > 0 and self.token_text(c[clean - 1]).endswith("\ufffd"):
                clean -= 1
            prefix = self.tokenizer.decode(c[:clean]) if clean else ""
            if full.startswith(prefix):
                return full[len(prefix):]
            common = 0
            while common < min(len(prefix), len(full)) and prefix[common] == full[common]:
                common += 1
            return full[common:]
        return ""

    def token_label(self, token_id: int, as_ids: bool = False, context=None) -> str:
        """How a token is named in logprobs: its text (vLLM's, after ``context``:
        :meth:`token_text_after`), or ``"token_id:<id>"`` with vLLM's
        ``return_tokens_as_token_ids`` (unambiguous where several ids decode alike)."""
        if as_ids:
            return f"token_id:{token_id}"
        return self.token_text(token_id) if context is None else self.token_text_after(token_id, context)

    @staticmethod
    def _context(ids: list[int], i: int, before=(), n_prompt: int = 0) -> list[int]:
        """The sampled ids before position ``i`` that vLLM decodes a logprob token after: the
        prompt's from its second token for a prompt position (``i < n_prompt``), else
        ``before`` (the output's earlier ids: only its last 4 are read) and the output's ids up to ``i``."""
        if i < n_prompt:
            return ids[max(1, i - 4):i]
        return (list(before) + ids[n_prompt:i])[-4:]

    def completion_logprobs(self, token_ids, logprobs, text_offset0: int = 0, as_ids: bool = False,
                            before=(), n_prompt: int = 0) -> dict:
        """OpenAI completions ``logprobs`` object for ``token_ids``; ``logprobs[i]`` is
        ``{token_id: logprob}`` (sampled + top-k) or None (first prompt token). ``as_ids``:
        tokens and ``top_logprobs`` keys are ``"token_id:<id>"``, and ``text_offset`` counts the
        characters of those labels, as vLLM 0.32's ``_create_completion_logprobs`` does (each
        offset is the previous one plus the previous ``tokens`` entry's length). Token texts
        as vLLM's after their context (:meth:`token_text_after`): ``before``, the output's ids
        before ``token_ids`` (a stream's earlier chunks); ``n_prompt``: the first this many are
        the echoed prompt's."""
        tokens, token_lps, tops, offsets = [], [], [], []
        pos = text_offset0
        token_ids = list(token_ids)
        for i, (tid, d) in enumerate(zip(token_ids, logprobs or [])):
            ctx = self._context(token_ids, i, before, n_prompt)
            label = self.token_label(tid, as_ids, ctx)
            tokens.append(label)
            offsets.append(pos)
            pos += len(label)
            if d is None:
                token_lps.append(None)
                tops.append(None)
                continue
            token_lps.append(finite(d.get(tid)))
            top = {}  # vLLM's order: the sampled token first, then the top-k by descending logprob
            for t, lp in sorted(d.items(), key=lambda kv: (kv[0] != tid, -kv[1])):
                top[self.token_label(t, as_ids, ctx)] = finite(lp)  # a repeated label: first place, last value
            tops.append(top)
        return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens, "top_logprobs": tops}

    def chat_logprobs(self, token_ids, logprobs, top_k: int, as_ids: bool = False, before=()) -> dict:
        """OpenAI chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``;
        ``as_ids``: every ``token`` is ``"token_id:<id>"``; as in vLLM 0.32's
        ``_create_chat_logprobs``, an entry's ``bytes`` stay its token's text (UTF-8) while a
        ``top_logprobs`` item's ``bytes`` are those of its ``token``, the label. ``top_logprobs``
        are vLLM's first ``top_k`` of the sampled token followed by the top-k by descending
        logprob: a sampled token outside the top-k comes first and pushes the k-th out. Token
        texts as vLLM's after their context (:meth:`token_text_after`; ``before``: the output's
        ids before ``token_ids``)."""
        content = []
        token_ids = list(token_ids)
        for i, (tid, d) in enumerate(zip(token_ids, logprobs or [])):
            d = d or {}
            ctx = self._context(token_ids, i, before)
            top = sorted(d.items(), key=lambda kv: (kv[0] != tid, -kv[1]))[:top_k]  # vLLM's order, see above
            content.append({
                "token": self.token_label(tid, as_ids, ctx),
                "logprob": finite(d.get(tid, float("-inf"))),
                "bytes": list(self.token_text_after(tid, ctx).encode("utf-8")),
                "top_logprobs": [
                    {"token": (label := self.token_label(t, as_ids, ctx)), "logprob": finite(lp),
                     "bytes": list(label.encode("utf-8"))}
                    for t, lp in top
                ],
            })
        return {"content": content}

    def prompt_logprobs_json(self, prompt_ids, plps, ranks, as_ids: bool = False):
        """vLLM's ``prompt_logprobs``: per prompt position ``None`` (the first) or
        ``{"<id>": {"logprob", "rank", "decoded_token"}}`` holding the prompt token and the
        top-k, in vLLM 0.32's order (``vllm/logprobs.py``'s ``append_logprobs_for_next_position``):
        the prompt token first, then the top-k by descending logprob. Ranks are 1-based over the
        whole vocabulary: the prompt token's from the engine, the others' their place in the
        top-k. ``decoded_token`` is the token's text even with ``as_ids``
        (``return_tokens_as_token_ids`` relabels only ``logprobs``, as in vLLM); ``-inf`` is
        -9999.0 (vLLM's ``clamp_prompt_logprobs``)."""
        del as_ids  # vLLM keeps the text here (see above)
        if plps is None:
            return None
        out = []
        for pos, d in enumerate(plps):
            if d is None:
                out.append(None)
                continue
            target = prompt_ids[pos] if pos < len(prompt_ids) else None
            entry = {}
            if target in d:
                entry[str(target)] = None  # its place: first
            for place, (t, lp) in enumerate(sorted(d.items(), key=lambda kv: -kv[1]), start=1):
                rank = place
                if t == target and ranks is not None and pos < len(ranks) and ranks[pos] is not None:
                    rank = int(ranks[pos])
                entry[str(t)] = {"logprob": finite(lp), "rank": rank,
                                 "decoded_token": self.token_text_after(t, prompt_ids[max(1, pos - 4):pos])}
            out.append(entry)
        return out
