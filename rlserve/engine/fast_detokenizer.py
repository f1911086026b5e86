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
* one ``DecodeStream`` step per id, also when one ``add_tokens`` call brings several: the
  decoders this class gets (:func:`new_detokenizer`: not ``ByteLevel``, e.g. Metaspace +
  ByteFallback) give a window's text depending on where it starts, so several ids in one step
  could read differently from one at a time (a ``ByteLevel`` decoder, which could take them
  together, gets :class:`~rlserve.engine.bytelevel_detokenizer.ByteLevelIncrementalDetokenizer`);
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

from rlserve.engine.detokenizer import (BaseIncrementalDetokenizer, IncrementalDetokenizer, _rust_backend,
                                        prompt_context, vocab_facts)

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
        self._vocab, self._limit = v, v.limit
        self._drop = v.special if skip_special_tokens else frozenset()
        ctx = prompt_context(self._decode, prompt_token_ids)
        self._stream = DecodeStream(ids=ctx, skip_special_tokens=skip_special_tokens)
        self._window = ctx  # the stream's emitted head (mirror, for finish and the fallback)
        self._pending: list[int] = []  # ids fed since its last emission (a partial character)
        self._fallback: IncrementalDetokenizer | None = None  # after an "Invalid prefix" error

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def _text_for(self, ids: list[int]) -> str | None:
        t = ids[0]  # one id (_batches is False)
        if t in self._drop or (t >= self._limit and self._vocab.unknown(t)):
            return ""  # no text can change
        if self._fallback is not None:
            return self._fallback_text(t)
        try:
            text = self._stream.step(self._backend, t)
        except Exception as e:  # noqa: BLE001 - re-raised unless it is the stream's prefix error
            if not str(e).startswith(_INVALID_PREFIX):
                raise
            self._fallback = IncrementalDetokenizer.resume(
                self.tokenizer, self.skip_special_tokens, self._window, self._pending)
            return self._fallback_text(t)
        if text is None:  # a partial character: held
            self._pending.append(t)
            return None
        self._window = self._pending + [t] if self._pending else [t]
        self._pending = []
        return text

    def _fallback_text(self, t: int) -> str:
        fb = self._fallback
        before = len(fb.output_text)
        fb.add_tokens([t])
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
