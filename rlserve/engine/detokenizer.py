"""Incremental detokenization with stop strings, for streaming.

Two decoders share one text/stop-string/streaming layer (:class:`BaseIncrementalDetokenizer`):

* :class:`~rlserve.engine.fast_detokenizer.FastIncrementalDetokenizer` (vLLM v1's name): the
  ``tokenizers`` library's ``DecodeStream``, one call into Rust per new id; used for plain fast
  tokenizers whose decoder is not ``ByteLevel`` (:func:`~rlserve.engine.fast_detokenizer.new_detokenizer`
  picks it; a ``ByteLevel`` one gets
  :class:`~rlserve.engine.bytelevel_detokenizer.ByteLevelIncrementalDetokenizer`);
* :class:`IncrementalDetokenizer` (this module): the prefix/read-offset technique of vLLM's v0
  ``detokenize_incrementally`` (itself from Hugging Face text-generation-inference), in Python,
  for any tokenizer with ``decode``; the fallback.

Both decode the same way (``DecodeStream`` is the same algorithm in Rust): a small window of
ids ``ids[prefix_offset:]`` is decoded together with its already-emitted head
``ids[prefix_offset:read_offset]``; the difference is the new text. While the window's text
ends in U+FFFD (a multi-byte character split across tokens) nothing is emitted and the
window grows, so partial characters never reach the output. The window starts with the
last few prompt tokens, so a first output token keeps its leading space (vLLM's
behaviour; for byte-level BPE tokenizers the final text equals
``tokenizer.decode(output_ids, skip_special_tokens=...)`` exactly, and for Metaspace /
SentencePiece tokenizers it differs only by that leading space). Windows are decoded with
``clean_up_tokenization_spaces=False`` (as vLLM).

Stop strings: after each token the newly decoded text is searched for every stop string
(a match may span token boundaries). On a match the text is cut at the start of the
earliest match (or at its end with ``include_stop_str_in_output``), the match is
reported and later tokens are ignored; the caller finishes the sequence with
``finish_reason="stop"`` and ``stop_reason=match.stop_str``. Several ids passed in one
:meth:`~BaseIncrementalDetokenizer.add_tokens` call give exactly what one call per id gives
(text, match, ``token_index``): a decoder that can decode them in one go does (``ByteLevelIncrementalDetokenizer``), and replays
them one at a time only when that batch completed a stop string or reached ``min_tokens``.

Streaming: :meth:`BaseIncrementalDetokenizer.take_delta` returns the text that became visible
since its last call. While the sequence runs, the longest tail of the text that could
still grow into a stop string is held back (not when the stop string is included in the
output), so a stop string is never streamed and then retracted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# Prompt tokens decoded as left context of the first output tokens (vLLM uses 5).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


def _rust_backend(tokenizer):
    """``tokenizer._tokenizer`` (the ``tokenizers.Tokenizer``) when ``tokenizer.decode(ids,
    skip_special_tokens=..., clean_up_tokenization_spaces=False)`` is a plain call of it, else None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode"):
        return None
    from transformers import PreTrainedTokenizerFast

    cls = type(tokenizer)
    stock = PreTrainedTokenizerFast  # whose _decode is ``_tokenizer.decode`` plus optional clean-up
    if cls.decode is not stock.decode or getattr(cls, "_decode", None) is not getattr(stock, "_decode", None):
        return None  # a subclass that post-processes decoding: keep the wrapper
    return backend


_VOCAB_CACHE_SIZE = 8


class _Vocab:
    """What a ``tokenizers.Tokenizer`` decodes to nothing, by id: ids it does not know (``limit``:
    every id below it is in the model's vocabulary or an added token, as vocabularies are
    numbered from 0; ids at or above it are looked up: :meth:`unknown`) and its special tokens
    (``special``, dropped by ``decode(..., skip_special_tokens=True)``: the ids of added tokens
    marked special and of any token with the same content); and whether several ids may be
    decoded in one step (``batch``: its decoder is ``ByteLevel``, which decodes the bytes of all
    the tokens together, so a window's text is its head's plus the rest's when the head ends with
    whole characters. Not so for ``ByteFallback``: an invalid run of byte tokens becomes one
    U+FFFD per byte only when decoded together, so a random model's bytes would read differently
    whole than one id at a time); ``texts``: id -> its
    text alone (``ByteLevelIncrementalDetokenizer``'s cache), filled as ids come. Built in well under a
    millisecond (``get_vocab`` would take ~0.4 s for SmolLM2's 49k tokens: a stall at the first
    request)."""

    __slots__ = ("limit", "special", "batch", "texts", "_id_to_token")

    def __init__(self, backend):
        from tokenizers.decoders import ByteLevel

        added = backend.get_added_tokens_decoder()  # id -> AddedToken
        self.limit = backend.get_vocab_size(with_added_tokens=False)  # the model's tokens, 0 .. limit-1
        special = {i for i, t in added.items() if t.special}
        special |= {backend.token_to_id(t.content) for t in added.values() if t.special} - {None}
        self.special = frozenset(special)
        self.batch = isinstance(backend.decoder, ByteLevel)
        self.texts: dict[int, str] = {}
        self._id_to_token = backend.id_to_token

    def unknown(self, t: int) -> bool:
        """``t`` is no token of the tokenizer's (call only for ``t >= limit``: ~0.4 us)."""
        return self._id_to_token(t) is None


_vocabs: dict[int, tuple] = {}  # id(backend) -> (backend, its size then, _Vocab)


def vocab_facts(backend) -> _Vocab:
    """``backend`` 's :class:`_Vocab`, built once (again when its size changed: tokens added)."""
    size = backend.get_vocab_size(with_added_tokens=True)
    hit = _vocabs.get(id(backend))
    if hit is not None and hit[0] is backend and hit[1] == size:
        return hit[2]
    if len(_vocabs) >= _VOCAB_CACHE_SIZE:
        _vocabs.pop(next(iter(_vocabs)))
    v = _vocabs[id(backend)] = (backend, size, _Vocab(backend))
    return v[2]


def prompt_context(decode, prompt_token_ids: Sequence[int]) -> list[int]:
    """The last few prompt ids, decoded as the left context of the first output ids; ``[]`` when
    they end inside a character (their text ends in U+FFFD). ``decode(ids) -> str``."""
    ctx = list(prompt_token_ids or ())[-_PROMPT_CONTEXT_TOKENS:]
    if ctx and decode(ctx).endswith(_REPLACEMENT_CHAR):
        return []
    return ctx


@dataclass(frozen=True)
class StopMatch:
    """A stop string found in the output text.

    Attributes:
        stop_str: the stop string that matched (use as ``stop_reason``).
        token_index: index, within the ``token_ids`` passed to that
            :meth:`BaseIncrementalDetokenizer.add_tokens` call, of the token that completed the
            match; tokens after it in that call were ignored.
        text_index: character offset of the match's start in the untruncated output text.
    """

    stop_str: str
    token_index: int
    text_index: int


class BaseIncrementalDetokenizer:
    """One sequence's output text: stop strings, ``min_tokens``, streaming hold-back and deltas.
    Subclasses decode (:meth:`_text_for`, :meth:`_flush`, optionally :meth:`_snapshot` /
    :meth:`_restore` to take several ids in one decode).

    Args:
        tokenizer: a Hugging Face tokenizer.
        prompt_token_ids: the prompt's ids (left context for the decoders that use it).
        skip_special_tokens: drop special tokens from the text.
        stop: stop strings (empty ones are ignored).
        include_stop_str_in_output: keep the matched stop string in the text.
        min_tokens: stop strings are not searched while fewer than this many output tokens
            were added (``SamplingParams.min_tokens``; text completed before that point is
            never matched later, as in vLLM).

    Build from request params with :meth:`from_params`. Usage by the engine, per step: ``match =
    detok.add_tokens(new_ids)``; if ``match`` finish with ``finish_reason="stop",
    stop_reason=match.stop_str`` (and drop the ids after ``match.token_index``). When a
    sequence ends for any other reason call :meth:`finish` (flushes a trailing partial
    character). As in vLLM, a terminating EOS / ``stop_token_ids`` token should be passed to
    ``add_tokens`` only when ``include_stop_str_in_output`` (with ``skip_special_tokens`` an
    EOS is invisible anyway). For intermediate (cumulative) outputs use :attr:`visible_text`;
    for deltas :meth:`take_delta`; at the end :attr:`output_text` (== :attr:`visible_text`).
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True,
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False, min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.min_tokens = int(min_tokens or 0)
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in (stop or ()) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.token_ids: list[int] = []
        self._text = ""
        self._sent = 0
        self.stop_match: StopMatch | None = None
        self._matched = ""
        self.finished = False
        self._start(prompt_token_ids)

    def _start(self, prompt_token_ids: Sequence[int]) -> None:
        """The decoder's own state (each subclass): from ``self.tokenizer``, ``self.skip_special_tokens``
        and the prompt's ids (left context). Raises ValueError where the tokenizer does not fit it."""
        raise NotImplementedError

    @classmethod
    def from_params(cls, tokenizer, prompt_token_ids: Sequence[int], params):
        """Build from a :class:`~rlserve.engine.sampling_params.SamplingParams`."""
        return cls(
            tokenizer,
            prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )

    # ------------------------------------------------------------------ decoding (subclasses)

    #: whether :meth:`_text_for` takes several ids at once, giving the text one call per id would
    _batches = False

    def _text_for(self, ids: list[int]) -> str | None:
        """Decode ``ids`` (just appended to :attr:`token_ids`; one id unless :attr:`_batches`): the
        text they complete ('' or None when none)."""
        raise NotImplementedError

    def _flush(self) -> str:
        """Text of a held partial character (ending in U+FFFD), '' when none; the sequence ends."""
        raise NotImplementedError

    def _snapshot(self):
        """The decoder's state, for :meth:`_restore` (when :attr:`_batches`)."""
        raise NotImplementedError

    def _restore(self, snap) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ stop strings

    def _find_stop(self, old_len: int) -> tuple[int, str] | None:
        """The earliest stop-string match that ends after the text's first ``old_len``
        characters: ``(index, stop string)``. (A match inside them was looked for when they
        came, or they came before ``min_tokens``: never matched, as in vLLM.)"""
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self._text.find(s, max(0, old_len - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _append_text(self, delta: str) -> int | None:
        """Append ``delta``; on a stop-string match truncate and return its start index."""
        if not delta:
            return None
        old_len = len(self._text)
        self._text += delta
        if not self.stop or len(self.token_ids) < self.min_tokens:
            return None
        best = self._find_stop(old_len)
        if best is None:
            return None
        i, s = best
        self._text = self._text[: i + len(s)] if self.include_stop_str_in_output else self._text[:i]
        self._sent = min(self._sent, len(self._text))
        self._matched = s
        return i

    def _add_batch(self, ids: list[int]) -> bool:
        """Decode all of ``ids`` in one go (the decoder gives the text one id at a time would)
        unless that completed a stop string or ``min_tokens`` is reached inside them (which need
        the token that did it). True when done; False: nothing changed (one at a time, then)."""
        if not self._batches or (self.stop and len(self.token_ids) + 1 < self.min_tokens):
            return False
        snap = self._snapshot() if self.stop else None
        n, old_len = len(self.token_ids), len(self._text)
        self.token_ids += ids
        text = self._text_for(ids)
        if text:
            self._text += text
            if self.stop and self._find_stop(old_len):
                self._text = self._text[:old_len]
                self._restore(snap)
                del self.token_ids[n:]
                return False
        return True

    # ------------------------------------------------------------------ public API

    def add_tokens(self, token_ids: Sequence[int]) -> StopMatch | None:
        """Feed newly generated ids (one step's or several steps').

        Returns:
            a :class:`StopMatch` when a stop string completed inside these tokens (the
            text is already truncated; tokens after ``match.token_index`` were ignored),
            else None. Calls after a match or after :meth:`finish` are ignored.
        """
        if self.stop_match is not None or self.finished:
            return None
        if not self.stop and len(token_ids) == 1:  # the usual call: no stop string to look for
            t = int(token_ids[0])
            self.token_ids.append(t)
            text = self._text_for([t])
            if text:
                self._text += text
            return None
        ids = [int(t) for t in token_ids]
        if len(ids) > 1 and self._add_batch(ids):
            return None
        for j, t in enumerate(ids):
            self.token_ids.append(t)
            idx = self._append_text(self._text_for([t]))
            if idx is not None:
                self.stop_match = StopMatch(self._matched, j, idx)
                return self.stop_match
        return None

    def finish(self) -> StopMatch | None:
        """Mark the sequence finished: flush a held partial character (as U+FFFD, as
        ``tokenizer.decode`` would) and release held-back text. Returns a stop match only if
        the flushed text completed one."""
        if self.finished:
            return None
        match = None
        if self.stop_match is None:
            idx = self._append_text(self._flush())
            if idx is not None:
                self.stop_match = match = StopMatch(self._matched, len(self.token_ids) - 1, idx)
        self.finished = True
        return match

    @property
    def output_text(self) -> str:
        """All text decoded so far (complete characters only until :meth:`finish`); cut at
        the stop string on a match. May end with a tail held back from streaming."""
        return self._text

    def _holdback(self) -> int:
        if (
            self.finished
            or self.stop_match is not None
            or not self.stop
            or self.include_stop_str_in_output
        ):
            return 0
        text = self._text
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    @property
    def visible_text(self) -> str:
        """Text that is safe to show now: :attr:`output_text` minus a tail that may still
        become a stop string (nothing is held back once finished or stopped)."""
        end = max(self._sent, len(self._text) - self._holdback())
        return self._text[:end]

    def take_delta(self) -> str:
        """Text newly visible since the previous call (streaming). Concatenating every
        delta, including one taken after a match or :meth:`finish`, gives the final
        :attr:`output_text`."""
        end = len(self.visible_text)
        delta = self._text[self._sent : end]
        self._sent = end
        return delta


class IncrementalDetokenizer(BaseIncrementalDetokenizer):
    """The prefix/read-offset decoder in Python (see the module docstring), one id at a time.

    Args:
        tokenizer: a Hugging Face tokenizer (anything with ``decode(ids,
            skip_special_tokens=..., clean_up_tokenization_spaces=...)``).
        prompt_token_ids: the prompt's ids; its last few give left context.
        skip_special_tokens, stop, include_stop_str_in_output, min_tokens: see
            :class:`BaseIncrementalDetokenizer`.
    """

    def _start(self, prompt_token_ids: Sequence[int]) -> None:
        tokenizer, skip_special_tokens = self.tokenizer, self.skip_special_tokens
        # a "fast" HF tokenizer's Rust backend (tokenizers.Tokenizer), when it decodes exactly like
        # the wrapper (no clean-up of spaces, no Python-side special-token handling)
        self._backend = _rust_backend(tokenizer)
        # ids its decode drops, kept out of the window (which would otherwise grow by each and be
        # decoded whole at every step): ids >= limit (unknown: a dummy-weight model's, beyond a
        # small tokenizer's vocabulary) and, with skip_special_tokens, special tokens
        if self._backend is not None:
            self._vocab = vocab_facts(self._backend)
            special = self._vocab.special
        else:
            self._vocab, special = None, frozenset(getattr(tokenizer, "all_special_ids", None) or ())
        self._drop = special if skip_special_tokens else frozenset()
        self._start_window(prompt_context(self._decode, prompt_token_ids), None)

    def _start_window(self, ids: list[int], read_offset: int | None) -> None:
        """Decode from the window ``ids``, of which ``ids[:read_offset]`` (all when None) was emitted."""
        self._ids: list[int] = ids
        self._prefix_offset = 0
        self._read_offset = len(ids) if read_offset is None else read_offset
        self._prefix_text = self._decode(ids[: self._read_offset])

    @classmethod
    def resume(cls, tokenizer, skip_special_tokens: bool, window: list[int], pending: list[int]):
        """A decoder (no stop strings) that goes on from another one's window: ``window`` its
        emitted head, ``pending`` the ids after it (a partial character). What
        :class:`~rlserve.engine.fast_detokenizer.FastIncrementalDetokenizer` falls back to."""
        self = cls(tokenizer, (), skip_special_tokens)
        self._start_window(list(window) + list(pending), len(window))
        return self

    # ------------------------------------------------------------------ decoding

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        if self._backend is not None:
            # the Rust tokenizer directly: transformers' decode wrapper costs ~3x more per call,
            # and this runs twice per generated token
            return self._backend.decode(list(ids), skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(
            list(ids),
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _step(self, force: bool = False) -> str:
        """Decode the window; return newly completed text (advancing offsets) or ''."""
        new_text = self._decode(self._ids[self._prefix_offset :])
        prefix_text = self._prefix_text
        if len(new_text) > len(prefix_text) and (force or not new_text.endswith(_REPLACEMENT_CHAR)):
            delta = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
            return delta
        return ""

    def _text_for(self, ids: list[int]) -> str:
        v, drop = self._vocab, self._drop
        out = ""
        for t in ids:
            if t in drop or (v is not None and t >= v.limit and v.unknown(t)):
                # decoded to nothing, alone or in context: no text can change and no stop string
                # complete (issue 37's c256 stream, whose dummy-weight model samples ids beyond
                # the tiny tokenizer's 336, spent 2.33 s of its 7.4 s event loop decoding them)
                continue
            self._ids.append(t)
            out += self._step()
        return out

    def _flush(self) -> str:
        return self._step(force=True) if self._read_offset < len(self._ids) else ""
