"""The fp8 KV cache (``--kv-cache-dtype fp8`` / ``fp8_e4m3`` / ``fp8_e5m2``) end to end on CPU,
through the torch reference backend (the CPU's fp8 path: correct, not fast; the C decode kernel
and the fused C writer take float32 caches only and step aside): block count, the logprobs of the
same tokens against the model-dtype cache, greedy tokens, prefix caching, ``--calculate-kv-scales``,
and refusals.

Where the tolerances come from: rounding to e4m3 keeps 3 mantissa bits, a relative error of at
most 2^-4 per cached element (e5m2: 2 bits, 2^-3). Each layer's attention reads K and V with
that relative error, so its output, and through it each logit, moves by at most about that
fraction of the attention's contribution; a logprob difference between two tokens is a logit
difference, so the bound used is ``2^-4 x`` (the largest minus the smallest logprob the
model-dtype run gives the prompt's tokens) for e4m3 and ``2^-3 x`` that for e5m2. Measured on
these tiny models: 0.0046 / 0.0068 (e4m3, llama / qwen3) and 0.012 / 0.026 (e5m2) nats.
"""

from __future__ import annotations

import pytest
import torch

from rlserve import LLM
from rlserve.config import EngineConfig
from rlserve.engine.sampling_params import SamplingParams
from rlserve.errors import InvalidRequestError
from rlserve.layers import kv_quant

PROMPTS = [[(7 * i + 3) % 200 + 5 for i in range(37)], [(11 * i + 1) % 190 + 9 for i in range(90)],
           [(5 * i + 2) % 150 + 20 for i in range(6)]]
REL_ERR = {"fp8": 2.0 ** -4, "fp8_e4m3": 2.0 ** -4, "fp8_e5m2": 2.0 ** -3}


def _llm(path, kv_cache_dtype, **kw):
    return LLM(path, dtype="float32", device="cpu", block_size=4, kv_cache_dtype=kv_cache_dtype, **kw)


def _prompt_logprobs(out) -> list[float]:
    return [next(iter(d.values())) for d in out.prompt_logprobs[1:]]


def test_fp8_cache_holds_four_times_the_float32_blocks(tiny_model):
    """Same bytes, 1 byte per element against float32's 4 (2x against bf16's 2)."""
    path = tiny_model("llama")
    nbytes = 4 << 20
    auto = _llm(path, "auto", kv_cache_bytes=nbytes)
    fp8 = _llm(path, "fp8", kv_cache_bytes=nbytes)
    n_auto, n_fp8 = auto.engine.executor.runner.num_blocks, fp8.engine.executor.runner.num_blocks
    per_block = auto.engine.executor.bytes_per_block()
    assert n_auto == nbytes // per_block and n_fp8 == nbytes // (per_block // 4)
    k, v = fp8.engine.executor.runner.kv_caches[0]
    assert k.dtype == v.dtype == torch.float8_e4m3fn and k.shape[0] == n_fp8
    layer = fp8.engine.executor.runner.attn_layers[0]
    assert layer.k_scale.tolist() == [1.0] and layer.v_scale.tolist() == [1.0]  # vLLM's default
    assert auto.engine.executor.runner.attn_layers[0].k_scale is None


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_fp8_logprobs_of_the_same_tokens_within_the_rounding_bound(tiny_model, arch, kv):
    """The model-dtype cache's greedy completions, scored by the fp8 engine (prompt logprobs of
    prompt + completion: the same tokens), within the bound of the module docstring; the fp8
    engine's own greedy tokens agree with the model-dtype run's, and where they part, that run's
    top-2 margin there is within twice the logprob error measured on that sequence (a near tie
    the rounding may flip; random tiny models have margins of 0.001-0.2 nats)."""
    path = tiny_model(arch)
    sp = SamplingParams(temperature=0, max_tokens=16, logprobs=2, prompt_logprobs=0)
    ref = _llm(path, "auto").generate(PROMPTS, sp)
    fp8 = _llm(path, kv)
    full = [p + list(o.outputs[0].token_ids) for p, o in zip(PROMPTS, ref)]
    ref_full = _llm(path, "auto").generate(full, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    got_full = fp8.generate(full, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    errs = []
    for a, b in zip(ref_full, got_full):
        la, lb = _prompt_logprobs(a), _prompt_logprobs(b)
        bound = REL_ERR[kv] * (max(la) - min(la))
        errs.append(max(abs(x - y) for x, y in zip(la, lb)))
        assert 0 < errs[-1] <= bound, (errs[-1], bound)  # > 0: the fp8 cache is really in use
    compared = 0
    for r, g, err in zip(ref, fp8.generate(PROMPTS, sp), errs):
        for tok_r, tok_g, lp in zip(r.outputs[0].token_ids, g.outputs[0].token_ids, r.outputs[0].logprobs):
            if tok_r != tok_g:  # only at a near tie, which the measured error may flip
                top = sorted(lp.values(), reverse=True)
                assert top[0] - top[1] <= 2 * err, (top, err)
                break
            compared += 1
    assert compared >= 24  # of 48: the completions mostly agree


def test_prefix_cache_hit_reads_the_same_fp8_blocks(tiny_model):
    """A prompt run again takes its full blocks from the prefix cache: same fp8 bytes, so the
    same logprobs, bit for bit."""
    llm = _llm(tiny_model("llama"), "fp8")
    sp = SamplingParams(temperature=0, max_tokens=8, logprobs=0)  # prompt logprobs would skip the cache
    first = llm.generate([PROMPTS[1]], sp)[0]
    hits = llm.engine.block_manager.prefix_hit_tokens
    second = llm.generate([PROMPTS[1]], sp)[0]
    assert llm.engine.block_manager.prefix_hit_tokens - hits == 88  # 22 full blocks of the 90-token prompt
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    assert first.outputs[0].logprobs == second.outputs[0].logprobs


def test_calculate_kv_scales_from_the_first_batch(tiny_model):
    """``--calculate-kv-scales``: after the first batch each layer's scales are max|k| / 200 and
    max|v| / 100 of that batch (vLLM's constants), no longer 1.0, and the logprobs stay within
    the e4m3 bound of the module docstring."""
    path = tiny_model("qwen3")
    llm = _llm(path, "fp8", calculate_kv_scales=True)
    layers = llm.engine.executor.runner.attn_layers
    assert all(layer.k_scale.tolist() == [1.0] and layer.calculate_kv_scales for layer in layers)
    captured = {}

    def hook(module, args):
        if module.calculate_kv_scales:
            captured[module] = (args[1].abs().max().item(), args[2].abs().max().item())

    handles = [layer.register_forward_pre_hook(hook) for layer in layers]
    sp = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0)
    out = llm.generate([PROMPTS[1]], sp)[0]
    for h in handles:
        h.remove()
    assert len(captured) == len(layers)
    for layer in layers:
        kmax, vmax = captured[layer]
        assert not layer.calculate_kv_scales
        assert layer.k_scale.item() == pytest.approx(kmax / 200, rel=1e-6)
        assert layer.v_scale.item() == pytest.approx(vmax / 100, rel=1e-6)
    ref = _llm(path, "auto").generate([PROMPTS[1]], sp)[0]
    la, lb = _prompt_logprobs(ref), _prompt_logprobs(out)
    assert max(abs(x - y) for x, y in zip(la, lb)) <= 2.0 ** -4 * (max(la) - min(la))


def test_bad_values_are_refused_precisely():
    with pytest.raises(InvalidRequestError, match=r"kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2 "
                                                  r"\(vLLM's values\), got 'int8'"):
        EngineConfig(model="x", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        kv_quant.cache_dtype("fp16", torch.float32)
    assert kv_quant.cache_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    assert kv_quant.cache_dtype("auto", torch.bfloat16) == torch.bfloat16


def test_batch_invariant_refuses_fp8(tiny_model):
    with pytest.raises(ValueError, match=r"--batch-invariant does not cover --kv-cache-dtype fp8 yet"):
        _llm(tiny_model("llama"), "fp8", batch_invariant=True)


def test_quantize_saturates_and_rounds_to_the_fp8_grid():
    x = torch.tensor([1e6, -1e6, 0.1, 3.3, -7.9])
    q = kv_quant.quantize(x, torch.tensor([0.5]), torch.float8_e4m3fn)
    assert q.float().tolist()[:2] == [448.0, -448.0]  # saturated, not nan / inf
    back = kv_quant.dequantize(q, torch.tensor([0.5]), torch.float32)
    assert ((back[2:] - x[2:]).abs() <= 2.0 ** -4 * x[2:].abs()).all()  # e4m3's half-ulp bound
    e5 = kv_quant.quantize(torch.tensor([1e6]), torch.tensor([1.0]), torch.float8_e5m2)
    assert e5.float().item() == 57344.0


def test_server_info_and_metrics_name_the_cache_dtype():
    """``/server_info``'s ``cache_config`` and ``vllm:cache_config_info``'s labels carry
    ``--kv-cache-dtype`` as given (vLLM's ``CacheConfig.cache_dtype``)."""
    from types import SimpleNamespace

    from rlserve.server.metrics import cache_config_info
    from rlserve.server.server_info import vllm_config

    cfg = EngineConfig(model="m", kv_cache_dtype="fp8_e5m2", calculate_kv_scales=True)
    assert cache_config_info(cfg, {"num_kv_blocks": 64})["cache_dtype"] == "fp8_e5m2"
    settings = SimpleNamespace(model="m", model_impl="auto", generation_config="auto", weight_transfer_config=None)
    state = SimpleNamespace(aengine=SimpleNamespace(config=cfg, engine=SimpleNamespace(dtype=torch.bfloat16)),
                            settings=settings, model_name="m", max_model_len=128, max_logprobs=20, vocab_size=10)
    cc = vllm_config(state)["cache_config"]
    assert cc["cache_dtype"] == "fp8_e5m2" and cc["calculate_kv_scales"] is True
