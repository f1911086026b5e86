"""FastIncrementalDetokenizer (issue 37): ``DecodeStream`` gives the text of the Python
IncrementalDetokenizer, delta for delta, and ``tokenizer.decode`` 's final text; several ids in one
``add_tokens`` call give what one call per id gives (stop-string match and its token_index
included); OutputProcessor cuts tokens and logprobs where a stop string completed inside a delta.

Random id sequences mix multi-byte characters split across tokens, byte-fallback tokens
(Metaspace tokenizer), special tokens (skipped and not), ids the tokenizer does not know, and stop
strings cut from the text at every position; on the tests' tiny byte-level tokenizer, a
SentencePiece-style one, and the default model's real SmolLM2 tokenizer when it is in rlserve's
cache (``rlserve download``)."""

from __future__ import annotations

import random

import pytest

from rlserve.engine import fast_detokenizer
from rlserve.engine.bytelevel_detokenizer import ByteLevelIncrementalDetokenizer
from rlserve.engine.detokenizer import IncrementalDetokenizer, vocab_facts
from rlserve.engine.fast_detokenizer import FastIncrementalDetokenizer, new_detokenizer
from rlserve.engine.sampling_params import SamplingParams
from tests.test_detokenizer import _sentencepiece_style_tokenizer
from tests.tiny_models import build_tokenizer

TEXT = "héllo 世界 🙂 the end. STOP now — ça va? 日本語 ok"


def _smollm2():
    from rlserve.download import default_model_dir

    path = default_model_dir()
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"the default model's tokenizer is not in rlserve's cache ({path}): `rlserve download` fetches it")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


TOKENIZERS = {"tiny_bytelevel": build_tokenizer, "metaspace_byte_fallback": _sentencepiece_style_tokenizer,
              "smollm2": _smollm2}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tok(request):
    return request.param, TOKENIZERS[request.param]()


def _run(cls, tok, prompt, ids, chunks, **kw):
    """Feed ``ids`` in pieces of ``chunks`` sizes, taking a delta after each call; returns
    everything a caller can see."""
    d = cls(tok, prompt, **kw)
    deltas, visible, match, i = [], [], None, 0
    for c in chunks:
        match = d.add_tokens(ids[i:i + c])
        i += c
        deltas.append(d.take_delta())
        visible.append(d.visible_text)
        if match:
            break
    flushed = None if match else d.finish()
    deltas.append(d.take_delta())
    m = None if match is None else (match.stop_str, match.token_index + i - c, match.text_index)
    return dict(text=d.output_text, deltas=deltas, visible=visible, match=m, n_tokens=len(d.token_ids),
                flushed=flushed and (flushed.stop_str, flushed.text_index))


def _random_case(rng, tok):
    """Ids (known text, random vocabulary ids, special tokens, unknown ids), a prompt, chunks."""
    words = tok.encode(TEXT, add_special_tokens=False)
    vocab = len(tok)
    special = sorted(tok.added_tokens_decoder)
    ids = []
    for _ in range(rng.randrange(0, 24)):
        r = rng.random()
        ids.append(rng.choice(words) if r < 0.45 else rng.randrange(vocab) if r < 0.75 else
                   rng.choice(special) if r < 0.85 else vocab + rng.randrange(10_000))
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
    chunks = []
    while sum(chunks) <= len(ids):
        chunks.append(rng.choice((1, 1, 2, 3, 5, 8)))
    return ids, prompt, chunks


def _check(tok, ids, prompt, chunks, **kw):
    ref = _run(IncrementalDetokenizer, tok, prompt, ids, [1] * (len(ids) + 1), **kw)
    assert "".join(ref["deltas"]) == ref["text"]  # nothing streamed is taken back
    classes = [FastIncrementalDetokenizer]
    if vocab_facts(tok._tokenizer).batch:
        classes.append(ByteLevelIncrementalDetokenizer)
    for cls, ch in [(c, ch) for c in classes for ch in ([1] * (len(ids) + 1), chunks)]:
        got = _run(cls, tok, prompt, ids, ch, **kw)
        if ch is chunks:  # deltas are taken per call: compare where both saw the same ids
            ends = [sum(chunks[:k + 1]) for k in range(len(got["visible"]))]
            assert [ref["visible"][e - 1] if e <= len(ref["visible"]) else ref["visible"][-1] for e in ends] == \
                got["visible"], kw
            assert "".join(got["deltas"]) == "".join(ref["deltas"]) == got["text"]
            got = {k: v for k, v in got.items() if k not in ("deltas", "visible")}
            want = {k: v for k, v in ref.items() if k not in ("deltas", "visible")}
        else:
            want = ref
        assert got == want, (ids, prompt, chunks, kw)
    return ref


@pytest.mark.parametrize("seed", range(4))
def test_random_ids_same_text_as_the_python_decoder_and_tokenizer_decode(tok, seed):
    name, t = tok
    rng = random.Random(seed)
    for _ in range(60):
        ids, prompt, chunks = _random_case(rng, t)
        for skip in (True, False):
            ref = _check(t, ids, prompt, chunks, skip_special_tokens=skip)
            want = t.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            # byte-level BPE: tokenizer.decode exactly; Metaspace without a prompt (after one it
            # keeps the first space) and valid UTF-8 (ByteFallback turns a whole run of byte tokens
            # into U+FFFDs when it is invalid, across the windows' borders: both decoders alike)
            if name != "metaspace_byte_fallback" or not (prompt or "\ufffd" in want):
                assert ref["text"] == want, (ids, prompt, skip)
            # a partial character is never streamed: only the flush at the end may end in U+FFFD
            assert not any(x.endswith("\ufffd") for x in ref["deltas"][:-1])


@pytest.mark.parametrize("seed", range(2))
def test_stop_strings_at_every_position(tok, seed):
    """A stop string cut from the final text at every offset (lengths 1-4), with and without
    include_stop_str_in_output and min_tokens: the same text, match, token_index, text_index and
    kept tokens, whole-list or one id at a time."""
    _, t = tok
    rng = random.Random(100 + seed)
    cases = 0
    while cases < 8:
        ids, prompt, chunks = _random_case(rng, t)
        full = _run(IncrementalDetokenizer, t, prompt, ids, [1] * (len(ids) + 1))["text"]
        if not full.replace("\ufffd", ""):
            continue
        cases += 1
        for a in range(len(full)):
            stop = full[a:a + rng.randrange(1, 5)]
            if "\ufffd" in stop:
                continue
            kw = dict(stop=[stop, "zz\u00e9q"], include_stop_str_in_output=rng.random() < 0.3,
                      min_tokens=rng.choice((0, 0, 3)))
            ref = _check(t, ids, prompt, chunks, **kw)
            if ref["match"] is not None:
                # the text stops at the stop string's first place in what was decoded by then
                s, j, i = ref["match"]
                assert s == stop and ref["n_tokens"] == j + 1
                assert ref["text"] == full[:i + (len(s) if kw["include_stop_str_in_output"] else 0)]
                assert i == full.find(stop) or kw["min_tokens"]  # min_tokens: a later one may be the first searched


def test_min_tokens_text_is_never_matched_later():
    """Text decoded before ``min_tokens`` is not searched later, even within a longer stop
    string's reach (it was: a 1-character stop string inside the last characters streamed before
    min_tokens matched at the min_tokens-th token, and the streamed text was taken back)."""
    t = build_tokenizer()
    ids = t.encode("ab cd ef gh", add_special_tokens=False)
    k = next(k for k in range(len(ids)) if " " in t.decode(ids[:k + 1]))  # the token that brings the first space
    for cls in (IncrementalDetokenizer, FastIncrementalDetokenizer):
        for chunks in ([1] * len(ids), [len(ids)]):
            got = _run(cls, t, [], ids, chunks, stop=[" ", "longer stop"], min_tokens=k + 2)
            first_searched = t.decode(ids[:k + 1]).index(" ")
            assert got["match"][2] > first_searched and got["text"] == "".join(got["deltas"])
            assert got["text"] == t.decode(ids)[:got["match"][2]]


def test_partial_character_flushed_on_finish():
    t = build_tokenizer()
    ids = t.encode("ab 🙂", add_special_tokens=False)[:-1]  # cut inside the emoji
    for chunks in ([1] * len(ids), [len(ids)]):
        d = FastIncrementalDetokenizer(t, [])
        for k in range(0, len(ids), chunks[0]):
            d.add_tokens(ids[k:k + chunks[0]])
        assert "\ufffd" not in d.take_delta()
        d.finish()
        assert d.output_text == t.decode(ids) and d.output_text.endswith("\ufffd")


def test_unknown_and_skipped_special_ids_never_reach_the_stream():
    """Ids the Rust decode drops anyway are not fed to DecodeStream (the window would grow by each); the
    others one a step (the multi-id step of a ByteLevel decoder went with ByteLevelIncrementalDetokenizer)."""
    t = build_tokenizer()
    words = t.encode("héllo 世界", add_special_tokens=False)
    unknown, eos = len(t) + 7, t.eos_token_id
    d = FastIncrementalDetokenizer(t, [])
    fed = []

    class Spy:
        def __init__(self, real):
            self.real = real

        def step(self, backend, ids):
            fed.append(ids)
            return self.real.step(backend, ids)

    d._stream = Spy(d._stream)
    d.add_tokens([unknown, eos] + words[:2] + [unknown])
    d.add_tokens([eos])
    d.add_tokens(words[2:])
    assert all(isinstance(x, int) for x in fed)  # one id a step, also from a call with several
    assert unknown not in fed and eos not in fed and d.output_text == t.decode(words)
    assert d.token_ids == [unknown, eos] + words[:2] + [unknown, eos] + words[2:]
    d = FastIncrementalDetokenizer(t, [], skip_special_tokens=False)
    d.add_tokens([eos] + words)
    assert d.output_text == "<|im_end|>héllo 世界"


def test_bytelevel_decoder_decodes_only_characters_cut_over_tokens():
    """ByteLevelIncrementalDetokenizer reads a token whose text is whole characters from its cache:
    the Rust decode runs only for characters split over tokens (and once per new id)."""
    t = build_tokenizer()
    text = "the end. STOP 世界 now"
    ids = t.encode(text, add_special_tokens=False)
    ByteLevelIncrementalDetokenizer(t, []).add_tokens(ids)  # fills the cache
    d = ByteLevelIncrementalDetokenizer(t, [5, 6])
    calls = []

    class Spy:
        def __init__(self, real):
            self.real = real

        def decode(self, ids, **kw):
            calls.append(list(ids))
            return self.real.decode(ids, **kw)

    d._backend = Spy(d._backend)
    for i in ids:
        d.add_tokens([i])
    d.finish()
    assert d.output_text == text
    cut = [i for i in ids if "\ufffd" in t.decode([i])]  # the byte tokens of 世界
    assert cut and calls and all(set(c) <= set(cut) for c in calls), calls


def test_invalid_prefix_falls_back_to_the_python_decoder():
    """A decoder whose text for earlier tokens changes with later ones makes DecodeStream raise
    "Invalid prefix"; the sequence goes on in the Python decoder with its text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.decoders import DecodeStream
    from transformers import PreTrainedTokenizerFast

    class Shout:
        """Upper-cases everything once a "!" was decoded."""

        def decode_chain(self, tokens):
            return [x.upper() for x in tokens] if "!" in tokens else tokens

    vocab = {"[UNK]": 0, "a": 1, "b": 2, "!": 3, "c": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    t = PreTrainedTokenizerFast(tokenizer_object=backend)
    backend = t._tokenizer  # (the wrapper copies it; a custom decoder cannot be copied: set it after)
    backend.decoder = decoders.Decoder.custom(Shout())
    ids = [1, 2, 1, 3, 4, 1, 2]
    with pytest.raises(Exception, match="Invalid prefix"):
        s = DecodeStream(ids=[], skip_special_tokens=True)
        for i in ids:
            s.step(backend, i)
    for chunks in ([1] * 8, [2, 3, 5], [8]):
        want = _run(IncrementalDetokenizer, t, [1], ids, [1] * 8)
        got = _run(FastIncrementalDetokenizer, t, [1], ids, chunks)
        assert got["text"] == want["text"] and "".join(got["deltas"]) == "".join(want["deltas"])
    d = FastIncrementalDetokenizer(t, [1])
    d.add_tokens(ids)
    assert d._fallback is not None and d.output_text == "aba!Cab"  # by the lengths of the windows' texts


def test_new_detokenizer_picks_the_decoder():
    t = build_tokenizer()
    p = SamplingParams(stop=["x"], min_tokens=2, skip_special_tokens=False)
    d = new_detokenizer(t, [5, 6], p)  # a ByteLevel decoder
    assert type(d) is ByteLevelIncrementalDetokenizer and d.stop == ["x"] and d.min_tokens == 2
    assert d.skip_special_tokens is False
    d = new_detokenizer(_sentencepiece_style_tokenizer(), [5, 6], p)  # Metaspace + ByteFallback
    assert type(d) is FastIncrementalDetokenizer and d.stop == ["x"] and d.min_tokens == 2
    with pytest.raises(ValueError):
        ByteLevelIncrementalDetokenizer(_sentencepiece_style_tokenizer())

    class Wrapped(type(t)):  # a subclass that post-processes decoding: not a plain Rust call
        def decode(self, *a, **kw):
            return super().decode(*a, **kw)

    t2 = Wrapped(tokenizer_object=t._tokenizer)
    assert type(new_detokenizer(t2, [5], p)) is IncrementalDetokenizer
    with pytest.raises(ValueError):
        FastIncrementalDetokenizer(t2, [5])


def test_without_decode_stream_the_python_decoder_is_used(monkeypatch):
    t = _sentencepiece_style_tokenizer()  # (a ByteLevel one needs no DecodeStream)
    monkeypatch.setattr(fast_detokenizer, "DecodeStream", None)
    monkeypatch.setattr(fast_detokenizer, "_stream_ok", [])
    assert type(new_detokenizer(t, [5], SamplingParams())) is IncrementalDetokenizer

    class OldStream:  # tokenizers 0.21: DecodeStream(skip_special_tokens), step(tokenizer, int)
        def __init__(self, skip_special_tokens=False):
            pass

    monkeypatch.setattr(fast_detokenizer, "DecodeStream", OldStream)
    monkeypatch.setattr(fast_detokenizer, "_stream_ok", [])
    assert type(new_detokenizer(t, [5], SamplingParams())) is IncrementalDetokenizer


# ---- OutputProcessor: a request's tokens in one add_tokens call ---------------------------------
def _final(proc_deltas, params, tok):
    from types import SimpleNamespace

    from rlserve.engine.front.output_processor import OutputProcessor

    proc = OutputProcessor(tok)
    reqs = {"r": SimpleNamespace(params=params, stream=True, prompt=None, arrival_time=0.0)}
    last, texts = None, []
    for d in proc_deltas:
        outs, errors, _stops, _aborts = proc.process([d], reqs)
        assert not errors
        if outs:
            last = outs[-1]
            texts.append(last.outputs[0].text)
        if last is not None and last.finished:
            break
    c = last.outputs[0]
    return (c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason), texts


@pytest.mark.parametrize("engine_stop", [False, True])
def test_output_processor_cuts_at_a_stop_inside_a_delta(engine_stop):
    """The core's deltas of several steps handled together: one delta with every token gives the
    output of one delta per token -- text, tokens and logprobs cut after the token that completed
    the stop string, cumulative_logprob the engine-order sum of the kept ones -- for a stop string
    at every place, with the last token the engine's EOS or not, and the stop string kept or not."""
    from rlserve.engine import core_protocol as proto

    t = build_tokenizer()
    ids = t.encode("ab STOP 世界 cd", add_special_tokens=False) + ([t.eos_token_id] if engine_stop else [])
    lps = [-0.1 * (k + 1) - 1e-9 * k for k in range(len(ids))]
    top = [{i: lp, 3: -9.0} for i, lp in zip(ids, lps)]
    text = t.decode(ids, skip_special_tokens=True)
    reason = "stop" if engine_stop else "length"

    def deltas(sizes):
        out, k = [], 0
        for n, size in enumerate(sizes):
            last = k + size >= len(ids)
            out.append(proto.RequestDelta("r", [proto.SampleDelta(0, ids[k:k + size], lps[k:k + size], top[k:k + size],
                                                                  reason if last else None, None)],
                                          last, ["v"], 1.0, proto.RequestStart([5, 6]) if n == 0 else None))
            k += size
        return out

    for a in range(len(text)):
        for include in (False, True):
            p = SamplingParams(stop=[text[a:a + 3]], include_stop_str_in_output=include, logprobs=1, max_tokens=99)
            one, texts = _final(deltas([1] * len(ids)), p, t)
            for sizes in ([len(ids)], [2] * len(ids), [3, len(ids)]):
                got, _ = _final(deltas(sizes), p, t)
                assert got == one, (a, include, sizes)
            n = len(one[1])
            assert one[1] == ids[:n] and one[3] == top[:n]
            cum = 0.0
            for lp in lps[:n]:
                cum += lp
            assert one[2] == cum
            if one[4] == "stop" and one[5] == text[a:a + 3]:
                assert one[0] == text[:text.index(text[a:a + 3]) + (3 if include else 0)]
                assert text[a:a + 3] in t.decode(ids[:n]) and (n == 1 or text[a:a + 3] not in t.decode(ids[:n - 1]))
            else:
                assert one[0] == text and one[4] == reason
