"""IncrementalDetokenizer: streaming deltas, multi-byte characters, stop strings.

Uses a byte-level BPE tokenizer trained offline in the test (tokenizers library), with
few merges so that multi-byte characters are split across tokens.
"""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rlserve.engine.detokenizer import IncrementalDetokenizer

CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "stop here. STOP now! The end is near; done.",
]


@pytest.fixture(scope="module")
def tok():
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<eos>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    t.train_from_iterator(CORPUS * 5, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>", pad_token="<pad>")


TEXT = "héllo 世界 🙂 the end. STOP now"


def stream(tok, ids, prompt=(), **kw):
    d = IncrementalDetokenizer(tok, list(prompt), **kw)
    deltas, match = [], None
    for t in ids:
        match = d.add_tokens([t])
        deltas.append(d.take_delta())
        if match:
            break
    if not match:
        d.finish()
    deltas.append(d.take_delta())
    return d, deltas, match


def test_multibyte_split_across_tokens(tok):
    ids = tok.encode(TEXT)
    # The tokenizer really splits characters: some single tokens decode to U+FFFD.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    prompt = tok.encode("Say: ")
    d, deltas, match = stream(tok, ids, prompt)
    assert match is None
    assert "".join(deltas) == d.output_text == tok.decode(ids) == TEXT
    for x in deltas:
        assert "\ufffd" not in x
    # Every emitted prefix is a prefix of the final text (no retraction).
    acc = ""
    for x in deltas:
        acc += x
        assert TEXT.startswith(acc)


def test_special_tokens(tok):
    eos = tok.eos_token_id
    ids = tok.encode("the end") + [eos] + tok.encode(" 世")
    d, deltas, _ = stream(tok, ids)
    assert d.output_text == "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == "the end 世"
    d, deltas, _ = stream(tok, ids, skip_special_tokens=False)
    assert d.output_text == "".join(deltas) == tok.decode(ids, skip_special_tokens=False) == "the end<eos> 世"


def test_truncated_char_flushed_on_finish(tok):
    ids = tok.encode("ab 🙂")
    ids = ids[:-1]  # cut inside the emoji
    d, deltas, _ = stream(tok, ids)
    assert d.output_text == tok.decode(ids)
    assert d.output_text.endswith("\ufffd")
    assert "".join(deltas) == d.output_text
    assert all("\ufffd" not in x for x in deltas[:-1])


def test_stop_string_spanning_tokens(tok):
    ids = tok.encode(TEXT)
    # "end. ST" starts in one token and ends several tokens later.
    d, deltas, match = stream(tok, ids, stop=["end. ST"])
    assert match is not None and match.stop_str == "end. ST"
    assert d.output_text == "héllo 世界 🙂 the "
    assert "".join(deltas) == d.output_text
    # The stop string really spans several tokens.
    assert not any("end. ST" in tok.decode([i]) for i in ids)
    # The token that completed the match was the last one fed.
    assert tok.decode(ids[: len(d.token_ids)]).endswith("ST") or "end. ST" in tok.decode(ids[: len(d.token_ids)])
    assert "end. ST" not in tok.decode(ids[: len(d.token_ids) - 1])


def test_stop_string_include_in_output(tok):
    ids = tok.encode(TEXT)
    d, deltas, match = stream(tok, ids, stop=["世界"], include_stop_str_in_output=True)
    assert match.stop_str == "世界"
    assert d.output_text == "".join(deltas) == "héllo 世界"


def test_earliest_of_several_stop_strings_and_trailing_text_cut(tok):
    ids = tok.encode("the quick brown fox")
    d, deltas, match = stream(tok, ids, stop=["fox", "qu", "zzz"])
    assert match.stop_str == "qu"
    assert d.output_text == "the " == "".join(deltas)
    # Multiple tokens in one call: match reported with index; later tokens ignored.
    d = IncrementalDetokenizer(tok, [], stop=["brown"])
    m = d.add_tokens(ids)
    assert m.stop_str == "brown" and m.text_index == len("the quick ")
    assert "brown" in tok.decode(ids[: m.token_index + 1])
    assert "brown" not in tok.decode(ids[: m.token_index])
    assert d.output_text == "the quick " and d.take_delta() == "the quick "
    assert d.add_tokens(ids) is None  # ignored after a match


def test_holdback_released_when_no_match(tok):
    ids = tok.encode("end. STOP")
    d = IncrementalDetokenizer(tok, [], stop=["end!"])
    text = ""
    for t in ids:
        assert d.add_tokens([t]) is None
        text += d.take_delta()
        # Whatever is held back is a prefix of the stop string.
        held = d.output_text[len(text):]
        assert "end!".startswith(held)
    d.finish()
    text += d.take_delta()
    assert text == "end. STOP"


def test_stop_match_at_first_token_and_visible_text(tok):
    ids = tok.encode("hello world")
    d = IncrementalDetokenizer(tok, tok.encode("x"), stop=["world"])
    for t in ids[:-1]:
        d.add_tokens([t])
    # The tail "wor..." may be a stop start: it is in output_text but not visible yet.
    assert d.visible_text == d.output_text[: len(d.visible_text)]
    assert not d.visible_text.endswith("w")
    m = None
    for t in ids[len(ids) - 1 :]:
        m = d.add_tokens([t])
    assert m is not None and d.output_text == "hello " == d.visible_text


def _sentencepiece_style_tokenizer():
    """Llama-2-like: Metaspace pre-tokenizer, byte fallback, decoder strips one leading space."""
    from tokenizers import AddedToken

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(256):
        vocab[f"<0x{i:02X}>"] = len(vocab)
    for ch in "▁abcdefghijklmnopqrstuvwxyz.,!":
        vocab.setdefault(ch, len(vocab))
    t = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    t.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    t.add_special_tokens([AddedToken(s, special=True) for s in ("<unk>", "<s>", "</s>")])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_byte_fallback_metaspace_tokenizer():
    tok = _sentencepiece_style_tokenizer()
    text = "hello 世界 🙂 the fox"
    ids = tok.encode(text, add_special_tokens=False)
    assert "<0xE4>" in tok.convert_ids_to_tokens(ids)
    # Without prompt context (or only BOS): exactly tokenizer.decode.
    for prompt in ([], [tok.bos_token_id]):
        d, deltas, _ = stream(tok, ids, prompt)
        assert "".join(deltas) == d.output_text == tok.decode(ids) == text
        assert all("\ufffd" not in x for x in deltas)
    # After a prompt, the first token's space is kept (vLLM behaviour): prompt + text reads right.
    d, deltas, _ = stream(tok, ids, tok.encode("Say:", add_special_tokens=False))
    assert "".join(deltas) == d.output_text == " " + text


def test_tiny_model_tokenizer_with_chat_prompt():
    from tests.tiny_models import EOS_ID, build_tokenizer

    tok = build_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    out = tok.encode("The capital of France is Paris. ça va? 日本", add_special_tokens=False) + [EOS_ID]
    d, deltas, match = stream(tok, out, prompt_ids, stop=["Paris"], include_stop_str_in_output=True)
    assert match.stop_str == "Paris"
    assert d.output_text == "".join(deltas) == "The capital of France is Paris"
    d, deltas, match = stream(tok, out, prompt_ids)
    assert match is None
    assert d.output_text == "".join(deltas) == tok.decode(out, skip_special_tokens=True)
    assert d.output_text.endswith("日本")


def test_min_tokens_defers_stop_strings(tok):
    from rlserve.engine.sampling_params import SamplingParams

    ids = tok.encode("the end. the end. done")
    n_first_end = next(k for k in range(len(ids) + 1) if "end" in tok.decode(ids[:k]))
    p = SamplingParams(stop=["end"], min_tokens=n_first_end + 1, max_tokens=50)
    d, deltas, match = stream(tok, ids, **{"stop": p.stop, "min_tokens": p.min_tokens})
    assert match is not None and d.output_text == "the end. the " == "".join(deltas)
    d2 = IncrementalDetokenizer.from_params(tok, [], p)
    assert d2.min_tokens == p.min_tokens and d2.stop == ["end"]
    # Without min_tokens the first occurrence stops.
    d, _, match = stream(tok, ids, stop=["end"])
    assert d.output_text == "the "


@pytest.mark.parametrize("make", ["bytelevel", "metaspace"])
def test_ids_that_decode_to_nothing_leave_the_window(tok, make):
    """Ids the tokenizer does not know (a dummy-weight model's, beyond a small vocabulary) and
    skipped special tokens, among real ones: the text is ``tokenizer.decode`` exactly, multi-byte
    characters split around them included, and the decode window stays short (it grew by one id a
    step: every step decoded the whole run of them)."""
    t = tok if make == "bytelevel" else _sentencepiece_style_tokenizer()
    unknown = [len(t) + 1000 + k for k in range(40)]
    special = [t.eos_token_id]
    words = t.encode("héllo 世界 the fox", add_special_tokens=False)
    ids = unknown[:20] + words[:3] + special + unknown[20:] + words[3:] + special + unknown
    d, deltas, match = stream(t, ids, t.encode("Say:", add_special_tokens=False))
    want = t.decode(words, skip_special_tokens=True)
    assert match is None and "".join(deltas) == d.output_text
    assert d.output_text.strip() == want.strip() and "\ufffd" not in d.output_text
    # the window (ids decoded at every step) ends at the last text: before, it held the 41 after it
    window = d._ids[d._prefix_offset:]
    assert len(window) <= 4 and not set(unknown) & set(window), window


@pytest.mark.parametrize("make", ["bytelevel", "metaspace"])
def test_unknown_ids_cost_no_decoding_and_change_nothing(tok, make):
    """Issue 37: ids the Rust tokenizer does not know are dropped by its decode, so adding one
    decodes nothing (the old code decoded the window and the id alone: ~12 us a token, a third of
    the API process's event loop at 256 dummy-weight streams); the deltas, the final text and a
    stop string's match are those of the same stream without them, wherever they fall (inside a
    character split over tokens too)."""
    t = tok if make == "bytelevel" else _sentencepiece_style_tokenizer()
    words = t.encode("héllo 世界 🙂 the end. STOP now", add_special_tokens=False)
    unknown = len(t) + 5000
    mixed = []
    for k, w in enumerate(words):
        mixed += [w] + [unknown + k] * (k % 3)
    prompt = t.encode("Say:", add_special_tokens=False)
    for kw in ({}, {"stop": ["STOP"]}, {"stop": ["end"], "include_stop_str_in_output": True}):
        d0, deltas0, m0 = stream(t, words, prompt, **kw)
        d1, deltas1, m1 = stream(t, mixed, prompt, **kw)
        assert [x for x in deltas1 if x] == [x for x in deltas0 if x], kw
        assert d1.output_text == d0.output_text and (m0 is None) == (m1 is None), kw
        if m0 is not None:
            assert (m1.stop_str, m1.text_index) == (m0.stop_str, m0.text_index)
    d = IncrementalDetokenizer(t, prompt)
    calls = []
    real = d._decode
    d._decode = lambda ids: calls.append(list(ids)) or real(ids)
    assert d.add_tokens([unknown, unknown + 1]) is None and calls == [] and d.token_ids == [unknown, unknown + 1]
    d.add_tokens(words[:1])
    assert calls and all(unknown not in c for c in calls)
