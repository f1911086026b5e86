"""Overlapped decode (``rlserve.engine.core.overlap``) gives the same results as the plain loop.

On CPU (the logic: placeholders, device-side input ids, wasted rows of sequences that stop,
length limits, preemption, aborts between steps); the speed-up needs a GPU
(``benchmarks/throughput.py`` with ``RLSERVE_ASYNC_SCHEDULING=1``). Greedy and seeded rows are
compared: unseeded rows share one generator whose draws depend on the batch's rows.
"""

from __future__ import annotations

import pytest

from rlserve import LLM, SamplingParams

PROMPTS = ["The capital of France is", "Hello world! Hello there", "Once upon a time", "def main():",
           "The quick brown fox", "I am fine"]


def _params():
    # EOS not ignored (sequences stop at different steps), mixed lengths, greedy and seeded rows
    return [SamplingParams(temperature=0, max_tokens=6 + 3 * i, logprobs=1) if i % 2 else
            SamplingParams(temperature=0.9, seed=100 + i, max_tokens=5 + 4 * i, stop=["e w"])
            for i in range(len(PROMPTS))]


def _run(path, overlap, **kw):
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, extra={"async_scheduling": overlap}, **kw)
    assert (llm.engine._overlap is not None) == overlap
    return llm, llm.generate(PROMPTS, _params())


def _same(a, b):
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].finish_reason == y.outputs[0].finish_reason
        assert x.outputs[0].text == y.outputs[0].text
        cx, cy = x.outputs[0].cumulative_logprob, y.outputs[0].cumulative_logprob
        assert (cx is None) == (cy is None) == (x.outputs[0].logprobs is None)  # None: no logprobs asked
        assert cx is None or abs(cx - cy) < 1e-4
        assert -1 not in x.outputs[0].token_ids


def test_overlap_equals_plain_loop(tiny_model):
    path = tiny_model("qwen3")
    _, ref = _run(path, False)
    llm, got = _run(path, True)
    _same(got, ref)
    assert llm.engine._overlap.inflight is None and not llm.engine.requests
    assert llm.engine.block_manager.usage() == 0  # every block came back


def test_overlap_with_preemption(tiny_model):
    path = tiny_model("llama")
    kw = dict(num_kv_blocks=14, max_model_len=56, enable_prefix_caching=False)  # 6 sequences of up to ~10 blocks: preemptions
    llm0, ref = _run(path, False, **kw)
    llm1, got = _run(path, True, **kw)
    assert llm1.engine.scheduler.num_preemptions > 0
    _same(got, ref)


def abort_then_finish(eng, rid) -> dict:
    """Abort ``rid`` (its output says so, without a placeholder), then step to the end; the other
    requests' final outputs by request id."""
    (out,) = eng.abort_request(rid)
    assert out.outputs[0].finish_reason == "abort" and -1 not in out.outputs[0].token_ids
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    return done


def test_abort_between_overlapped_steps(tiny_model):
    path = tiny_model("llama")
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, extra={"async_scheduling": True})
    eng = llm.engine
    for i, p in enumerate(PROMPTS[:3]):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for _ in range(4):
        eng.step()
    assert eng._overlap.inflight is not None  # a step is in flight between calls
    done = abort_then_finish(eng, "r1")
    assert sorted(done) == ["r0", "r2"]
    ref = LLM(path, dtype="float32", device="cpu", block_size=4).generate(
        [PROMPTS[0], PROMPTS[2]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert [done["r0"].outputs[0].token_ids, done["r2"].outputs[0].token_ids] == [r.outputs[0].token_ids for r in ref]


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("limit", [0, 1])
def test_overlap_prefill_steps_and_admissions(tiny_model, limit, chunked):
    # prompts prefilled over several steps (8 tokens per step at most; with chunked prefill a
    # longer prompt in chunks, a chunk step launched while the previous chunk is in flight) and,
    # with 3 sequences at most, admitted while others decode: prefill steps are launched before
    # the step in flight is read, and every token equals the plain loop's; limit:
    # max_consecutive_prefill_steps
    path = tiny_model("qwen3")
    kw = dict(max_num_batched_tokens=8, max_num_seqs=3, max_consecutive_prefill_steps=limit,
              enable_chunked_prefill=chunked)
    _, ref = _run(path, False, **kw)
    llm, got = _run(path, True, **kw)
    _same(got, ref)
    assert not llm.engine.requests and llm.engine.block_manager.usage() == 0
    if chunked:  # the schedule below is the one of whole prompts
        return

    eng = llm.engine
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"p{i}", p, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    eng.step()
    if limit == 1:
        # the first prefill was read; a decode step of its sequence is on its way (no prefill
        # step follows a prefill step while sequences run)
        assert eng._overlap.inflight is not None and not eng._overlap.inflight.is_prefill
        eng.step()
    # the (next) prefill is already on its way: launched before the step in flight was read
    assert eng._overlap.inflight is not None and eng._overlap.inflight.is_prefill
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.block_manager.usage() == 0


def test_async_scheduling_decision(monkeypatch):
    # EngineConfig.async_scheduling wins, then extra["async_scheduling"], then the environment,
    # else on exactly for a CUDA executor; never for one without device-side input ids
    from types import SimpleNamespace

    from rlserve.config import EngineConfig
    from rlserve.engine.core.engine_setup import want_async_scheduling

    cuda = SimpleNamespace(device="cuda:0", supports_device_input_ids=True)
    cpu = SimpleNamespace(device="cpu", supports_device_input_ids=True)
    tp = SimpleNamespace(device="cuda:0")  # the multi-process TP executor
    cfg = lambda **kw: EngineConfig(model="m", **kw)  # noqa: E731
    monkeypatch.delenv("RLSERVE_ASYNC_SCHEDULING", raising=False)
    assert want_async_scheduling(cfg(), cuda) and not want_async_scheduling(cfg(), cpu)
    assert not want_async_scheduling(cfg(), tp) and not want_async_scheduling(cfg(async_scheduling=True), tp)
    assert not want_async_scheduling(cfg(async_scheduling=False), cuda)
    assert want_async_scheduling(cfg(async_scheduling=True), cpu)
    assert want_async_scheduling(cfg(extra={"async_scheduling": True}), cpu)
    monkeypatch.setenv("RLSERVE_ASYNC_SCHEDULING", "0")
    assert not want_async_scheduling(cfg(), cuda)
    assert want_async_scheduling(cfg(extra={"async_scheduling": True}), cuda)
    assert want_async_scheduling(cfg(async_scheduling=True), cuda)
    monkeypatch.setenv("RLSERVE_ASYNC_SCHEDULING", "1")
    assert want_async_scheduling(cfg(), cpu) and not want_async_scheduling(cfg(async_scheduling=False), cpu)


def test_outputs_left_by_a_drain_keep_the_engine_busy(tiny_model):
    # a step in flight finished by a drain (here inside reset_prefix_cache) may end the last
    # request: its output waits for the next step(), and until then the engine is not idle,
    # so a driver that steps while has_unfinished_requests() does not lose it
    path = tiny_model("llama")
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, extra={"async_scheduling": True})
    eng = llm.engine
    eng.add_request("only", PROMPTS[0], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    eng.step()  # the prefill's token is read; the last decode step is in flight
    assert eng._overlap.inflight is not None
    eng.reset_prefix_cache()  # drains: the request ends, its output is pending
    assert not eng.requests and eng.has_unfinished_requests()
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert [o.request_id for o in outs] == ["only"] and outs[0].finished
    assert len(outs[0].outputs[0].token_ids) == 2


def test_abort_of_a_request_the_drain_finished(tiny_model):
    # the step in flight ends the request while abort_request drains it: the abort answers with
    # the real final output and leaves nothing pending (a sleep right after sees no requests)
    path = tiny_model("llama")
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, extra={"async_scheduling": True})
    eng = llm.engine
    eng.add_request("only", PROMPTS[0], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    eng.step()
    assert eng._overlap.inflight is not None
    (out,) = eng.abort_request("only")
    assert out.finished and out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 2
    assert not eng.has_unfinished_requests() and eng.step() == []
