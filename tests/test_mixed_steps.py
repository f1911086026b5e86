"""Mixed steps (``mixed_prefill_decode``, ``--mixed-prefill-decode``): a prefill step while sequences
run also decodes every running sequence, as vLLM's scheduler does. The scheduler's batches (decode rows
first, one token each, then prefill work in what the decode tokens leave of the budget; alternating
with pure decode steps), and the engine against the unmixed engine and Hugging Face in float32 on CPU:
the same greedy tokens, logprobs within 1e-4 (tests/test_engine.py's bound against HF: a decode row in
a varlen prefill call reads the same keys as in a decode call), with chunks, preemption, the overlapped
loop (a decode row's input id on the device), prompt logprobs, LoRA and routed experts."""

import numpy as np
import pytest
import torch

from rlserve import LLM, SamplingParams
from rlserve.engine.core.block_manager import BlockManager
from rlserve.engine.core.scheduler import Scheduler
from tests.test_chunked_prefill import LP_ATOL, _advance, _greedy, _prompts, _seq, _tokens_lps
from tests.test_engine import hf_greedy
from tests.test_overlap import PROMPTS, _params, _same


def _spans(b):
    return [(s.request_id, *b.span(i)) for i, s in enumerate(b.seqs)]


def test_scheduler_mixes_decodes_into_chunk_steps_and_alternates():
    sch = Scheduler(BlockManager(64, 4), 16, 8, max_consecutive_prefill_steps=1, enable_chunked_prefill=True,
                    mixed_prefill_decode=True)
    sch.add(run := _seq("run", 3))
    first = sch.schedule()  # nothing runs yet: a plain prefill step
    assert first.is_prefill and first.num_decodes == 0 and _spans(first) == [("run", 0, 3)]
    _advance(first)
    sch.add(_seq("long", 19, start=100))
    got = []
    for _ in range(7):
        b = sch.schedule()
        got.append(("M" if b.is_prefill else "D", b.num_decodes, _spans(b), [s.request_id for s in b.sampled]))
        _advance(b)
    # budget 8: run's decode token leaves 7 for long's chunks; a pure decode step after each mixed one
    # (the first: run's prefill was the last step)
    assert got == [
        ("D", 0, [("run", 3, 4)], ["run"]),
        ("M", 1, [("run", 4, 5), ("long", 0, 7)], ["run"]), ("D", 0, [("run", 5, 6)], ["run"]),
        ("M", 1, [("run", 6, 7), ("long", 7, 14)], ["run"]), ("D", 0, [("run", 7, 8)], ["run"]),
        ("M", 1, [("run", 8, 9), ("long", 14, 19)], ["run", "long"]),
        ("D", 0, [("run", 9, 10), ("long", 19, 20)], ["run", "long"]),
    ]
    assert run.num_output_tokens == 8  # its prefill and 7 steps each gave a token


def test_scheduler_mixed_whole_prompts_and_a_full_budget():
    """Without chunked prefill whole prompts fit what the decodes leave; decodes that fill the budget
    leave a plain decode step (the prompt waits for the next step)."""
    sch = Scheduler(BlockManager(64, 4), 16, 6, max_consecutive_prefill_steps=0, enable_chunked_prefill=False,
                    mixed_prefill_decode=True)
    for rid in ("a", "b"):
        sch.add(_seq(rid, 2, start=ord(rid)))
    _advance(sch.schedule())  # a and b prefill together (4 tokens)
    sch.add(_seq("c", 4, start=200))
    sch.add(_seq("d", 3, start=300))
    b = sch.schedule()  # 2 decode tokens + c's 4: d (3 more) waits
    assert b.is_prefill and b.num_decodes == 2 and _spans(b) == [("a", 2, 3), ("b", 2, 3), ("c", 0, 4)]
    _advance(b)
    sch.max_num_batched_tokens = 3  # the 3 decode tokens fill the step: no room for d
    b = sch.schedule()
    assert not b.is_prefill and b.num_decodes == 0 and [s.request_id for s in b.seqs] == ["a", "b", "c"]
    assert [s.request_id for s in sch.waiting] == ["d"]


def _llm(path, mixed, **kw):
    kw = {"block_size": 8, "max_num_batched_tokens": 12, "max_consecutive_prefill_steps": 1,
          "enable_chunked_prefill": True, **kw}
    return LLM(path, dtype="float32", device="cpu", mixed_prefill_decode=mixed, **kw)


def _staggered(llm, prompts, params):
    """Add one request per step (so prompts arrive while others decode); returns the finished outputs
    in request order and the number of mixed steps run."""
    eng = llm.engine
    mixed = []
    real = eng.scheduler.schedule

    def schedule():
        b = real()
        if b is not None and b.num_decodes:
            mixed.append(b.num_decodes)
        return b

    eng.scheduler.schedule = schedule
    done, i = {}, 0
    while i < len(prompts) or eng.has_unfinished_requests():
        if i < len(prompts):
            eng.add_request(f"r{i}", prompts[i], params[i] if isinstance(params, list) else params)
            i += 1
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    return [done[f"r{j}"] for j in range(len(prompts))], len(mixed)


@pytest.fixture(scope="module")
def path(tiny_model):
    return tiny_model("llama")


@pytest.mark.parametrize("chunked", [True, False])
def test_greedy_and_logprobs_equal_unmixed_and_hf(path, chunked):
    prompts = _prompts(0, [37, 50, 23, 5, 30])
    want, want_lps = _tokens_lps(_staggered(_llm(path, False, enable_chunked_prefill=chunked), prompts, _greedy())[0])
    outs, n_mixed = _staggered(_llm(path, True, enable_chunked_prefill=chunked), prompts, _greedy())
    got, got_lps = _tokens_lps(outs)
    assert n_mixed >= 4  # prompts (chunks) went into steps with decode rows
    assert got == want == hf_greedy(path, prompts, 8)
    torch.testing.assert_close(torch.tensor(sum(got_lps, [])), torch.tensor(sum(want_lps, [])), atol=LP_ATOL, rtol=0)


def test_mixed_steps_with_preemption(path):
    kw = dict(block_size=4, num_kv_blocks=14, max_model_len=56, enable_prefix_caching=False)
    prompts = _prompts(3, [8, 44, 12])
    params = [_greedy(30), _greedy(4), _greedy(20)]
    want = _tokens_lps(_staggered(_llm(path, False, **kw), prompts, params)[0])[0]
    llm = _llm(path, True, **kw)
    outs, n_mixed = _staggered(llm, prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0 and n_mixed > 0
    assert _tokens_lps(outs)[0] == want
    assert llm.engine.block_manager.usage() == 0


@pytest.mark.parametrize("penalty", [False, True])  # True: a decode row's sampling reads output values:
def test_overlapped_mixed_steps_equal_the_plain_loop(tiny_model, penalty):  # launched after the read
    path = tiny_model("qwen3")
    params = _params()
    if penalty:
        params[1] = SamplingParams(temperature=0, max_tokens=9, repetition_penalty=1.3)
    kw = dict(block_size=4, max_num_batched_tokens=8, max_num_seqs=3, max_consecutive_prefill_steps=1)
    ref, _ = _staggered(LLM(path, dtype="float32", device="cpu", **kw), PROMPTS, params)
    llm = LLM(path, dtype="float32", device="cpu", mixed_prefill_decode=True, extra={"async_scheduling": True}, **kw)
    assert llm.engine._overlap is not None
    got, n_mixed = _staggered(llm, PROMPTS, params)
    assert n_mixed > 0
    _same(got, ref)
    assert llm.engine._overlap.inflight is None and llm.engine.block_manager.usage() == 0


def test_prompt_logprobs_in_mixed_steps(path):
    prompts = _prompts(4, [9, 37, 16])
    params = SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=3)
    want, _ = _staggered(_llm(path, False), prompts, params)
    got, n_mixed = _staggered(_llm(path, True), prompts, params)
    assert n_mixed > 0
    for g, w in zip(got, want):
        assert len(g.prompt_logprobs) == len(g.prompt_token_ids) and g.prompt_logprob_ranks == w.prompt_logprob_ranks
        for dg, dw in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            assert list(dg) == list(dw)
            np.testing.assert_allclose(list(dg.values()), list(dw.values()), atol=LP_ATOL, rtol=0)
        assert g.outputs[0].token_ids == w.outputs[0].token_ids


def test_lora_and_routed_experts_in_mixed_steps(path, tiny_model, tmp_path):
    from rlserve.lora.model import lora_of
    from tests.lora_adapters import make_adapter
    from tests.test_moe_replay import hf_routed

    adapter = make_adapter(path, tmp_path / "a1", seed=1)
    prompts = _prompts(6, [41, 19, 23, 11])
    params = [_greedy(lora_int_id=1), _greedy(), _greedy(lora_int_id=1), _greedy()]
    res = {}
    for mixed in (False, True):
        llm = _llm(path, mixed, enable_lora=True, max_loras=2, max_lora_rank=8)
        lora_of(llm.engine.model).load(1, adapter)
        outs, n_mixed = _staggered(llm, prompts, params)
        res[mixed] = _tokens_lps(outs)
    assert n_mixed > 0 and res[True][0] == res[False][0]
    torch.testing.assert_close(torch.tensor(sum(res[True][1], [])), torch.tensor(sum(res[False][1], [])),
                               atol=LP_ATOL, rtol=0)

    moe = tiny_model("qwen3_moe")
    prompts = _prompts(5, [29, 13, 17])
    params = SamplingParams(temperature=0, max_tokens=5, min_tokens=5)
    outs, n_mixed = _staggered(_llm(moe, True, enable_return_routed_experts=True, block_size=4), prompts, params)
    assert n_mixed > 0
    for g in outs:
        full = list(g.prompt_token_ids) + list(g.outputs[0].token_ids)
        np.testing.assert_array_equal(g.outputs[0].routed_experts.astype(np.int64), hf_routed(moe, full[:-1]))


def test_flag_and_config():
    from rlserve.cli import build_parser
    from rlserve.cli.serve import engine_config_from_args

    assert engine_config_from_args(build_parser().parse_args(["serve", "m"]), "m").mixed_prefill_decode is False
    cfg = engine_config_from_args(build_parser().parse_args(["serve", "m", "--mixed-prefill-decode"]), "m")
    assert cfg.mixed_prefill_decode is True


def test_attention_runs_a_mixed_steps_decode_rows_apart():
    """Leading one-token rows (a mixed step's decodes) go to the backend's decode path, the rest to its
    prefill path; the output equals one varlen call over all rows (float32: within 1e-5, the two CPU
    paths' rounding of the same softmax over the same keys)."""
    from rlserve.layers.attention import Attention, AttentionMetadata, torch_paged_attention

    g = torch.Generator().manual_seed(0)
    att = Attention(4, 8, 8 ** -0.5, 2)
    att.k_cache, att.v_cache = (torch.randn(16, 4, 2, 8, generator=g) for _ in range(2))
    qlens, slens = [1, 1, 5, 1], [9, 3, 7, 12]
    meta = AttentionMetadata.build(qlens, slens, [[0, 1, 2], [3], [4, 5], [6, 7, 8]], 4)
    d, dec, pre = meta.decode_split()
    assert d == 2 and dec.max_query_len == 1 and pre.query_start_loc_cpu == [0, 5, 6] and pre.seq_lens_cpu == [7, 12]
    assert meta.decode_split() is meta.backend_cache["decode_split"]  # one scan per step
    q = torch.randn(8, 4 * 8, generator=g)
    want = torch_paged_attention(q.view(8, 4, 8), att.k_cache, att.v_cache,
                                 AttentionMetadata.build(qlens, slens, [[0, 1, 2], [3], [4, 5], [6, 7, 8]], 4), att.scale)
    got = att._attend(q.view(8, 4, 8), meta, {})
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for ql in ([5, 1], [1, 1]):  # no leading decode row; a pure decode step
        assert AttentionMetadata.build(ql, [6, 6], [[0, 1], [2, 3]], 4).decode_split() is None


@pytest.mark.parametrize("overlap", [False, True])  # True: the constrained row makes the step wait for the read
def test_structured_output_row_in_mixed_steps(path, overlap):
    from rlserve.engine.sampling_params import StructuredOutputsParams

    forced = SamplingParams(temperature=0, max_tokens=30,
                            structured_outputs=StructuredOutputsParams(regex="hello world, hello there"))
    prompts = [_prompts(8, [6])[0]] + _prompts(9, [40, 33])
    params = [forced, _greedy(), _greedy()]
    want, _ = _staggered(_llm(path, False), prompts, params)
    got, n_mixed = _staggered(_llm(path, True, extra={"async_scheduling": overlap}), prompts, params)
    assert n_mixed > 0
    assert got[0].outputs[0].text == want[0].outputs[0].text == "hello world, hello there"
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]


def test_block_tokens_are_slices_of_the_sequence():
    """``Sequence.block_tokens`` (prompt / output slices, O(block_size)) equals the whole sequence's
    slice for every block: inside the prompt, across the prompt's end, inside the output, the last partial one."""
    s = _seq("a", 10, bs=4)
    s.output_token_ids.extend([900, 901, 902, 903, 904, 905, 906])
    assert [s.block_tokens(i) for i in range(5)] == [s.all_token_ids[i * 4 : i * 4 + 4] for i in range(5)]
    assert s.block_tokens(2) == [13, 14, 900, 901] and s.block_tokens(4) == [906]
