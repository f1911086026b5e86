"""Detokenization in the API process (issue 17): the engine-core process sends token ids only and
:class:`~rlserve.engine.front.output_processor.OutputProcessor` makes the text, matches stop strings
and stops samples in the core. Results must equal the engine's own detokenizer (the offline
``LLM``): stop strings spanning tokens, multi-byte characters split across tokens, n > 1,
logprobs, min_tokens, include_stop_str_in_output, a stop string completed by the last allowed
token, streamed and not. The output is forced through a random tiny model with a regex
(structured outputs), so the text is known."""

from __future__ import annotations

import asyncio

import pytest

from rlserve.engine import core_protocol as proto
from rlserve.engine.front.output_processor import OutputProcessor
from rlserve.engine.sampling_params import SamplingParams, StructuredOutputsParams

T = 120.0  # bound on every wait (seconds)
TEXT = "héllo 世界 🙂 the end. STOP now"  # é, 世, 界, 🙂: several byte tokens each
FORCE = StructuredOutputsParams(regex=TEXT.replace(".", r"\."))
PROMPT = [5, 6, 7]
KW = dict(device="cpu", dtype="float32", max_model_len=128)


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 60, "structured_outputs": FORCE, **kw})


CASES = {
    "plain_multibyte_logprobs": dict(logprobs=2),
    "stop_spanning_multibyte_tokens": dict(stop=["界 🙂"]),
    "stop_included": dict(stop=["d. S"], include_stop_str_in_output=True),
    "earliest_of_two_stops": dict(stop=["STOP", "end"], logprobs=0),
    "n3_sampled_stop": dict(n=3, temperature=1.0, seed=3, stop=["e end"], logprobs=1),
    "min_tokens_defers_stop": dict(stop=["llo"], min_tokens=8),
    "eos_text_with_include_stop": dict(include_stop_str_in_output=True, skip_special_tokens=False),
    "stop_in_eos_text_keeps_eos_reason": dict(stop=["im_end"], include_stop_str_in_output=True,
                                              skip_special_tokens=False),
}


@pytest.fixture(scope="module")
def engines(tiny_model):
    from rlserve import LLM
    from rlserve.config import EngineConfig
    from rlserve.engine.front.async_engine import AsyncEngine

    model = tiny_model("llama")
    offline = LLM(model, **KW)
    aeng = AsyncEngine(EngineConfig(model=model, **KW), engine_mode="process")
    try:
        yield offline, aeng
    finally:
        aeng.shutdown()


def _through_core(aeng, sp: SamplingParams, stream: bool) -> tuple:
    """The final output and every intermediate one (streamed) of one request."""
    async def run():
        seen = []
        async for o in aeng.generate(PROMPT, sp, stream=stream):
            seen.append(o)
        return seen
    seen = asyncio.run(asyncio.wait_for(run(), T))
    return seen[-1], seen


def _same(got, want) -> None:
    assert len(got.outputs) == len(want.outputs)
    for g, w in zip(sorted(got.outputs, key=lambda c: c.index), want.outputs):
        assert g.token_ids == w.token_ids
        assert g.text == w.text
        assert (g.finish_reason, g.stop_reason) == (w.finish_reason, w.stop_reason)
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-4)
        if w.logprobs is None:
            assert g.logprobs is None
        else:
            assert len(g.logprobs) == len(w.logprobs)
            for a, b in zip(g.logprobs, w.logprobs):
                assert set(a) == set(b) and all(a[k] == pytest.approx(b[k], abs=1e-4) for k in b)
    assert got.prompt_token_ids == want.prompt_token_ids and got.finished


@pytest.mark.parametrize("case", list(CASES))
def test_process_mode_text_equals_the_engines_own(engines, case):
    offline, aeng = engines
    sp = _params(**CASES[case])
    (want,) = offline.generate([PROMPT], sp)
    for stream in (False, True):
        got, seen = _through_core(aeng, sp, stream)
        _same(got, want)
        if not stream:
            assert len(seen) == 1
            continue
        for i in range(len(want.outputs)):
            texts = [o.outputs[i].text for o in seen]
            for a, b in zip(texts, texts[1:]):
                assert b.startswith(a)  # streamed text is never taken back
            assert all("\ufffd" not in t for t in texts)  # no half characters on the way
            if sp.stop and not sp.include_stop_str_in_output and not sp.min_tokens:
                assert all(not any(s in t for s in sp.stop) for t in texts)
    if case == "stop_spanning_multibyte_tokens":
        assert want.outputs[0].text == "héllo 世" and want.outputs[0].stop_reason == "界 🙂"
    if case == "n3_sampled_stop":  # the samples tokenized the text differently: stops at different tokens
        assert len({len(c.token_ids) for c in want.outputs}) > 1
        assert all(c.text == "héllo 世界 🙂 th" for c in want.outputs)
    if case == "stop_in_eos_text_keeps_eos_reason":
        assert want.outputs[0].text.endswith("now<|im_end") and want.outputs[0].stop_reason is None


def test_stop_string_completed_by_the_last_allowed_token(engines):
    """``max_tokens`` reached by the token that completes a stop string: "stop", not "length"."""
    offline, aeng = engines
    (full,) = offline.generate([PROMPT], _params())
    tok = offline.tokenizer
    ids = full.outputs[0].token_ids
    k = next(k for k in range(1, len(ids) + 1) if "end" in tok.decode(ids[:k]))
    sp = _params(stop=["end"], max_tokens=k)
    (want,) = offline.generate([PROMPT], sp)
    assert want.outputs[0].finish_reason == "stop" and want.outputs[0].stop_reason == "end"
    assert len(want.outputs[0].token_ids) == k
    for stream in (False, True):
        _same(_through_core(aeng, sp, stream)[0], want)


# ---- OutputProcessor alone: tokens past a stop string, per-request errors ------------------
class _Req:
    def __init__(self, params, stream=True, prompt=PROMPT):
        self.params, self.stream, self.prompt, self.arrival_time = params, stream, prompt, 1.0


def _delta(rid, toks, lps, finished=False, reason=None, start=True, index=0):
    return proto.RequestDelta(rid, [proto.SampleDelta(index, toks, lps, None, reason, None)], finished, ["v1"], 2.0,
                              proto.RequestStart(PROMPT) if start else None)


def test_version_marks_say_where_each_weight_version_starts():
    """Each delta is one step's tokens, produced by its weight_versions[-1]: a sample's version_marks record
    where each version's tokens start (session 22, FIX item 4: a stream chunk that holds tokens of two versions
    lists both), also when several steps' deltas reach the processor at once (one output built after them)."""
    proc = OutputProcessor(None)
    reqs = {"r": _Req(SamplingParams(max_tokens=50))}

    def step(toks, versions, start=False):
        return proto.RequestDelta("r", [proto.SampleDelta(0, toks, [0.0] * len(toks))], False, versions, 2.0,
                                  proto.RequestStart(PROMPT) if start else None)

    (out,), *_ = proc.process([step([5], ["0"], start=True), step([6], ["0"])], reqs)
    assert out.outputs[0].version_marks is None  # one version: its weight_version says it (no list built)
    # a consumer behind: three steps in one call, the update between the second and the third
    (out,), *_ = proc.process([step([7], ["0"]), step([8], ["0"]), step([9], ["0", "1"])], reqs)
    c = out.outputs[0]
    assert c.token_ids == [5, 6, 7, 8, 9] and c.version_marks == ((0, "0"), (4, "1"))
    assert out.weight_versions == ["0", "1"] and out.weight_version == "1"
    (same,), *_ = proc.process([step([10], ["1"])], reqs)
    assert same.outputs[0].version_marks is c.version_marks  # no new version: the same tuple, not a copy
    (out,), *_ = proc.process([step([11], ["0", "1", "2"])], reqs)
    assert out.outputs[0].version_marks == ((0, "0"), (4, "1"), (6, "2"))
    assert c.version_marks == ((0, "0"), (4, "1"))  # an earlier output's marks do not change under its reader


def test_progress_deltas_are_counted_as_they_come_and_keep_no_version_marks():
    """A request that is neither streamed nor has stop strings gets a delta every ``PROGRESS_EVERY_S`` (several
    steps' tokens: where a weight version starts inside it is unknown), not every step: its tokens are handed to
    ``count_tokens`` as each delta comes, before the outputs (none until its last), its prompt once; its
    version_marks stay None (only a per-step request's are exact). A streamed request's counts too."""
    counted = []
    proc = OutputProcessor(None, lambda gen, prompt: counted.append((gen, prompt)))
    reqs = {"plain": _Req(SamplingParams(max_tokens=50), stream=False), "s": _Req(SamplingParams(max_tokens=50))}

    def delta(rid, toks, versions, start=False, finished=False):
        return proto.RequestDelta(rid, [proto.SampleDelta(0, toks, [0.0] * len(toks), None,
                                                          "length" if finished else None)], finished, versions,
                                  2.0, proto.RequestStart(PROMPT) if start else None)

    assert proc.process([delta("plain", [5, 6, 7], ["0"], start=True)], reqs)[0] == []  # no output: not streamed
    assert counted == [(3, len(PROMPT))]
    assert proc.process([], reqs)[0] == [] and counted == [(3, len(PROMPT))]  # nothing new: no call
    (out,), *_ = proc.process([delta("plain", [8, 9], ["0", "1"]), delta("s", [4], ["1"], start=True)], reqs)
    assert out.request_id == "s" and counted[-1] == (3, len(PROMPT))
    (out,), *_ = proc.process([delta("plain", [10], ["0", "1"], finished=True)], reqs)
    c = out.outputs[0]
    assert c.token_ids == [5, 6, 7, 8, 9, 10] and c.version_marks is None and out.weight_versions == ["0", "1"]
    assert counted == [(3, len(PROMPT)), (3, len(PROMPT)), (1, 0)] and proc.take_counts() == (0, 0)


def test_tokens_sampled_past_a_stop_string_are_dropped():
    from tests.tiny_models import build_tokenizer

    tok = build_tokenizer()
    ids = tok.encode("ab STOP cd ef")
    stop_at = next(k for k in range(1, len(ids) + 1) if "STOP" in tok.decode(ids[:k]))
    proc = OutputProcessor(tok)
    reqs = {"r": _Req(SamplingParams(max_tokens=50, stop=["STOP"], logprobs=0), stream=False)}
    lps = [-0.5 * (i + 1) for i in range(len(ids))]
    # the core sampled every token before it heard of the stop: one delta with all of them
    outs, errors, stops, aborts = proc.process([_delta("r", ids, lps)], reqs)
    assert not errors and not stops and aborts == ["r"]  # finished here, the core still runs it
    assert proc.take_counts() == (stop_at, len(PROMPT))  # (vllm:generation_tokens_total: the kept tokens only)
    (out,) = outs
    c = out.outputs[0]
    assert out.finished and c.finish_reason == "stop" and c.stop_reason == "STOP"
    assert c.token_ids == ids[:stop_at] and c.text == "ab "
    assert c.cumulative_logprob == sum(lps[:stop_at])
    assert out.weight_versions == ["v1"] and out.first_token_time == 2.0 and len(proc) == 0
    # later deltas of the request (the core's own end) are dropped
    assert proc.process([_delta("r", [5], [-1.0], finished=True, reason="abort", start=False)], reqs)[0] == []


def test_n2_one_sample_stopped_here_is_stopped_in_the_core():
    from tests.tiny_models import build_tokenizer

    tok = build_tokenizer()
    stop_ids, other = tok.encode("x STOP"), tok.encode("hello")
    proc = OutputProcessor(tok)
    reqs = {"r": _Req(SamplingParams(n=2, max_tokens=50, stop=["STOP"]))}
    d = proto.RequestDelta("r", [proto.SampleDelta(0, stop_ids, [0.0] * len(stop_ids)),
                                 proto.SampleDelta(1, other, [0.0] * len(other))], False, ["0"], None,
                           proto.RequestStart(PROMPT))
    outs, errors, stops, aborts = proc.process([d], reqs)
    assert stops == [("r", [0])] and not aborts and not errors
    assert not outs[0].finished and outs[0].outputs[0].finish_reason == "stop" and outs[0].outputs[1].text == "hello"
    # sample 0's extra tokens are ignored; sample 1 ends in the core: the request ends
    d2 = proto.RequestDelta("r", [proto.SampleDelta(0, [5], [0.0]), proto.SampleDelta(1, [2], [0.0], None, "stop")],
                            True, ["0"])
    outs, errors, stops, aborts = proc.process([d2], reqs)
    assert outs[0].finished and outs[0].outputs[0].token_ids == stop_ids and not stops and not aborts
    # counted: both samples' kept tokens, the prompt once (with the first delta), not sample 0's dropped [5]
    assert proc.take_counts() == (len(stop_ids) + len(other) + 1, len(PROMPT))
    assert outs[0].outputs[1].finish_reason == "stop" and outs[0].outputs[1].text == "hello"


def test_a_request_whose_outputs_cannot_be_processed_fails_alone():
    from tests.tiny_models import build_tokenizer

    class Broken:
        """A tokenizer that cannot decode token 99 (the other tokens decode normally)."""

        def __init__(self, tok):
            self.tok = tok

        def decode(self, ids, **kw):
            if 99 in ids:
                raise ValueError("cannot decode token 99")
            return self.tok.decode(ids, **kw)

    proc = OutputProcessor(Broken(build_tokenizer()))
    reqs = {"bad": _Req(SamplingParams()), "good": _Req(SamplingParams())}
    outs, errors, stops, aborts = proc.process([_delta("bad", [99], [0.0]), _delta("good", [40, 41], [0.0, 0.0])],
                                               reqs)
    assert [o.request_id for o in outs] == ["good"] and outs[0].outputs[0].token_ids == [40, 41]
    ((rid, exc),) = errors
    assert rid == "bad" and "cannot decode token 99" in str(exc) and type(exc).__name__ == "EngineStepError"
    assert aborts == ["bad"] and len(proc) == 1


def test_output_fields_land_in_their_places():
    """``OutputProcessor._output`` builds its dataclasses positionally: every field where its name says."""
    import dataclasses
    from types import SimpleNamespace

    from rlserve.engine.front.output_processor import OutputProcessor
    from rlserve.engine.outputs import CompletionOutput, RequestOutput

    sample = SimpleNamespace(detok=SimpleNamespace(visible_text="txt"), token_ids=[7, 8], cumulative_logprob=-1.5,
                             logprobs=[{7: -1.0}, {8: -0.5}], finish_reason="stop", stop_reason="x",
                             routed=SimpleNamespace(result=lambda rows: ("routed", rows)), marks=((0, "v1"), (1, "v2")))
    st = SimpleNamespace(prompt="p", prompt_token_ids=[1, 2, 3], prompt_logprobs=[None, {2: -0.1}, {3: -0.2}],
                         prompt_logprob_ranks=[None, 1, 2], samples=[sample], arrival_time=10.0, routed_start=1)
    d = SimpleNamespace(weight_versions=["v1", "v2"], first_token_time=11.0, scheduled_time=10.5)
    out = OutputProcessor._output("rid", st, d, True)
    assert [f.name for f in dataclasses.fields(RequestOutput)] == [
        "request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs", "finished", "weight_version",
        "weight_versions", "prompt_logprob_ranks", "arrival_time", "first_token_time", "scheduled_time"]
    assert [f.name for f in dataclasses.fields(CompletionOutput)] == [
        "index", "text", "token_ids", "cumulative_logprob", "logprobs", "routed_experts", "finish_reason", "stop_reason",
        "version_marks"]
    assert (out.request_id, out.prompt, out.prompt_token_ids, out.prompt_logprobs, out.finished, out.weight_version,
            out.weight_versions, out.prompt_logprob_ranks, out.arrival_time, out.first_token_time,
            out.scheduled_time) == ("rid", "p", [1, 2, 3], st.prompt_logprobs, True, "v2", ["v1", "v2"], [None, 1, 2],
                                    10.0, 11.0, 10.5)
    (c,) = out.outputs
    assert (c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.routed_experts, c.finish_reason,
            c.stop_reason) == (0, "txt", [7, 8], -1.5, [{7: -1.0}, {8: -0.5}], ("routed", 3 - 1 + 2 - 1), "stop", "x")
    assert c.version_marks == ((0, "v1"), (1, "v2"))
    assert c.token_ids is not sample.token_ids and c.logprobs is not sample.logprobs  # snapshots
    assert c.version_marks is sample.marks  # a tuple (replaced, never changed, by the processor): shared
