"""Incremental detokenization for byte-level BPE tokenizers without a decode per token (issue 37).

A tokenizer whose decoder is ``ByteLevel`` (GPT-2, Llama 3, Qwen, SmolLM2: ``vocab_facts(...).batch``)
decodes ids by concatenating each token's bytes and reading them as UTF-8 with U+FFFD for invalid
or cut sequences. Its text is therefore separable at a character boundary: when the bytes of ``A``
end with a whole character, ``decode(A + B) == decode(A) + decode(B)``. The window technique of
:class:`~rlserve.engine.detokenizer.IncrementalDetokenizer` (and ``DecodeStream``) only emits at
such boundaries (a text that does not end in U+FFFD), so what it emits for the ids since its last
emission is exactly ``decode(those ids)``, whatever came before them (the prompt context too).

:class:`ByteLevelIncrementalDetokenizer` keeps just those ids (``_pending``) and:

* with nothing pending, an id whose text alone is whole characters (``decode([id])`` not empty and
  not ending in U+FFFD) emits that text, read from a per-tokenizer cache (``vocab_facts(...).texts``):
  a dict look-up instead of two decodes of a window in Rust (~6-7k instructions each);
* otherwise the id joins ``_pending``, which is decoded (a few ids: one character split over
  tokens) and emitted once its text does not end in U+FFFD; an id whose text is empty is dropped;
* :meth:`~rlserve.engine.detokenizer.BaseIncrementalDetokenizer.finish` emits ``decode(pending)``
  (the U+FFFD of a cut character), as the window's forced step does.

The text is the window decoder's, delta for delta (tests/test_fast_detokenizer.py compares the three
decoders on random ids). Several ids in one ``add_tokens`` call are taken one by one here (each is a
look-up), so no batch has to be replayed: a snapshot (for a batch that completed a stop string) is
the pending list.
"""

from __future__ import annotations

from typing import Sequence

from rlserve.engine.detokenizer import _REPLACEMENT_CHAR, BaseIncrementalDetokenizer, _rust_backend, vocab_facts


class ByteLevelIncrementalDetokenizer(BaseIncrementalDetokenizer):
    """One sequence's detokenizer for a ``ByteLevel`` tokenizer (see the module docstring).

    Args:
        tokenizer: a ``PreTrainedTokenizerFast`` whose decode is a plain call of its Rust
            tokenizer and whose decoder is ``ByteLevel``, else ValueError.
        prompt_token_ids: unused (the text after a whole character does not depend on what came
            before it); taken for the other decoders' signature.
        skip_special_tokens, stop, include_stop_str_in_output, min_tokens: see
            :class:`~rlserve.engine.detokenizer.BaseIncrementalDetokenizer`.
    """

    _batches = True

    def _start(self, prompt_token_ids: Sequence[int]) -> None:
        tokenizer, skip_special_tokens = self.tokenizer, self.skip_special_tokens
        backend = _rust_backend(tokenizer)
        v = None if backend is None else vocab_facts(backend)
        if v is None or not v.batch:
            raise ValueError("ByteLevelIncrementalDetokenizer needs a plain fast tokenizer with a ByteLevel decoder")
        self._backend, self._vocab, self._texts = backend, v, v.texts
        self._drop = v.special if skip_special_tokens else frozenset()
        self._pending: list[int] = []  # ids since the last emission (a character cut over tokens)

    def _text_of(self, t: int) -> str:
        """``decode([t])`` (special tokens as their content), cached per tokenizer."""
        s = self._texts.get(t)
        if s is None:
            s = self._texts[t] = self._backend.decode([t], skip_special_tokens=False)
        return s

    def _text_for(self, ids: list[int]) -> str:
        v, drop, out = self._vocab, self._drop, ""
        for t in ids:
            if t in drop or (t >= v.limit and v.unknown(t)):
                continue  # decoded to nothing
            if not self._pending:
                s = self._text_of(t)
                if not s.endswith(_REPLACEMENT_CHAR):
                    out += s  # whole characters ('' for an empty token: nothing to hold)
                    continue
            self._pending = self._pending + [t]  # a new list: a snapshot may hold the old one
            s = self._backend.decode(self._pending, skip_special_tokens=self.skip_special_tokens)
            if s and not s.endswith(_REPLACEMENT_CHAR):
                out += s
                self._pending = []
        return out

    def _flush(self) -> str:
        if not self._pending:
            return ""
        s = self._backend.decode(self._pending, skip_special_tokens=self.skip_special_tokens)
        self._pending = []
        return s

    def _snapshot(self):
        return self._pending

    def _restore(self, snap) -> None:
        self._pending = snap
