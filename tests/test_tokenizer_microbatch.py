"""The tokenizer threads' micro-batch (:meth:`TokenizerThreads.encode_many`, issue 37's p99 time to
the first token): the texts of every request waiting for the short-text thread are encoded by one
batched call of a fast tokenizer (in parallel on the machine's cores), with the same ids as one
``encode`` per text; a text the tokenizer refuses fails only its own request; a tokenizer that is
not a fast one encodes text by text; the completion routes' prompts go through it."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from rlserve.server.tokenizer_threads import TokenizerThreads
from tests.tiny_models import build_tokenizer
from tests.transfer_harness import InProcessServer


@pytest.fixture(scope="module")
def srv(tiny_model):
    path = tiny_model("llama")
    with InProcessServer(path) as s:
        s.model_path = path
        yield s


class _Spy:
    """A tokenizer that records its calls (``calls``: ("batch", n texts) / ("one", 1)) and raises
    for any text containing ``BAD``, batched or not."""

    is_fast = True

    def __init__(self, tok):
        self.tok = tok
        self.calls = []

    def __call__(self, texts, add_special_tokens=True):
        self.calls.append(("batch", len(texts)))
        if any("BAD" in t for t in texts):
            raise ValueError("a bad text in the batch")
        return self.tok(texts, add_special_tokens=add_special_tokens)

    def encode(self, text, add_special_tokens=True):
        self.calls.append(("one", 1))
        if "BAD" in text:
            raise ValueError("bad text")
        return self.tok.encode(text, add_special_tokens=add_special_tokens)


async def _burst(tt: TokenizerThreads, requests: list[list[str]], flags: list[bool]):
    """Run ``encode_many`` for each request while the short-text thread is held, so that all of
    them wait there together (no timing: the thread is released once every one is queued)."""
    gate = threading.Event()
    held = asyncio.ensure_future(tt.run(gate.wait))  # the short-text thread is busy until the gate opens
    tasks = [asyncio.ensure_future(tt.encode_many(texts, flag)) for texts, flag in zip(requests, flags)]
    while len(tt._batch) < len(requests):
        await asyncio.sleep(0)
    gate.set()
    await held
    return await asyncio.gather(*tasks, return_exceptions=True)


def test_waiting_requests_are_encoded_in_one_batch_with_the_same_ids():
    tok = build_tokenizer()
    tt = TokenizerThreads(tok)
    spy = tt._copies[False] = _Spy(build_tokenizer())  # the short-text thread's own tokenizer
    tt.batch_texts = 100
    requests = [[f"hello world {i} " * (i + 1)] for i in range(20)] + [["ab cd", "é😀 x\n\n"], ["a" * 3000]]
    flags = [i % 2 == 0 for i in range(len(requests))]
    got = asyncio.run(_burst(tt, requests, flags))
    want = [[tok.encode(t, add_special_tokens=f) for t in texts] for texts, f in zip(requests, flags)]
    assert got == want
    # one call per add_special_tokens value for all 22 requests' 23 texts, no text-by-text encode
    assert sorted(spy.calls) == [("batch", 11), ("batch", 12)], spy.calls
    assert tt._batch == [] and not tt._batch_queued


def test_batches_hold_whole_requests_up_to_batch_texts():
    """At most ``batch_texts`` texts a call (twice the cores by default), whole requests only:
    one with more texts than that goes alone; the waiting order is kept."""
    from rlserve.server.tokenizer_threads import _cores

    tok = build_tokenizer()
    tt = TokenizerThreads(tok)
    assert tt.batch_texts == 2 * _cores() >= 2
    spy = tt._copies[False] = _Spy(build_tokenizer())
    tt.batch_texts = 4
    requests = [[f"t{i}"] for i in range(5)] + [["x", "y", "z"], [f"u{i}" for i in range(5)], ["last"]]
    got = asyncio.run(_burst(tt, requests, [True] * len(requests)))
    assert got == [[tok.encode(t) for t in texts] for texts in requests]
    assert spy.calls == [("batch", 4), ("batch", 4), ("batch", 5), ("batch", 1)], spy.calls


def test_a_bad_text_fails_only_its_request():
    tt = TokenizerThreads(build_tokenizer())
    spy = tt._copies[False] = _Spy(build_tokenizer())
    tt.batch_texts = 100  # one batch whatever the machine's cores
    requests = [["one"], ["two BAD"], ["three", "four"]]
    got = asyncio.run(_burst(tt, requests, [True] * 3))
    tok = build_tokenizer()
    assert got[0] == [tok.encode("one")] and got[2] == [tok.encode("three"), tok.encode("four")]
    assert isinstance(got[1], ValueError) and str(got[1]) == "bad text"
    assert spy.calls[0] == ("batch", 4) and spy.calls[1:] == [("one", 1)] * 4  # the batch, then text by text
    # the thread goes on serving: a later request is encoded
    assert asyncio.run(tt.encode_many(["five"], True)) == [tok.encode("five")]


def test_a_tokenizer_that_is_not_fast_encodes_text_by_text():
    class Plain:
        def __init__(self):
            self.seen = []

        def encode(self, text, add_special_tokens=True):
            self.seen.append(text)
            return [len(text), int(add_special_tokens)]

    tt = TokenizerThreads(Plain())
    plain = tt._copies[False] = Plain()
    got = asyncio.run(_burst(tt, [["a", "bb"], ["ccc"]], [True, False]))
    assert got == [[[1, 1], [2, 1]], [[3, 0]]]
    assert sorted(plain.seen) == ["a", "bb", "ccc"]


def test_long_texts_go_to_the_long_text_thread(monkeypatch):
    from rlserve.server import tokenizer_threads

    monkeypatch.setattr(tokenizer_threads, "LONG_TEXT_CHARS", 100)
    tok = build_tokenizer()
    tt = TokenizerThreads(tok)
    names = []
    real = tt._encode_each

    def spy(texts, flag):
        names.append(threading.current_thread().name.rsplit("_", 1)[0])
        return real(texts, flag)

    tt._encode_each = spy
    text = "ab " * 50
    assert asyncio.run(tt.encode_many([text], True)) == [tok.encode(text)]
    assert names == ["rlserve-tokenizer-long"]


def test_completions_burst_prompt_tokens(srv):
    """``n`` concurrent text completions (a burst, as a benchmark's first wave) each get their own
    prompt's ids: the usage's prompt_tokens and the echoed ids are the tokenizer's for that
    prompt."""
    n = 24
    tok = build_tokenizer()
    prompts = [f"hello {'world ' * (i + 1)}{i}" for i in range(n)]

    async def go():
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
            return await asyncio.gather(*[c.post("/v1/completions", json={
                "model": srv.model_path, "prompt": p, "max_tokens": 1, "return_token_ids": True}) for p in prompts])

    rs = asyncio.run(go())
    assert [r.status_code for r in rs] == [200] * n, [r.text for r in rs if r.status_code != 200][:2]
    for p, r in zip(prompts, rs):
        body = r.json()
        want = tok.encode(p)
        assert body["usage"]["prompt_tokens"] == len(want)
        assert body["choices"][0]["prompt_token_ids"] == want


def test_a_thread_without_a_tokenizer_fails_its_requests_instead_of_hanging():
    """The short-text thread makes its own copy of the tokenizer on its first call; a tokenizer
    that cannot be copied failed that call outside the per-batch error handling, so the queued
    requests (and every later one: the batch stayed marked as queued) waited for ever. Now each
    gets the copy's error, and a later request too (5 s only catches a hang)."""

    class NoCopy:
        is_fast = False

        def encode(self, text, add_special_tokens=True):
            return [len(text)]

        def __deepcopy__(self, memo):
            raise TypeError("this tokenizer cannot be copied")

    async def main():
        tt = TokenizerThreads(NoCopy())
        got = await asyncio.wait_for(asyncio.gather(tt.encode_many(["a"], True), tt.encode_many(["bb"], True),
                                                    return_exceptions=True), 5)
        later = await asyncio.wait_for(asyncio.gather(tt.encode_many(["ccc"], True), return_exceptions=True), 5)
        return got + later

    got = asyncio.run(main())
    assert [type(e) for e in got] == [TypeError] * 3, got
    assert all(str(e) == "this tokenizer cannot be copied" for e in got)


def _tokenizer_threads(exclude=()) -> list:
    return [t for t in threading.enumerate() if t.name.startswith("rlserve-tokenizer") and t not in exclude]


def test_close_joins_both_threads_and_refuses_later_work(monkeypatch):
    from rlserve.server import tokenizer_threads

    monkeypatch.setattr(tokenizer_threads, "LONG_TEXT_CHARS", 100)
    before = _tokenizer_threads()
    tok = build_tokenizer()
    tt = TokenizerThreads(tok)
    assert asyncio.run(tt.encode_many(["ab", "ab " * 50], True)) == [tok.encode("ab"), tok.encode("ab " * 50)]
    assert asyncio.run(tt.encode_many(["cd"], False)) == [tok.encode("cd", add_special_tokens=False)]
    assert sorted(t.name.rsplit("_", 1)[0] for t in _tokenizer_threads(before)) == \
        ["rlserve-tokenizer", "rlserve-tokenizer-long"]
    tt.close()
    assert _tokenizer_threads(before) == []  # joined: shutdown(wait=True)
    with pytest.raises(RuntimeError, match="stopping"):
        asyncio.run(tt.encode_many(["ab"], True))
    with pytest.raises(RuntimeError, match="stopping"):
        asyncio.run(tt.run(len, "x"))


def test_server_stop_ends_its_tokenizer_threads(tiny_model, monkeypatch):
    """A server's stop (``ServerState.close``, as ``rlserve serve``'s) ends its two tokenizer
    threads; they used to outlive it (two threads per server started in the process)."""
    from rlserve.server import tokenizer_threads

    monkeypatch.setattr(tokenizer_threads, "LONG_TEXT_CHARS", 100)
    before = _tokenizer_threads()
    with InProcessServer(tiny_model("llama")) as s:
        for prompt in ("hello", "hello " * 40):  # the short-text thread, then the long-text one
            r = httpx.post(s.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=60)
            assert r.status_code == 200, r.text
        assert len(_tokenizer_threads(before)) == 2
    assert _tokenizer_threads(before) == []


def test_no_transformers_warning_for_a_text_longer_than_model_max_length():
    """transformers warns once per tokenizer when a text encodes to more than its ``model_max_length``
    ("... will result in indexing errors"); the server bounds prompts by max_model_len itself, so its
    tokenizer threads mark that warning as given: the text encodes to the same ids and nothing is logged
    (the handler sits on transformers' own logger, which does not propagate to the root)."""
    import copy
    import logging

    tok = copy.deepcopy(build_tokenizer())  # (build_tokenizer's is shared by the whole test run)
    tok.model_max_length = 8
    tok.deprecation_warnings.clear()
    text = "hello world " * 20
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    lg = logging.getLogger("transformers")
    level = lg.level  # a server started earlier in this process may have set transformers' verbosity to errors
    lg.setLevel(logging.WARNING)
    lg.addHandler(handler)
    try:
        threads = TokenizerThreads(tok)
        try:
            ids = asyncio.run(threads.encode_many([text], True))[0]
        finally:
            threads.close()
        direct = tok.encode(text)  # the tokenizer is marked: no warning here either
    finally:
        lg.removeHandler(handler)
    assert ids == list(direct) and len(ids) > 8
    assert not [r for r in records if "longer than the specified maximum" in r.getMessage()], records
    # the unmarked tokenizer does warn (the check above can fail)
    fresh, records2 = copy.deepcopy(build_tokenizer()), []
    fresh.model_max_length = 8
    fresh.deprecation_warnings.clear()  # (the shared one may have been given to tokenizer threads before)
    h2 = logging.Handler()
    h2.emit = records2.append
    lg.addHandler(h2)
    try:
        fresh.encode(text)
    finally:
        lg.removeHandler(h2)
        lg.setLevel(level)
    assert [r for r in records2 if "longer than the specified maximum" in r.getMessage()], records2
