"""Batch-invariant mode on CPU (rlserve/batch_invariant/, issue 39): a request's tokens and
logprobs are bitwise equal (``torch.equal``) whatever else is in its steps, with a prefix-cache
hit, after a recompute, with micro-batches or overlap on or off, across engine restarts for a
seeded request; the trainer-side reference gives the server's logprobs bitwise (KL 0).

The model is a tiny random checkpoint with a wide MLP (intermediate 2,048): the batch
dependence of the CPU GEMMs shows from K ~1,536 (rlserve/batch_invariant/cpu.py); with the
mode off the same checks fail on this machine (the alone-vs-batch one and the reference one
at every batch size tried)."""

from __future__ import annotations

import random

import pytest
import torch

from rlserve.batch_invariant import BatchInvariantReference, cpu as bi_cpu, mismatch, mode as bi_mode, \
    reference_logprobs
from rlserve.engine.llm import LLM
from rlserve.engine.sampling_params import SamplingParams
from rlserve.layers import cpu_attention, cpu_gemm
from rlserve.layers.attention import AttentionMetadata
from rlserve.layers.cpu_linear import pack_weight
from tests.batch_invariant_cases import assert_same as _assert_same, check_among_neighbours, random_prompt as _prompt, \
    tokens_and_logprobs as _tokens_and_logprobs
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="the CPU paged attention C kernel does not build")

WIDE = dict(intermediate_size=2048, max_position_embeddings=512)


@pytest.fixture(scope="module")
def smollm_wide(tmp_path_factory):
    return make_tiny_model("smollm", tmp_path_factory.mktemp("bi_smollm"), **WIDE)


@pytest.fixture(scope="module")
def llm(smollm_wide):
    return LLM(smollm_wide, dtype="float32", device="cpu", batch_invariant=True, max_num_seqs=64)


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, logprobs=0, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=10, logprobs=0, ignore_eos=True)


# ---- kernels ---------------------------------------------------------------------------------


@pytest.mark.parametrize("K,N", [(2048, 96), (96, 2048), (1536, 576), (100, 37)])
def test_linear_rows_do_not_depend_on_the_row_count(K, N):
    gen = torch.Generator().manual_seed(K + N)
    w = torch.randn(N, K, generator=gen)
    b = torch.randn(N, generator=gen)
    x = torch.randn(300, K, generator=gen)
    packed, fma = pack_weight(w), cpu_gemm.pack(w)
    assert packed is not None and fma is not None
    for fn in (lambda v: bi_cpu.linear(v, w, packed, b, fma=fma), lambda v: bi_cpu.linear(v, w, packed, b),
               lambda v: bi_cpu.linear(v, w, None, b)):
        one = torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])
        for m in (2, 3, 16, 17, 64, 65, 300):
            assert torch.equal(fn(x[:m]), one[:m]), m
        for s, m in ((5, 7), (31, 33), (100, 1)):  # another place in the batch
            assert torch.equal(fn(x[s:s + m]), one[s:s + m])
    # the packed and tiled forms both compute F.linear (up to summation order)
    for f in (fma, None):  # the FMA-chain, packed and tiled forms all compute F.linear (up to summation order)
        torch.testing.assert_close(bi_cpu.linear(x, w, packed, b, fma=f), torch.nn.functional.linear(x, w, b),
                                   rtol=1e-4, atol=1e-4)  # float32 sums of K <= 2048 terms of N(0, 1) products


def test_prefill_attention_equals_each_token_decoded_alone_and_chunked():
    """A prompt's attention in one prefill step = in two chunks (the second over the cached
    first) = each token as a decode step, bit for bit; and = SDPA up to float32 rounding."""
    gen = torch.Generator().manual_seed(0)
    H, Hkv, D, bs, n = 6, 3, 16, 16, 45
    nblocks = -(-n // bs)
    kc = torch.randn(8, bs, Hkv, D, generator=gen)
    vc = torch.randn(8, bs, Hkv, D, generator=gen)
    q = torch.randn(n, H, D, generator=gen)
    table = [5, 2, 7][:nblocks]
    with bi_mode.active(True):
        whole = bi_cpu.prefill_attention(q, kc, vc, AttentionMetadata.build([n], [n], [table], bs), 0.25)
        a = bi_cpu.prefill_attention(q[:20], kc, vc, AttentionMetadata.build([20], [20], [table], bs), 0.25)
        b = bi_cpu.prefill_attention(q[20:], kc, vc, AttentionMetadata.build([n - 20], [n], [table], bs), 0.25)
        # two sequences in one step: the first's rows are unchanged by the second
        two = bi_cpu.prefill_attention(torch.cat([q, q[:9]]), kc, vc,
                                       AttentionMetadata.build([n, 9], [n, 9], [table, [1]], bs), 0.25)
    assert torch.equal(torch.cat([a, b]), whole)
    assert torch.equal(two[:n], whole)
    for t in (0, 15, 16, 44):
        dec = cpu_attention.paged_decode(q[t:t + 1], kc, vc, torch.tensor([table], dtype=torch.int32),
                                         torch.tensor([t + 1], dtype=torch.int32), 0.25)
        assert torch.equal(dec[0], whole[t])
    ctx = torch.cat([kc[table]], 0).flatten(0, 1)[:n]  # [n, Hkv, D]
    vctx = torch.cat([vc[table]], 0).flatten(0, 1)[:n]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], ctx.repeat_interleave(2, 1).transpose(0, 1)[None],
        vctx.repeat_interleave(2, 1).transpose(0, 1)[None], is_causal=True, scale=0.25)[0].transpose(0, 1)
    torch.testing.assert_close(whole, ref, rtol=1e-5, atol=1e-5)  # float32 softmax over <= 45 terms


# ---- the engine --------------------------------------------------------------------------------


def test_the_mode_says_it_is_on_in_the_log(tmp_path, caplog):
    """A user who starts the server with --batch-invariant finds it in the log (a new user looked for it)."""
    path = make_tiny_model("smollm", tmp_path / "m")
    with caplog.at_level("INFO", logger="rlserve.engine.worker.model_runner"):
        LLM(path, dtype="float32", device="cpu", batch_invariant=True, max_num_seqs=4)
    on = [r.getMessage() for r in caplog.records if "batch-invariant mode on (cpu)" in r.getMessage()]
    assert len(on) == 1, [r.getMessage() for r in caplog.records]
    caplog.clear()
    with caplog.at_level("INFO", logger="rlserve.engine.worker.model_runner"):
        LLM(path, dtype="float32", device="cpu", max_num_seqs=4)
    assert not [r for r in caplog.records if "batch-invariant mode on" in r.getMessage()]



def test_greedy_request_alone_equals_it_among_random_neighbours(llm):
    rng = random.Random(1)
    check_among_neighbours(llm, _prompt(rng, 30, 31), GREEDY, lambda r, i: SamplingParams(
        temperature=0.0, max_tokens=r.randrange(2, 16), logprobs=0, ignore_eos=True), (1, 2, 5, 13, 32), rng)


def test_seeded_request_repeats_among_neighbours_and_after_a_restart(smollm_wide, llm):
    rng = random.Random(2)
    target = _prompt(rng, 25, 26)
    alone = _tokens_and_logprobs(llm.generate([target], SEEDED)[0])
    prompts = [_prompt(rng) for _ in range(9)]
    prompts.insert(4, target)
    params = [SamplingParams(temperature=1.0, max_tokens=12, logprobs=0, seed=i) for i in range(10)]
    params[4] = SEEDED
    _assert_same(_tokens_and_logprobs(llm.generate(prompts, params)[4]), alone)
    restarted = LLM(smollm_wide, dtype="float32", device="cpu", batch_invariant=True, seed=99)
    _assert_same(_tokens_and_logprobs(restarted.generate([target], SEEDED)[0]), alone)


def test_prefix_cache_hit_and_recompute_after_preemption_change_nothing(smollm_wide, llm):
    rng = random.Random(3)
    target = _prompt(rng, 40, 41)
    alone = _tokens_and_logprobs(llm.generate([target], GREEDY)[0])
    llm.generate([target[:33] + [7, 8]], GREEDY)  # two full blocks of 16 cached
    _assert_same(_tokens_and_logprobs(llm.generate([target], GREEDY)[0]), alone)
    # a KV cache too small for the batch: sequences are preempted and prefilled again over
    # their prompt + the tokens they had, which then come from a prefill, not decode steps.
    # (The attention kernel walks the context block by block: the block size is part of the
    # configuration a request's bits depend on, so both engines use 4.)
    small = LLM(smollm_wide, dtype="float32", device="cpu", batch_invariant=True, block_size=4, num_kv_blocks=40,
                max_model_len=160, enable_prefix_caching=False)
    prompts = [target] + [_prompt(rng, 20, 30) for _ in range(5)]
    long = SamplingParams(temperature=0.0, max_tokens=24, logprobs=0, ignore_eos=True)
    outs = small.generate(prompts, [long] * 6)
    assert small.engine.stats["num_preemptions"] > 0
    roomy = LLM(smollm_wide, dtype="float32", device="cpu", batch_invariant=True, block_size=4)
    _assert_same(_tokens_and_logprobs(outs[0]), _tokens_and_logprobs(roomy.generate([target], long)[0]))


@pytest.mark.parametrize("microbatches", [1, 2])
def test_microbatches_and_overlap_change_nothing(smollm_wide, llm, microbatches, monkeypatch):
    monkeypatch.setenv("RLSERVE_CPU_MICROBATCH_MIN_ROWS", "2")  # split every step of >= 2 rows
    rng = random.Random(4)
    prompts = [_prompt(rng) for _ in range(20)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=8, logprobs=0, ignore_eos=True) for i in range(20)]
    want = [_tokens_and_logprobs(o) for o in llm.generate(prompts, params)]
    other = LLM(smollm_wide, dtype="float32", device="cpu", batch_invariant=True, async_scheduling=True,
                extra={"cpu_microbatches": microbatches})
    for o, w in zip(other.generate(prompts, params), want):
        _assert_same(_tokens_and_logprobs(o), w)


# ---- the trainer-side reference ---------------------------------------------------------------


@pytest.mark.parametrize("arch", ["smollm", "qwen3"])
def test_reference_logprobs_are_the_servers_bit_for_bit(arch, tmp_path_factory, smollm_wide, llm):
    path = smollm_wide if arch == "smollm" else make_tiny_model("qwen3", tmp_path_factory.mktemp("bi_q3"), **WIDE)
    server = llm if arch == "smollm" else LLM(path, dtype="float32", device="cpu", batch_invariant=True)
    rng = random.Random(5)
    prompts = [_prompt(rng) for _ in range(12)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=rng.randrange(3, 20), logprobs=0,
                             prompt_logprobs=0) for i in range(12)]
    outs = server.generate(prompts, params)
    seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    served = [_tokens_and_logprobs(o)[1] for o in outs]
    ref = BatchInvariantReference(path)
    got = reference_logprobs(ref, seqs)
    completion = [g[-len(s):] for g, s in zip(got, served)]
    for c, s in zip(completion, served):
        assert torch.equal(c, s)
    stats = mismatch(served, completion)
    assert stats == {"kl": 0.0, "max_abs_diff": 0.0, "tokens": sum(len(s) for s in served), "bitwise_equal": True}
    # prompt logprobs (computed in the prefill step) too
    for o, g in zip(outs, got):
        prompt_lp = torch.tensor([d[t] for d, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])],
                                 dtype=torch.float32)
        assert torch.equal(prompt_lp, g[:len(prompt_lp)])
    # one sequence alone, and from a Hugging Face model object
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert torch.equal(reference_logprobs(hf, seqs[3]), got[3])


def test_reference_refuses_bad_input(smollm_wide):
    ref = BatchInvariantReference(smollm_wide)
    with pytest.raises(ValueError, match=r"out of the vocabulary \[0, \d+\): \[-1\]"):
        ref.logprobs([[5, -1]])
    assert ref.logprobs([[5]])[0].shape == (0,)
    with pytest.raises(TypeError, match="model directory or a Hugging Face model"):
        BatchInvariantReference(42)
    with pytest.raises(ValueError, match="3 server samples but 2 reference"):
        mismatch([[0.0]] * 3, [torch.zeros(1)] * 2)


# ---- the switch ----------------------------------------------------------------------------------


def test_switch_from_flag_env_and_config(monkeypatch, smollm_wide):
    from rlserve.cli import build_parser
    from rlserve.cli.serve import engine_config_from_args

    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    args = build_parser().parse_args(["serve", smollm_wide, "--batch-invariant"])
    assert engine_config_from_args(args, smollm_wide).batch_invariant is True
    args = build_parser().parse_args(["serve", smollm_wide])
    cfg = engine_config_from_args(args, smollm_wide)
    assert cfg.batch_invariant is False and bi_mode.from_config(cfg) is False
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert bi_mode.from_config(cfg) is True and bi_mode.from_config(None) is True
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert bi_mode.from_config(cfg) is False


def test_uncovered_features_are_refused(tmp_path_factory, smollm_wide):
    with pytest.raises(ValueError, match=r"--batch-invariant does not cover --enable-lora yet"):
        LLM(smollm_wide, dtype="float32", device="cpu", batch_invariant=True, enable_lora=True)
    moe = make_tiny_model("qwen3_moe", tmp_path_factory.mktemp("bi_moe"))
    with pytest.raises(ValueError, match="does not cover a mixture-of-experts model yet"):
        LLM(moe, dtype="float32", device="cpu", batch_invariant=True)
    cfg = type("C", (), {"quantization": "fp8", "tensor_parallel_size": 2})()
    with pytest.raises(ValueError, match="does not cover --quantization fp8, --tensor-parallel-size 2 yet"):
        bi_mode.check_config_supported(cfg)
    cfg = type("C", (), {"kv_cache_dtype": "fp8_e4m3"})()
    with pytest.raises(ValueError, match="does not cover --kv-cache-dtype fp8_e4m3 yet"):
        bi_mode.check_config_supported(cfg)
    bi_mode.check_config_supported(type("C", (), {"kv_cache_dtype": "auto"})())  # the model's dtype: covered


def test_cpu_mode_needs_float32(smollm_wide):
    with pytest.raises(ValueError, match="--batch-invariant on CPU needs --dtype float32, got torch.bfloat16"):
        LLM(smollm_wide, dtype="bfloat16", device="cpu", batch_invariant=True)


# ---- the server --------------------------------------------------------------------------------


def test_server_with_vllm_env_switch_matches_the_reference_while_busy(smollm_wide):
    """``rlserve serve`` (engine-core process) with ``VLLM_BATCH_INVARIANT=1``: a completion's
    logprobs (``logprobs: 0``) are the same alone and while 8 other requests share its steps,
    and equal :func:`reference_logprobs` of prompt + completion bit for bit."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from rlserve.server.testing import ServerProcess

    rng = random.Random(6)
    target = _prompt(rng, 40, 41)
    others = [_prompt(rng) for _ in range(8)]

    def complete(url, ids, n):
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": smollm_wide, "prompt": ids, "max_tokens": n, "temperature": 0.0, "logprobs": 0,
            "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return c["token_ids"], torch.tensor(c["logprobs"]["token_logprobs"], dtype=torch.float32)

    with ServerProcess(smollm_wide, "--port", "0", "--dtype", "float32", "--device", "cpu",
                       env={"VLLM_BATCH_INVARIANT": "1"}) as srv:
        alone = complete(srv.url, target, 12)
        with ThreadPoolExecutor(9) as pool:
            futs = [pool.submit(complete, srv.url, p, 30) for p in others]
            busy = pool.submit(complete, srv.url, target, 12).result()
            [f.result() for f in futs]
    _assert_same(busy, alone)
    ref = reference_logprobs(smollm_wide, target + alone[0])
    assert torch.equal(ref[-len(alone[0]):], alone[1])


def test_mode_runs_the_cpu_team_and_its_kernel(monkeypatch, smollm_wide, llm):
    """Session 14: the mode no longer forces a team of 1 (the team's FMA-chain GEMM is
    batch-invariant by construction: one sequential chain over K per element), and every linear
    of a mode engine runs that kernel, whatever the row count (here 300 rows, above none of the
    caps that apply without the mode: same bits as the rows one at a time)."""
    from rlserve import envs
    from rlserve.config import EngineConfig
    from rlserve.engine.cpu import cpu_threads

    monkeypatch.setattr(envs, "RLSERVE_CPU_TEAM", None)
    monkeypatch.setattr(cpu_threads, "usable_cpus", lambda: 2)
    assert cpu_threads.engine_team_size(EngineConfig(model="x", device="cpu", batch_invariant=True)) == 2
    lin = llm.engine.model.model.layers[0].mlp.down_proj
    x = torch.randn(300, lin.weight.shape[1], generator=torch.Generator().manual_seed(9))
    with bi_mode.active(True):
        got = lin.quant_method.apply(lin, x)
        one = torch.cat([lin.quant_method.apply(lin, x[i:i + 1]) for i in range(0, 300, 37)])
    fma = bi_cpu.fma_weight(lin)
    assert fma is not None
    assert torch.equal(got, cpu_gemm.linear(x, fma, lin.weight.shape[0]))
    assert torch.equal(got[::37], one)
