"""Chunked prefill (``enable_chunked_prefill``, vLLM's ``--enable-chunked-prefill``): a prompt's
prefill split over steps gives the same float32 greedy tokens as the unchunked prefill and as
Hugging Face, and the same logprobs within 1e-4 (the bound tests/test_engine.py holds against HF;
a chunk only changes which query rows one attention call takes, over the same keys), with chunk
sizes that do not divide the prompts, boundaries inside a KV block and on one; with prefix-cache
hits; abort and preemption of a partial prefill; prompt logprobs, routed experts and LoRA across
chunks; a weight update between two chunks (the prompt restarts under the new weights)."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rlserve import LLM, SamplingParams
from rlserve.config import EngineConfig
from rlserve.engine.core.block_manager import BlockManager
from rlserve.engine.core.scheduler import Scheduler
from rlserve.engine.core.sequence import Sequence
from rlserve.errors import InvalidRequestError
from tests.test_engine import hf_greedy

LP_ATOL = 1e-4  # tests/test_engine.py's bound against HF float32
LENS = [37, 50, 23, 5]  # none a multiple of the chunk sizes below; 5 fits one chunk


def _prompts(seed: int = 0, lens=LENS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 300, (n,), generator=g).tolist() for n in lens]


def _greedy(n: int = 8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, min_tokens=n, logprobs=0, **kw)


def _llm(path, budget=None, chunked=True, **kw):
    kw = {"block_size": 8, **kw}
    return LLM(path, dtype="float32", device="cpu", enable_chunked_prefill=chunked,
               max_num_batched_tokens=budget or 1024, **kw)


def _tokens_lps(outs):
    return ([o.outputs[0].token_ids for o in outs],
            [[d[t] for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs])


def _prefill_sizes(llm):
    """Start recording the token count of each prefill step of ``llm``; returns the list."""
    sizes = []
    real = llm.engine.executor.execute
    llm.engine.executor.execute = lambda step: (step.is_prefill and sizes.append(len(step.input_ids))) or real(step)
    return sizes


@pytest.fixture(scope="module")
def path(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def unchunked(path):
    return _llm(path, chunked=False)


# ---- the scheduler alone -------------------------------------------------------------------------

def _seq(rid, n, bs=4, start=0, **kw):
    return Sequence(rid, 0, list(range(start + 5, start + 5 + n)), SamplingParams(max_tokens=50, **kw), bs)


def _advance(batch):
    """What the engine does after a step: sampled sequences get a token."""
    for s in batch.sampled:
        s.num_computed_tokens = len(s)
        s.output_token_ids.append(1)


def test_scheduler_chunks_a_prompt_and_alternates_with_decodes():
    sch = Scheduler(BlockManager(64, 4), 16, 8, max_consecutive_prefill_steps=1, enable_chunked_prefill=True)
    run = _seq("run", 3)
    sch.add(run)
    _advance(sch.schedule())  # run's prefill
    _advance(sch.schedule())  # run's first decode step
    sch.add(long := _seq("long", 19, start=100))
    got = []
    for _ in range(6):
        b = sch.schedule()
        got.append(("P" if b.is_prefill else "D", [(s.request_id, *b.span(i)) for i, s in enumerate(b.seqs)],
                    [s.request_id for s in b.sampled]))
        _advance(b)
    assert got == [
        ("P", [("long", 0, 8)], []), ("D", [("run", 4, 5)], ["run"]),
        ("P", [("long", 8, 16)], []), ("D", [("run", 5, 6)], ["run"]),
        ("P", [("long", 16, 19)], ["long"]), ("D", [("run", 6, 7), ("long", 19, 20)], ["run", "long"]),
    ]
    assert len(long.block_table) == 5  # the whole prompt's blocks from its first chunk (its first decode fits)


def test_scheduler_fills_the_budget_and_bounds_a_chunk_by_the_threshold():
    sch = Scheduler(BlockManager(64, 4), 16, 8, max_consecutive_prefill_steps=0, enable_chunked_prefill=True,
                    long_prefill_token_threshold=3)
    for rid, n in (("a", 7), ("b", 2), ("c", 9)):
        sch.add(_seq(rid, n, start=len(rid) * 50))
    spans = []
    while sch.waiting or sch.prefilling:
        b = sch.schedule()
        spans.append([(s.request_id, *b.span(i)) for i, s in enumerate(b.seqs)])
        _advance(b)
    assert spans == [[("a", 0, 3), ("b", 0, 2), ("c", 0, 3)], [("a", 3, 6), ("c", 3, 6)], [("a", 6, 7), ("c", 6, 9)]]
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 0"):
        Scheduler(BlockManager(4, 4), 4, 8, long_prefill_token_threshold=-1)
    for bad in (0, -5):  # 0 scheduled no prefill step ever (every request hung); fails on the old code
        with pytest.raises(ValueError, match=f"max_num_batched_tokens must be >= 1, got {bad}"):
            Scheduler(BlockManager(4, 4), 4, bad, enable_chunked_prefill=True)


def test_prefix_cache_offers_only_computed_chunks():
    """Blocks of a prompt whose chunks are not yet computed must not be prefix hits: a second
    request with the same prompt hits only the blocks of the chunks scheduled so far."""
    bm = BlockManager(64, 4)
    sch = Scheduler(bm, 16, 8, max_consecutive_prefill_steps=0, enable_chunked_prefill=True,
                    long_prefill_token_threshold=4)
    sch.add(a := _seq("a", 19))
    sch.schedule()  # a's first chunk: tokens 0..4 (block 0)
    sch.add(b := _seq("b", 19))
    batch = sch.schedule()  # a's second chunk (4..8) and b, hitting blocks 0 and 1, not 2 and 3 (not computed)
    assert [(s.request_id, *batch.span(i)) for i, s in enumerate(batch.seqs)] == [("a", 4, 8), ("b", 8, 12)]
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]


def test_scheduler_preempts_a_partial_prefill_first():
    bm = BlockManager(7, 4, enable_prefix_caching=False)
    sch = Scheduler(bm, 16, 8, max_consecutive_prefill_steps=1, enable_chunked_prefill=True)
    sch.add(run := _seq("run", 7))
    _advance(sch.schedule())  # run's prefill: 8 tokens in 2 blocks
    _advance(sch.schedule())  # its first decode (position 7): 9 tokens
    sch.add(long := _seq("long", 20, start=100))  # 5 blocks: all the free ones
    b = sch.schedule()
    assert b.is_prefill and sch.prefilling == [long] and bm.num_free_blocks == 0
    _advance(b)
    b = sch.schedule()  # run's position 8 needs a third block: the partial prefill gives its own back
    assert not b.is_prefill and b.seqs == [run] and len(run.block_table) == 3
    assert long.num_preemptions == 1 and list(sch.waiting) == [long] and not sch.prefilling
    assert long.num_computed_tokens == 0 and not long.block_table


# ---- the engine against unchunked and HF ------------------------------------------------------------

@pytest.mark.parametrize("budget", [12, 16])  # 12: chunk ends inside 8-token blocks; 16: on block boundaries
def test_greedy_and_logprobs_equal_unchunked_and_hf(path, unchunked, budget):
    prompts = _prompts()
    want, want_lps = _tokens_lps(unchunked.generate(prompts, _greedy()))
    llm = _llm(path, budget)
    sizes = _prefill_sizes(llm)
    got, got_lps = _tokens_lps(llm.generate(prompts, _greedy()))
    assert max(sizes) == budget and sum(sizes) == sum(LENS)  # every prompt token once, in steps of the budget
    assert got == want == hf_greedy(path, prompts, 8)
    torch.testing.assert_close(torch.tensor(sum(got_lps, [])), torch.tensor(sum(want_lps, [])), atol=LP_ATOL, rtol=0)


def test_prefix_hits_then_chunks(path, unchunked):
    prompts = _prompts(1)
    llm = _llm(path, 12)
    llm.generate(prompts[1], _greedy(2))
    hits = llm.engine.stats["prefix_cache_hit_tokens"]
    sizes = _prefill_sizes(llm)
    longer = prompts[1][:45] + prompts[0]  # 45 shared tokens: 5 cached blocks of 8, then 82 - 40 to compute
    got = llm.generate([longer], _greedy())
    assert llm.engine.stats["prefix_cache_hit_tokens"] - hits == 40 and sizes == [12, 12, 12, 6]
    assert _tokens_lps(got)[0] == _tokens_lps(unchunked.generate([longer], _greedy()))[0]


def test_abort_mid_prefill_frees_its_blocks_and_the_engine_serves_on(path, unchunked):
    llm = _llm(path, 12)
    eng = llm.engine
    eng.add_request("long", _prompts()[1], _greedy())
    eng.step()
    assert [s.request_id for s in eng.scheduler.prefilling] == ["long"] and eng.stats["num_running"] == 1
    assert eng.block_manager.num_free_blocks < eng.block_manager.num_blocks
    (out,) = eng.abort_request("long")
    assert out.finished and out.outputs[0].finish_reason == "abort" and out.outputs[0].token_ids == []
    assert not eng.scheduler.has_unfinished() and not eng.has_unfinished_requests()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    p = _prompts(2)
    assert _tokens_lps(llm.generate(p, _greedy()))[0] == _tokens_lps(unchunked.generate(p, _greedy()))[0]


def test_preempted_partial_prefill_recomputes_to_the_same_tokens(path, unchunked):
    """A decoding request needs a KV block while a long prompt is half prefilled: the partial
    prefill is preempted (its blocks freed), recomputed later, and both answers are unchanged."""
    llm = _llm(path, 12, block_size=4, num_kv_blocks=14, max_model_len=56, enable_prefix_caching=False,
               max_consecutive_prefill_steps=1)
    eng = llm.engine
    preempted_partial = []
    real = eng.scheduler._preempt
    eng.scheduler._preempt = lambda s: preempted_partial.append(0 < s.num_computed_tokens < len(s)) or real(s)
    short, long = _prompts(3, [8, 44])
    eng.add_request("short", short, _greedy(40))
    for _ in range(4):
        eng.step()
    eng.add_request("long", long, _greedy(4))
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    assert True in preempted_partial
    want = _tokens_lps(unchunked.generate([short, long], [_greedy(40), _greedy(4)]))[0]
    assert [done["short"], done["long"]] == want


def test_prompt_logprobs_across_chunks(path, unchunked):
    prompts = _prompts(4, [37, 16, 9])  # 37 and 16 over several chunks of 12; 16 ends on a block
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3)
    want = unchunked.generate(prompts, params)
    got = _llm(path, 12).generate(prompts, params)
    for g, w in zip(got, want):
        assert len(g.prompt_logprobs) == len(w.prompt_logprobs) == len(g.prompt_token_ids)
        assert g.prompt_logprobs[0] is None and g.prompt_logprob_ranks == w.prompt_logprob_ranks
        for dg, dw in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            assert list(dg) == list(dw)  # the same tokens in the same order
            np.testing.assert_allclose(list(dg.values()), list(dw.values()), atol=LP_ATOL, rtol=0)
        assert g.outputs[0].token_ids == w.outputs[0].token_ids


def test_routed_experts_across_chunks(tiny_model):
    from tests.test_moe_replay import hf_routed

    moe = tiny_model("qwen3_moe")
    prompts = _prompts(5, [29, 13])
    params = SamplingParams(temperature=0, max_tokens=5, min_tokens=5)
    ref = LLM(moe, dtype="float32", device="cpu", enable_return_routed_experts=True, enable_chunked_prefill=False)
    llm = LLM(moe, dtype="float32", device="cpu", enable_return_routed_experts=True, max_num_batched_tokens=10,
              block_size=4, enable_chunked_prefill=True)
    for g, w in zip(llm.generate(prompts, params), ref.generate(prompts, params)):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        np.testing.assert_array_equal(g.outputs[0].routed_experts, w.outputs[0].routed_experts)
        full = list(g.prompt_token_ids) + list(g.outputs[0].token_ids)
        np.testing.assert_array_equal(g.outputs[0].routed_experts.astype(np.int64), hf_routed(moe, full[:-1]))


def test_lora_requests_across_chunks(path, tmp_path):
    from tests.lora_adapters import make_adapter

    adapter = make_adapter(path, tmp_path / "a1", seed=1)
    prompts = _prompts(6, [41, 19])
    kw = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
    res = {}
    for chunked in (False, True):
        llm = _llm(path, 12, chunked, **kw)
        from rlserve.lora.model import lora_of

        lora_of(llm.engine.model).load(1, adapter)
        res[chunked] = _tokens_lps(llm.generate(prompts * 2, [_greedy(lora_int_id=1)] * 2 + [_greedy()] * 2))
    assert res[True][0] == res[False][0] and res[True][0][:2] != res[True][0][2:]  # the adapter changes them
    torch.testing.assert_close(torch.tensor(sum(res[True][1], [])), torch.tensor(sum(res[False][1], [])),
                               atol=LP_ATOL, rtol=0)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_weight_update_between_two_chunks_restarts_the_prompt(path, tiny_model, overlap):
    """A prompt is never computed half under the old weights and half under the new: a partial
    prefill allocated before the update (every update resets the prefix cache) starts over, so its
    answer is the new model's (HF's greedy tokens of the new checkpoint). Under both loops: the
    overlapped one (``async_scheduling``) runs a chunk ahead, so one ``step()`` has computed one
    chunk (plain) or two (overlapped: the second launched before the first was read); either way
    the prompt is partial when the update comes, and the whole of it runs again after."""
    other = tiny_model("llama", seed=1)
    llm = _llm(path, 12, async_scheduling=overlap)
    eng = llm.engine
    assert (eng._overlap is not None) is overlap
    sizes = _prefill_sizes(llm)
    prompt = _prompts(7, [40])[0]
    eng.add_request("r", prompt, _greedy())
    eng.step()
    done = eng.scheduler.prefilling[0].num_computed_tokens if eng.scheduler.prefilling else None
    assert done == (24 if overlap else 12) and sizes == [12] * (done // 12)  # partial: 40 tokens in all
    eng.load_weights(load_file(f"{other}/model.safetensors").items())
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
    assert sizes[done // 12:] == [12, 12, 12, 4]  # the whole prompt again, not its last 40 - done tokens
    assert out.outputs[0].token_ids == hf_greedy(other, [prompt], 8)[0]


# ---- flags and server_info -----------------------------------------------------------------------

def test_flags_config_and_server_info():
    from rlserve.cli import build_parser
    from rlserve.cli.serve import engine_config_from_args
    from rlserve.server.server_info import vllm_config

    assert EngineConfig("m").enable_chunked_prefill is False  # off by default since session 17 (config.py says why)
    cfg = engine_config_from_args(build_parser().parse_args(["serve", "m"]), "m")
    assert cfg.enable_chunked_prefill is False and cfg.long_prefill_token_threshold == 0
    assert engine_config_from_args(build_parser().parse_args(["serve", "m", "--enable-chunked-prefill"]),
                                   "m").enable_chunked_prefill is True
    cfg = engine_config_from_args(build_parser().parse_args(
        ["serve", "m", "--no-enable-chunked-prefill", "--long-prefill-token-threshold", "256"]), "m")
    assert cfg.enable_chunked_prefill is False and cfg.long_prefill_token_threshold == 256
    with pytest.raises(InvalidRequestError, match="long_prefill_token_threshold must be >= 0"):
        EngineConfig("m", long_prefill_token_threshold=-1)
    with pytest.raises(InvalidRequestError, match="max_num_batched_tokens must be >= 1, got 0"):
        EngineConfig("m", max_num_batched_tokens=0)  # --max-num-batched-tokens 0: a server whose requests hung
    for on in (True, False):
        c = EngineConfig("m", enable_chunked_prefill=on, max_num_batched_tokens=64, long_prefill_token_threshold=8)
        state = SimpleNamespace(aengine=SimpleNamespace(config=c, engine=None), settings=SimpleNamespace(
            model="m", model_impl="auto", generation_config="auto", weight_transfer_config=None), model_name="m", max_model_len=128,
            max_logprobs=20, vocab_size=100)
        sc = vllm_config(state)["scheduler_config"]
        assert sc["enable_chunked_prefill"] is on and sc["max_num_batched_tokens"] == 64
        assert sc["long_prefill_token_threshold"] == 8


# ---- the HTTP server: echo across chunks, server_info --------------------------------------------

def test_server_echo_logprobs_across_chunks(path, unchunked):
    """``/v1/completions`` with ``echo`` and ``logprobs`` (prompt logprobs under the hood), plain and
    streamed, on a server whose steps take 8 tokens (the prompt in chunks): the unchunked engine's
    tokens and prompt logprobs; ``/server_info`` says chunked prefill is on."""
    import httpx

    from tests.transfer_harness import InProcessServer

    prompt = "Once upon a time there was a tiny model that read long prompts in chunks of eight tokens"
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 2}
    with InProcessServer(path, load_format="auto", max_num_batched_tokens=8, enable_chunked_prefill=True) as srv:
        sc = httpx.get(srv.url + "/server_info", params={"config_format": "json"}, timeout=60).json()[
            "vllm_config"]["scheduler_config"]
        assert sc["enable_chunked_prefill"] is True and sc["max_num_batched_tokens"] == 8
        got = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
        with httpx.stream("POST", srv.url + "/v1/completions", json=dict(body, stream=True), timeout=60) as r:
            chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    (want,) = unchunked.generate([prompt], SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=2))
    ids = want.prompt_token_ids
    assert len(ids) > 3 * 8  # several chunks
    assert got["text"] == "".join(c["choices"][0]["text"] for c in chunks) == prompt + want.outputs[0].text
    lps = got["logprobs"]["token_logprobs"]
    assert len(lps) == len(ids) + 4 and lps[0] is None
    np.testing.assert_allclose(lps[1:len(ids)], [want.prompt_logprobs[i][t] for i, t in enumerate(ids) if i],
                               atol=LP_ATOL, rtol=0)
