"""The overlapped loop launches the decode step after a prefill step early (issue 37, session 18).

A decode step right after a prefill step of new prompts holds the running sequences (their last
token on the host) and the new ones (their first token on the device, in the prefill's sampler
output). ``rlserve.engine.core.overlap`` now launches it before the prefill's tokens are read,
the new rows' ids gathered on the device (``StepInput.input_ids_from``'s ``(tokens, rows, where)``).
``RLSERVE_OVERLAP_AFTER_PREFILL=0`` keeps the old rule (launched after the read), which the counts
below tell apart: ``OverlapScheduler.counts`` (launches, no timing). On CPU, float32: greedy tokens
equal Hugging Face's and the plain loop's, logprobs the plain loop's bit for bit (which are within
1e-4 of HF's, ``tests/test_engine.py``'s bound); seeded samples, stop strings, EOS, penalties,
structured output and aborts as the plain loop's.
"""

from __future__ import annotations

import pytest

from rlserve import LLM, SamplingParams
from rlserve.engine.sampling_params import StructuredOutputsParams
from tests.test_chunked_prefill import _greedy, _prompts, _tokens_lps
from tests.test_engine import hf_greedy
from tests.test_mixed_steps import _staggered
from tests.test_overlap import PROMPTS, _params, _same, abort_then_finish

KW = dict(dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=64, max_num_seqs=8,
          max_consecutive_prefill_steps=1)


def _llm(path, overlap, after_prefill, monkeypatch, **kw):
    monkeypatch.setenv("RLSERVE_OVERLAP_AFTER_PREFILL", "1" if after_prefill else "0")
    llm = LLM(path, extra={"async_scheduling": overlap}, **{**KW, **kw})
    assert (llm.engine._overlap is not None) == overlap
    if overlap:
        assert llm.engine._overlap.after_prefill == after_prefill
    return llm


@pytest.fixture(scope="module")
def path(tiny_model):
    return tiny_model("qwen3")


@pytest.mark.parametrize("mode", ["split", "chunked", "mixed"])
def test_decode_after_prefill_is_launched_early_and_tokens_equal(path, mode, monkeypatch):
    # one prompt arrives per step while the others decode (split steps: a prefill step, then a
    # decode step of the running sequences plus the new one; chunked: a prompt over several chunk
    # steps; mixed: --mixed-prefill-decode)
    kw = {"split": {}, "chunked": dict(enable_chunked_prefill=True, max_num_batched_tokens=12),
          "mixed": dict(mixed_prefill_decode=True, enable_chunked_prefill=True, max_num_batched_tokens=12)}[mode]
    prompts = _prompts(7, [9, 23, 5, 31, 14, 18])
    params = _greedy(8)
    want, want_lps = _tokens_lps(_staggered(_llm(path, False, True, monkeypatch, **kw), prompts, params)[0])
    res = {}
    for after_prefill in (False, True):
        llm = _llm(path, True, after_prefill, monkeypatch, **kw)
        outs, _ = _staggered(llm, prompts, params)
        res[after_prefill] = (_tokens_lps(outs), dict(llm.engine._overlap.counts))
        assert llm.engine._overlap.inflight is None and llm.engine.block_manager.usage() == 0
    (got, got_lps), new = res[True]
    assert got == want == res[False][0][0] == hf_greedy(path, prompts, 8)
    assert got_lps == want_lps  # bit-equal (float32 on the CPU; HF agreement of the plain loop: test_engine)
    # no penalties: every step scheduled while another was in flight went out before the read
    assert new["after_read"] == 0 and new["early"] > 0
    old = res[False][1]
    if mode == "mixed":  # a mixed step's decode rows were launched early before too; its next decode step
        assert old["after_read"] == 0  # holds only its own sequences
    else:  # the old rule waited for every prefill that a decode step followed; the new one did not
        assert old["after_read"] > 0 and old["early_host_rows"] == 0
        assert new["early_host_rows"] > 0 and new["early"] > old["early"]


def test_penalties_stop_strings_and_seeds_while_prompts_arrive(path, monkeypatch):
    # seeded rows, greedy rows stopping at a stop token and a stop string (each chosen from a
    # probe run, so they stop mid-run; the wasted row of the decode step launched early is
    # dropped), and penalty rows: launched early after a prefill step (their tokens are on the
    # host), after the read after a decode step (their output lists end in a placeholder)
    probe = LLM(path, **KW).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    params = _params()
    params[1] = SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, logprobs=1)
    params[3] = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[probe[3].outputs[0].token_ids[4]])
    params[4] = SamplingParams(temperature=0, max_tokens=10, frequency_penalty=0.5, presence_penalty=0.3)
    text = probe[5].outputs[0].text
    params[5] = SamplingParams(temperature=0, max_tokens=10, stop=[text[len(text) // 2:len(text) // 2 + 3]])
    ref, _ = _staggered(_llm(path, False, True, monkeypatch), PROMPTS, params)
    llm = _llm(path, True, True, monkeypatch)
    ov, early = llm.engine._overlap, []
    real_launch = ov._launch

    def launch(batch, prev):  # the penalty rows of decode steps launched before the read
        if prev is not None and not batch.is_prefill:
            early.append([s.request_id for s in batch.seqs if s.params.repetition_penalty != 1.0
                          or s.params.frequency_penalty or s.params.presence_penalty])
            assert not any(s in prev.row for s in batch.seqs if s.request_id in early[-1])
        return real_launch(batch, prev)

    monkeypatch.setattr(ov, "_launch", launch)
    got, _ = _staggered(llm, PROMPTS, params)
    _same(got, ref)
    assert any(early)  # a penalty row from the host in a decode step launched after a prefill step
    counts = ov.counts
    assert counts["early_host_rows"] > 0 and counts["after_read"] > 0
    assert [ref[i].outputs[0].finish_reason for i in (3, 5)] == ["stop", "stop"]
    assert len(ref[3].outputs[0].token_ids) == 5 and len(ref[5].outputs[0].token_ids) < 10
    assert llm.engine._overlap.inflight is None and llm.engine.block_manager.usage() == 0


def test_structured_output_row_while_prompts_arrive(path, monkeypatch):
    # a regex-forced row decodes while greedy prompts arrive: the decode steps after their prefill
    # steps hold it as a host row (its grammar state is current: launched early); a decode step
    # after a decode step of it waits for the read (its grammar must accept the token first)
    forced = SamplingParams(temperature=0, max_tokens=30,
                            structured_outputs=StructuredOutputsParams(regex="hello world, hello there"))
    prompts = [_prompts(8, [6])[0]] + _prompts(9, [17, 12, 9])
    params = [forced, _greedy(), _greedy(), _greedy()]
    want, _ = _staggered(_llm(path, False, True, monkeypatch), prompts, params)
    llm = _llm(path, True, True, monkeypatch)
    ov, host_forced = llm.engine._overlap, []
    real_launch = ov._launch

    def launch(batch, prev):
        if prev is not None and not batch.is_prefill:
            host_forced.extend(s for s in batch.seqs if s.grammar is not None and s not in prev.row)
        return real_launch(batch, prev)

    monkeypatch.setattr(ov, "_launch", launch)
    got, _ = _staggered(llm, prompts, params)
    assert got[0].outputs[0].text == want[0].outputs[0].text == "hello world, hello there"
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert host_forced  # the forced row from the host in decode steps launched after prefill steps
    assert ov.inflight is None and llm.engine.block_manager.usage() == 0


@pytest.mark.parametrize("victim", ["r0", "r2"])  # a host row / the device row of the step in flight
def test_abort_while_an_early_decode_after_prefill_is_in_flight(path, victim, monkeypatch):
    llm = _llm(path, True, True, monkeypatch)
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = PROMPTS[:3]
    for i in range(2):
        eng.add_request(f"r{i}", prompts[i], sp)
    for _ in range(3):
        eng.step()
    eng.add_request("r2", prompts[2], sp)
    n = eng._overlap.counts["early_host_rows"]
    while eng._overlap.counts["early_host_rows"] == n:
        eng.step()
    cur = eng._overlap.inflight  # the decode step of r0, r1 (host ids) and r2 (its first token on the device)
    assert cur is not None and not cur.is_prefill and len(cur.seqs) == 3
    done = abort_then_finish(eng, victim)
    keep = [r for r in ("r0", "r1", "r2") if r != victim]
    assert sorted(done) == keep
    ref = LLM(path, **KW).generate([prompts[int(r[1])] for r in keep], sp)
    assert [done[r].outputs[0].token_ids for r in keep] == [r.outputs[0].token_ids for r in ref]
    assert eng.block_manager.usage() == 0
