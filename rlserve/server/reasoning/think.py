"""``--reasoning-parser deepseek_r1`` and ``qwen3``: the text between ``<think>`` and
``</think>`` is the answer's ``reasoning``, the rest its ``content``.

Reference: vLLM 0.32's ``DeepSeekR1ReasoningParser`` (token-id based; an output without
``<think>`` is reasoning up to ``</think>``, as R1's template opens the block in the prompt) and
its Qwen3 parser engine (``vllm/parser/qwen3.py``: reasoning from the first token unless
``chat_template_kwargs.enable_thinking`` is false, a ``<tool_call>`` also ends the reasoning and
stays in the content for the tool parser, a second ``</think>`` is dropped). Both need
``<think>`` and ``</think>`` in the vocabulary (ValueError otherwise, at startup).

A parser instance serves one choice of one request; streamed, it is fed each delta
(:meth:`stream`) and returns a delta dict (:mod:`rlserve.server.tool_parsers.base`) or None.
"""

from __future__ import annotations

from rlserve.server.tool_parsers.base import delta, partial_tag_overlap

THINK, END_THINK, TOOL_CALL = "<think>", "</think>", "<tool_call>"


class ThinkReasoningParser:
    """DeepSeek R1's ``<think>`` parser (see the module docstring).

    Args:
        vocab: the tokenizer's ``{token: id}``.
        chat_template_kwargs: the request's (unused here; Qwen3 reads ``enable_thinking``).

    Raises:
        ValueError: ``<think>`` or ``</think>`` is not one token of the vocabulary.
    """

    engine_based = False  # vLLM's engine_based_streaming (Qwen3's parser engine: True)

    def __init__(self, vocab: dict[str, int], chat_template_kwargs: dict | None = None):
        self.start_id, self.end_id = vocab.get(THINK), vocab.get(END_THINK)
        if self.start_id is None or self.end_id is None:
            raise ValueError(f"{type(self).__name__}: the tokenizer has no {THINK!r} / {END_THINK!r} token")
        self.end_ids = {self.end_id}

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a whole output (content None when empty)."""
        before, sep, after = text.partition(THINK)
        text = after if sep else before
        if END_THINK not in text:
            return text, None
        reasoning, _, content = text.partition(END_THINK)
        return reasoning, content or None

    def count(self, ids: list[int], pieces: list[str]) -> int:
        """Reasoning tokens among an output's ``ids``: those inside ``<think>`` ... ``</think>``
        tokens (a depth count on ids, as vLLM's: an output without the ``<think>`` token counts
        0; ``pieces``, each token's text, unused)."""
        n = depth = 0
        for t in ids:
            if t == self.start_id:
                depth += 1
            elif t == self.end_id:
                depth = max(depth - 1, 0)
            elif depth:
                n += 1
        return n

    def is_reasoning_end(self, ids: list[int]) -> bool:
        """Whether ``ids`` (a prompt) leave the reasoning closed: a ``</think>`` after the last
        ``<think>``."""
        for t in reversed(ids):
            if t == self.start_id:
                return False
            if t == self.end_id:
                return True
        return False

    def gate_ids(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(ids after which, ids with which)`` a structured-output constraint starts when the
        reasoning ends (vLLM's engine gate): after ``</think>``."""
        return (self.end_id,), ()

    def ends_in(self, delta_ids: list[int]) -> bool:
        """Whether this delta's tokens end the reasoning."""
        return self.end_id in delta_ids

    def content_ids(self, ids: list[int]) -> list[int]:
        """The ids after the end of the reasoning (none when it is the last id)."""
        if self.end_id not in ids[:-1]:
            return []
        return ids[ids.index(self.end_id) + 1:]

    def flush(self) -> str:
        """Text held back from the content at the end of the reasoning (none here)."""
        return ""

    def stream(self, previous_text, current_text, delta_text, previous_ids, current_ids, delta_ids):
        """vLLM's ``BaseThinkingReasoningParser`` with R1's rule for an output without ``<think>``."""
        s, e = self.start_id, self.end_id
        if len(delta_ids) == 1 and delta_ids[0] in (s, e):
            return None
        if s in previous_ids or s not in delta_ids:  # (R1: an output without <think> is reasoning too)
            if e in delta_ids:
                k = delta_text.find(END_THINK)
                content = delta_text[k + len(END_THINK):]
                return delta(content=content if content else None, reasoning=delta_text[:k])
            if e in previous_ids:
                return delta(content=delta_text)
            return delta(reasoning=delta_text)
        if e in delta_ids:
            a, k = delta_text.find(THINK), delta_text.find(END_THINK)
            content = delta_text[k + len(END_THINK):]
            return delta(content=content if content else None, reasoning=delta_text[a + len(THINK):k])
        return delta(reasoning=delta_text)


class Qwen3ReasoningParser(ThinkReasoningParser):
    """Qwen3's reasoning (see the module docstring): a text state machine over ``<think>``,
    ``</think>`` and ``<tool_call>``; streamed, a possible marker prefix at the end of a delta
    is held back until the next delta decides it."""

    engine_based = True

    def __init__(self, vocab, chat_template_kwargs=None):
        super().__init__(vocab, chat_template_kwargs)
        self.thinking = (chat_template_kwargs or {}).get("enable_thinking", True) is not False
        tool_id = vocab.get(TOOL_CALL)
        self.end_ids = {self.end_id} | ({tool_id} if tool_id is not None else set())
        self._boundaries = {vocab[t] for t in ("<|im_start|>", "<|im_end|>") if t in vocab}
        self._in_reasoning = self.thinking
        self._held = ""
        self._ended = False

    def _feed(self, text: str, final: bool) -> tuple[str, str]:
        """Run the state machine over ``text`` (after what was held): ``(reasoning, content)``."""
        text, self._held = self._held + text, ""
        reasoning, content = [], []
        while text:
            if not self._in_reasoning:
                k = text.find(END_THINK)
                if k < 0:
                    hold = 0 if final else partial_tag_overlap(text, END_THINK)
                    content.append(text[:len(text) - hold])
                    self._held = text[len(text) - hold:]
                    break
                content.append(text[:k])
                text = text[k + len(END_THINK):]
                continue
            hits = [(text.find(m), m) for m in (THINK, END_THINK, TOOL_CALL) if m in text]
            if not hits:
                hold = 0 if final else max(partial_tag_overlap(text, m) for m in (THINK, END_THINK, TOOL_CALL))
                reasoning.append(text[:len(text) - hold])
                self._held = text[len(text) - hold:]
                break
            k, m = min(hits)
            reasoning.append(text[:k])
            if m == THINK:
                text = text[k + len(m):]
            elif m == END_THINK:
                self._in_reasoning, self._ended = False, True
                text = text[k + len(m):]
            else:  # <tool_call> ends the reasoning and belongs to the content
                self._in_reasoning, self._ended = False, True
                text = text[k:]
        return "".join(reasoning), "".join(content)

    def extract(self, text):
        if not self.thinking:
            return None, text
        self._in_reasoning, self._held = True, ""
        reasoning, content = self._feed(text, final=True)
        return reasoning or None, content or None

    def count(self, ids, pieces):
        """Tokens whose text (``pieces``) is reasoning, fed one by one through a fresh parser
        (as vLLM's engine counts the tokens of its reasoning events): a token counts when it
        gives reasoning text or leaves text held back (a possible marker) in the reasoning."""
        n = 0
        for piece in pieces:
            if not self._in_reasoning:
                break
            reasoning, _ = self._feed(piece, final=False)
            n += bool(reasoning) or (self._in_reasoning and bool(self._held))
        return n

    def is_reasoning_end(self, ids):
        for t in reversed(ids):
            if t in self.end_ids:
                return True
            if t == self.start_id:
                return False
            if t in self._boundaries:
                break
        return not self.thinking

    def gate_ids(self):
        """After ``</think>``; with ``<tool_call>`` (an implicit end: vLLM's parser engine
        constrains from that token, which the call's grammar starts with)."""
        return (self.end_id,), tuple(sorted(self.end_ids - {self.end_id}))

    def ends_in(self, delta_ids):
        return self._ended

    def content_ids(self, ids):
        return ids

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out

    def stream(self, previous_text, current_text, delta_text, previous_ids, current_ids, delta_ids):
        reasoning, content = self._feed(delta_text, final=False)
        if not reasoning and not content:
            return None
        return delta(content=content or ..., reasoning=reasoning or ...)
