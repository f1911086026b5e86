"""Unfinished streamed outputs carry O(1) read-only views of their samples' token and logprob lists
(:mod:`rlserve.engine.prefix_view`, issue 37): a view keeps what it showed while the sample grows,
behaves as a list where rlserve's routes read it, and a finished output (or any output a caller of
``AsyncEngine.generate`` outside the routes gets) holds plain lists."""

from __future__ import annotations

import asyncio

import pytest

from rlserve.engine import core_protocol as proto
from rlserve.engine.front.output_processor import OutputProcessor
from rlserve.engine.outputs import CompletionOutput, RequestOutput
from rlserve.engine.prefix_view import PrefixView, plain_lists
from rlserve.engine.sampling_params import SamplingParams

PROMPT = [5, 6, 7]


def test_a_view_reads_as_the_first_n_items_of_its_list():
    items = [10, 11, 12, 13, 14]
    v = PrefixView(items, 4)
    items.append(15)  # grows after the view was made: the view still shows the first 4
    want = [10, 11, 12, 13]
    assert len(v) == 4 and list(v) == want and v.tolist() == want and repr(v) == repr(want)
    assert v == want and want == v and v != [10, 11, 12, 13, 14] and v != [10, 11, 12] and v != (10, 11, 12, 13)
    assert v == PrefixView([10, 11, 12, 13, 99], 4) and v != PrefixView(items, 5)
    for s in (slice(1, None), slice(None, 2), slice(-2, None), slice(2, 100), slice(3, 1), slice(None, None, -1),
              slice(1, None, 2), slice(-100, -1)):
        got = v[s]
        assert type(got) is list and got == want[s], s
    assert (v[0], v[3], v[-1], v[-4]) == (10, 13, 13, 10)
    for bad in (4, 5, -5):
        with pytest.raises(IndexError):
            v[bad]
    assert bool(v) and not PrefixView(items, 0) and PrefixView(items, 0)[0:] == []
    with pytest.raises(TypeError):
        hash(v)


def _req(params):
    from types import SimpleNamespace

    return SimpleNamespace(params=params, stream=True, prompt=PROMPT, arrival_time=1.0)


def _step(toks, finished=False, reason=None, start=False):
    lps = [-0.25 * t for t in toks]
    top = [{t: lp} for t, lp in zip(toks, lps)]
    return proto.RequestDelta("r", [proto.SampleDelta(0, toks, lps, top, reason, None)], finished, ["v1"], 2.0,
                              proto.RequestStart(PROMPT) if start else None)


def test_an_unfinished_outputs_view_does_not_change_when_the_sample_grows():
    proc = OutputProcessor(None)
    reqs = {"r": _req(SamplingParams(max_tokens=50, logprobs=0))}
    (first,), *_ = proc.process([_step([3, 4], start=True)], reqs)
    (second,), *_ = proc.process([_step([5])], reqs)
    c1, c2 = first.outputs[0], second.outputs[0]
    assert type(c1.token_ids) is PrefixView and type(c1.logprobs) is PrefixView
    assert c1.token_ids == [3, 4] and c1.logprobs == [{3: -0.75}, {4: -1.0}]  # as before the second step
    assert c2.token_ids == [3, 4, 5] and c2.logprobs[2:] == [{5: -1.25}] and c2.token_ids[2:] == [5]
    (last,), *_ = proc.process([_step([6], finished=True, reason="length")], reqs)
    c3 = last.outputs[0]
    assert last.finished and type(c3.token_ids) is list and type(c3.logprobs) is list  # the final: lists
    assert c3.token_ids == [3, 4, 5, 6] and c3.logprobs == [{3: -0.75}, {4: -1.0}, {5: -1.25}, {6: -1.5}]
    assert c1.token_ids == [3, 4] and c2.token_ids == [3, 4, 5]  # earlier outputs unchanged
    assert c3.cumulative_logprob == -0.75 - 1.0 - 1.25 - 1.5  # (exact: quarters add exactly in binary)


def test_plain_lists_replaces_views_in_place():
    items, lps = [1, 2, 3], [{1: -0.5}, {2: -0.25}, {3: -1.0}]
    out = RequestOutput("r", None, PROMPT, None, [CompletionOutput(0, "", PrefixView(items, 2), None,
                                                                   PrefixView(lps, 2)),
                                                  CompletionOutput(1, "", [9], None, None)], False)
    assert plain_lists(out) is out
    a, b = out.outputs
    assert type(a.token_ids) is list and a.token_ids == [1, 2] and a.logprobs == [{1: -0.5}, {2: -0.25}]
    assert type(a.logprobs) is list and b.token_ids == [9] and b.logprobs is None


def test_async_engine_callers_get_lists_and_rlserves_routes_get_views(tiny_model):
    """``AsyncEngine.generate`` (process mode, a streamed request): every output holds lists, unless
    ``views=True`` (rlserve's routes), where only the final one does; the tokens are the same."""
    from rlserve.config import EngineConfig
    from rlserve.engine.front.async_engine import AsyncEngine

    aeng = AsyncEngine(EngineConfig(model=tiny_model("llama"), device="cpu", dtype="float32", max_model_len=64),
                       engine_mode="process")
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)

    async def run(views):
        return [o async for o in aeng.generate(PROMPT, sp, stream=True, views=views)]

    try:
        plain = asyncio.run(asyncio.wait_for(run(False), 120.0))
        viewed = asyncio.run(asyncio.wait_for(run(True), 120.0))
    finally:
        aeng.shutdown()
    assert all(type(c.token_ids) is list and type(c.logprobs) is list for o in plain for c in o.outputs)
    assert viewed[-1].finished and type(viewed[-1].outputs[0].token_ids) is list
    # (how many unfinished outputs come depends on the machine's speed: a slow consumer gets fewer)
    assert all(type(o.outputs[0].token_ids) is PrefixView for o in viewed[:-1])
    final = viewed[-1].outputs[0].token_ids
    assert plain[-1].outputs[0].token_ids == final and len(final) == 12
    for o in viewed[:-1]:  # each a prefix of the final tokens
        c = o.outputs[0]
        assert c.token_ids == final[:len(c.token_ids)] and len(c.logprobs) == len(c.token_ids)


@pytest.mark.parametrize("chat", [False, True])
def test_streams_read_views_as_they_read_lists(monkeypatch, chat):
    """The streamed routes' encoders give the same bytes for outputs holding views as for the same outputs
    holding lists (logprobs with their token context, return_token_ids, a version change mid-stream)."""
    import copy

    from rlserve.server import stream_chunks
    from tests import test_sse_templates as sse

    monkeypatch.setattr(stream_chunks, "system_fingerprint", lambda state: "fp-test")
    tok = sse.build_tokenizer()
    outs = sse._outputs(tok, sse._ids(tok, "Hello wé 世界 ok, ünï") + [0, 1], n=2, logprobs=True, versions=("v1", "v2"))
    assert any(type(c.token_ids) is PrefixView for o in outs for c in o.outputs)
    listed = copy.deepcopy(outs)
    for o in listed:
        plain_lists(o)
    assert not any(type(c.token_ids) is PrefixView or type(c.logprobs) is PrefixView for o in listed for c in o.outputs)
    if chat:
        body = {"logprobs": True, "top_logprobs": 2, "return_token_ids": True, "n": 2}
        got, want = (b"".join(sse._chat(sse._State(tok), body, x)) for x in (outs, listed))
    else:
        body = {"logprobs": 2, "return_token_ids": True, "n": 2}
        got, want = (b"".join(sse._completions(sse._State(tok), body, [x])) for x in (outs, listed))
    assert got == want and b'"top_logprobs"' in got and b'"token_ids":[' in got
