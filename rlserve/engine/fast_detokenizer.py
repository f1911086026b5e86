"""The fast incremental detokenizer: ``tokenizers.decoders.DecodeStream`` (issue 37).

:class:`FastIncrementalDetokenizer` (vLLM v1's name, ``vllm/v1/engine/detokenizer.py``) decodes
a sequence's new ids with ``DecodeStream.step``: the prefix/read-offset technique of
:class:`~rlserve.engine.detokenizer.IncrementalDetokenizer` done in Rust, one call into the
tokenizer per step instead of two ``decode`` calls and their Python around them per id. It keeps
every rule of :class:`~rlserve.engine.detokenizer.BaseIncrementalDetokenizer` (stop strings,
``min_tokens``, streaming hold-back) and gives the text of
:class:`~rlserve.engine.detokenizer.IncrementalDetokenizer`, delta for delta:

* the stream starts from the same prompt context (:func:`~rlserve.engine.detokenizer.prompt_context`),
  primed with ``DecodeStream(ids=context)`` (its text is not output);
* ids the Rust decode drops anyway -- ids the tokenizer does not know (a dummy-weight model's,
  beyond a small vocabulary) and, with ``skip_special_tokens``, special tokens -- are not fed
  (they would only lengthen the window decoded at every step), from the tokenizer's
  :func:`~rlserve.engine.detokenizer.vocab_facts`;
* several ids (one ``add_tokens`` call) take one step up to the last of them whose text alone
  is whole characters, where one id at a time would have emitted everything too, and one step
  each after it; only for a ``ByteLevel`` decoder (``vocab_facts(...).batch``), whose text does
  not depend on where a window starts, otherwise one step per id;
* :meth:`~rlserve.engine.detokenizer.BaseIncrementalDetokenizer.finish` flushes a partial
  character as the Python decoder does: the window the stream holds is mirrored (the ids of its
  last emitting step plus those since, ``_window`` and ``_pending``, updated only at an emission
  or while a character is incomplete) and decoded once with ``force``;
* ``DecodeStream`` raises "Invalid prefix encountered" when a window's text does not start with
  its head's text (a decoder whose output for earlier ids changes with later ids); the
  sequence then goes on in :class:`~rlserve.engine.detokenizer.IncrementalDetokenizer` resumed
  from the mirrored window (:meth:`~rlserve.engine.detokenizer.IncrementalDetokenizer.resume`),
  which emits the text that decoder would have.

:func:`new_detokenizer` picks the class: for a plain fast tokenizer (``_rust_backend`` not None)
whose decoder is ``ByteLevel``,
:class:`~rlserve.engine.bytelevel_detokenizer.ByteLevelIncrementalDetokenizer` (no decode for a
token whose text is whole characters); for another, this one when the installed ``tokenizers``
has a ``DecodeStream`` that takes ``ids=`` and lists
(:func:`stream_supported`: tokenizers 0.23.3 here; the GPU image's transformers 5.17 requires
``tokenizers>=0.23.1,<0.24``), else :class:`~rlserve.engine.detokenizer.IncrementalDetokenizer`.
"""

from __future__ import annotations

from typing import Sequence

from rlserve.engine.detokenizer import (_REPLACEMENT_CHAR, BaseIncrementalDetokenizer, IncrementalDetokenizer,
                                        _rust_backend, prompt_context, vocab_facts)

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None

# the start of the message of DecodeStream's error for a window whose text changed its head's
_INVALID_PREFIX = "Invalid prefix encountered"


_stream_ok: list[bool] = []  # stream_supported's answer, once per process


def stream_supported(backend) -> bool:
    """True when this ``tokenizers`` has a ``DecodeStream`` that takes ``ids=`` and a list of
    ids (``backend``: any ``tokenizers.Tokenizer``, to try a step on; the answer is kept)."""
    if not _stream_ok:
        ok = DecodeStream is not None
        if ok:
            try:
                DecodeStream(ids=[], skip_special_tokens=False).step(backend, [])
            except TypeError:  # tokenizers 0.21: DecodeStream(skip_special_tokens), step(tokenizer, int)
                ok = False
        _stream_ok.append(ok)
    return _stream_ok[0]


class FastIncrementalDetokenizer(BaseIncrementalDetokenizer):
    """One sequence's detokenizer on ``DecodeStream`` (see the module docstring).

    Args:
        tokenizer: a ``PreTrainedTokenizerFast`` whose decode is a plain call of its Rust
            tokenizer (``rlserve.engine.detokenizer._rust_backend`` not None), else ValueError.
        prompt_token_ids: the prompt's ids; its last few give left context.
        skip_special_tokens, stop, include_stop_str_in_output, min_tokens: see
            :class:`~rlserve.engine.detokenizer.BaseIncrementalDetokenizer`.
    """

    def _start(self, prompt_token_ids: Sequence[int]) -> None:
        tokenizer, skip_special_tokens = self.tokenizer, self.skip_special_tokens
        backend = _rust_backend(tokenizer)
        if backend is None or DecodeStream is None:
            raise ValueError("FastIncrementalDetokenizer needs a plain fast tokenizer and tokenizers' DecodeStream")
        self._backend = backend
        v = vocab_facts(backend)
        self._vocab, self._limit, self._batches, self._whole_ids = v, v.limit, v.batch, v.whole
        self._drop = v.special if skip_special_tokens else frozenset()
        ctx = prompt_context(self._decode, prompt_token_ids)
        self._stream = DecodeStream(ids=ctx, skip_special_tokens=skip_special_tokens)
        self._window = ctx  # the stream's emitted head (mirror, for finish and the fallback)
        self._pending: list[int] = []  # ids fed since its last emission (a partial character)
        self._fallback: IncrementalDetokenizer | None = None  # after an "Invalid prefix" error

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def _text_for(self, ids: list[int]) -> str | None:
        limit, drop = self._limit, self._drop
        if len(ids) == 1:
            t = ids[0]
            if t in drop or (t >= limit and self._vocab.unknown(t)):
                return ""  # no text can change
            return self._step(ids)
        known = [t for t in ids if t not in drop and (t < limit or not self._vocab.unknown(t))]
        # one step up to the last id whose text alone is whole characters (one id at a time would
        # have emitted there: the window's text ends with that id's), then one id at a time
        m = len(known) - 1
        while m >= 0 and not self._whole(known[m]):
            m -= 1
        text, rest = ("", known) if m < 1 else (self._step(known[:m + 1]) or "", known[m + 1:])
        for t in rest:
            text += self._step([t]) or ""
        return text

    def _whole(self, t: int) -> bool:
        w = self._whole_ids.get(t)
        if w is None:
            s = self._backend.decode([t], skip_special_tokens=False)
            w = self._whole_ids[t] = bool(s) and _REPLACEMENT_CHAR not in s
        return w

    def _step(self, known: list[int]) -> str | None:
        """One ``DecodeStream`` step over ``known`` (ids it does not drop): the text it emitted,
        None when it holds a partial character."""
        if self._fallback is not None:
            return self._fallback_text(known)
        try:
            text = self._stream.step(self._backend, known if len(known) > 1 else known[0])
        except Exception as e:  # noqa: BLE001 - re-raised unless it is the stream's prefix error
            if not str(e).startswith(_INVALID_PREFIX):
                raise
            self._fallback = IncrementalDetokenizer.resume(
                self.tokenizer, self.skip_special_tokens, self._window, self._pending)
            self._batches = False  # (a snapshot cannot hold the fallback's state)
            return self._fallback_text(known)
        if text is None:
            self._pending = self._pending + known  # a new list: a snapshot may hold the old one
            return None
        self._window = self._pending + known if self._pending else known
        self._pending = []
        return text

    def _fallback_text(self, known: list[int]) -> str:
        fb = self._fallback
        before = len(fb.output_text)
        fb.add_tokens(known)
        return fb.output_text[before:]

    def _flush(self) -> str:
        if self._fallback is not None:
            before = len(self._fallback.output_text)
            self._fallback.finish()
            return self._fallback.output_text[before:]
        if not self._pending:
            return ""
        head = self._decode(self._window)
        text = self._decode(self._window + self._pending)
        return text[len(head):] if len(text) > len(head) else ""

    def _snapshot(self):
        return self._stream.__copy__(), self._window, self._pending, self._fallback

    def _restore(self, snap) -> None:
        self._stream, self._window, self._pending, self._fallback = snap


def new_detokenizer(tokenizer, prompt_token_ids: Sequence[int], params) -> BaseIncrementalDetokenizer:
    """The detokenizer of one sample of a request with :class:`~rlserve.engine.sampling_params.SamplingParams`
    ``params``: for a plain fast tokenizer,
    :class:`~rlserve.engine.bytelevel_detokenizer.ByteLevelIncrementalDetokenizer` when its decoder
    is ``ByteLevel``, else :class:`FastIncrementalDetokenizer` when ``tokenizers`` allows it; else
    :class:`~rlserve.engine.detokenizer.IncrementalDetokenizer`."""
    backend = _rust_backend(tokenizer)
    if backend is not None and vocab_facts(backend).batch:
        from rlserve.engine.bytelevel_detokenizer import ByteLevelIncrementalDetokenizer

        return ByteLevelIncrementalDetokenizer.from_params(tokenizer, prompt_token_ids, params)
    if backend is not None and stream_supported(backend):
        return FastIncrementalDetokenizer.from_params(tokenizer, prompt_token_ids, params)
    return IncrementalDetokenizer.from_params(tokenizer, prompt_token_ids, params)
