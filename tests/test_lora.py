"""LoRA adapters served per request on the CPU path (rlserve.lora): a batch mixing the base model
and several PEFT adapters gives, per request, the greedy tokens and logprobs of PEFT's merged
Hugging Face model (float32); prefix-cache entries are per adapter load; bad adapters are refused
before anything is loaded."""

from __future__ import annotations

import json
import os

import pytest
import torch

from rlserve import LLM, SamplingParams
from rlserve.errors import InvalidRequestError, LoRAAdapterError, LoRAAdapterNotFoundError
from rlserve.lora.model import lora_of
from tests.lora_adapters import hf_greedy_logprobs, make_adapter, merged_model

PROMPTS = ["The capital of France is", "Hello world! Hello there", "Once upon a time there was"]
NEW_TOKENS = 10
# Logprob tolerance: the engine computes x W^T + (x A^T) B'^T, PEFT's merged model x (W + B'A)^T;
# both float32, so they differ by summation order only (~1e-6 relative on logits of O(1-10));
# 1e-4 is the bound tests/test_engine.py uses against Hugging Face for the base model.
LP_ATOL = 1e-4


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    out = {}
    for arch in ("llama", "qwen3"):
        base = tiny_model(arch)
        d = tmp_path_factory.mktemp(f"lora-{arch}")
        a1 = make_adapter(base, d / "a1", seed=1, r=8, alpha=16)
        a2 = make_adapter(base, d / "a2", seed=2, r=16, alpha=8, targets=["q_proj", "v_proj", "o_proj"],
                          use_rslora=True)
        a3 = make_adapter(base, d / "a3", seed=3, r=4, alpha=4, targets=["gate_proj", "down_proj"])
        llm = LLM(base, dtype="float32", device="cpu", enable_lora=True, max_loras=4, max_lora_rank=16,
                  block_size=4)
        out[arch] = (base, {1: a1, 2: a2, 3: a3}, llm)
    return out


def _params(adapter_id: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0, lora_int_id=adapter_id)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mixed_batch_matches_peft_merged(arch, setup):
    base, adapters, llm = setup[arch]
    lora = lora_of(llm.engine.model)
    for i, path in adapters.items():
        if not lora.has(i):
            lora.load(i, path)
    # every prompt under the base model and each adapter, all in one generate call (one batch)
    ids = [0, 1, 2, 3]
    prompts = [p for p in PROMPTS for _ in ids]
    params = [_params(a) for _ in PROMPTS for a in ids]
    outs = llm.generate(prompts, params)
    refs = {a: merged_model(base, adapters.get(a)) for a in ids}
    seen_tokens = {}
    for o, p in zip(outs, params):
        want_ids, want_lps = hf_greedy_logprobs(refs[p.lora_int_id], o.prompt_token_ids, NEW_TOKENS)
        c = o.outputs[0]
        assert list(c.token_ids) == want_ids, (p.lora_int_id, o.prompt)
        got_lps = [c.logprobs[i][t] for i, t in enumerate(c.token_ids)]
        torch.testing.assert_close(torch.tensor(got_lps), torch.tensor(want_lps), atol=LP_ATOL, rtol=0)
        seen_tokens.setdefault(o.prompt, set()).add(tuple(c.token_ids))
    # the adapters change the outputs (else the test above could not tell them apart)
    assert all(len(v) >= 3 for v in seen_tokens.values()), seen_tokens


def test_prefix_cache_is_per_adapter(setup):
    base, adapters, llm = setup["llama"]
    lora = lora_of(llm.engine.model)
    for i, path in adapters.items():
        if not lora.has(i):
            lora.load(i, path)
    bm = llm.engine.block_manager
    llm.engine.reset_prefix_cache()  # nothing cached from the other tests
    prompt = "Hello world! Hello there, how are you today? I am fine"
    llm.generate([prompt], [_params(0)])
    hits0 = bm.prefix_hit_tokens
    adapted = llm.generate([prompt], [_params(1)])[0]
    assert bm.prefix_hit_tokens == hits0  # KV computed on the base model is not reused under adapter 1
    again = llm.generate([prompt], [_params(1)])[0]
    assert bm.prefix_hit_tokens > hits0  # ... but under the same adapter it is
    assert again.outputs[0].token_ids == adapted.outputs[0].token_ids
    # a new load of the same files is a new id: no reuse of id 1's blocks
    lora.load(7, adapters[1])
    before = bm.prefix_hit_tokens
    reloaded = llm.generate([prompt], [_params(7)])[0]
    assert bm.prefix_hit_tokens == before
    assert reloaded.outputs[0].token_ids == adapted.outputs[0].token_ids
    lora.remove(7)


def test_request_on_unknown_adapter_is_refused(setup):
    _, _, llm = setup["llama"]
    with pytest.raises(InvalidRequestError, match="LoRA adapter id 99 is not loaded"):
        llm.generate(["Hello"], [_params(99)])


def test_bad_adapters_are_refused(setup, tmp_path):
    base, adapters, llm = setup["llama"]
    lora = lora_of(llm.engine.model)
    held = dict(lora.adapters)
    with pytest.raises(LoRAAdapterNotFoundError, match="No adapter found for"):
        lora.load(50, str(tmp_path / "missing"))
    big = make_adapter(base, tmp_path / "big", seed=4, r=32)
    with pytest.raises(LoRAAdapterError, match="LoRA rank 32 is greater than max_lora_rank 16"):
        lora.load(51, big)
    dora = make_adapter(base, tmp_path / "dora", seed=5, r=4, use_dora=True)
    with pytest.raises(LoRAAdapterError, match="DoRA"):
        lora.load(52, dora)
    # a config whose rank disagrees with its tensors
    bad = tmp_path / "bad"
    os.makedirs(bad)
    for f in ("adapter_model.safetensors",):
        with open(os.path.join(adapters[1], f), "rb") as src, open(bad / f, "wb") as dst:
            dst.write(src.read())
    cfg = json.load(open(os.path.join(adapters[1], "adapter_config.json")))
    cfg["r"] = 4
    json.dump(cfg, open(bad / "adapter_config.json", "w"))
    with pytest.raises(LoRAAdapterError, match=r"expected \(4, "):
        lora.load(53, str(bad))
    assert lora.adapters == held  # nothing was loaded by the refused calls



def _variant(src: str, dst, cfg: dict | None = None, raw_cfg: bytes | None = None, factor: float | None = None,
             dtype: torch.dtype | None = None) -> str:
    """A copy of the adapter directory ``src`` at ``dst`` with config keys ``cfg`` replaced (or the
    config file's bytes ``raw_cfg``), the first ``lora_B`` filled with ``factor``, every tensor
    cast to ``dtype``."""
    from safetensors.torch import load_file, save_file

    os.makedirs(dst)
    tensors = load_file(os.path.join(src, "adapter_model.safetensors"))
    if factor is not None:
        tensors[next(k for k in sorted(tensors) if "lora_B" in k)].fill_(factor)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    save_file(tensors, os.path.join(dst, "adapter_model.safetensors"))
    c = json.load(open(os.path.join(src, "adapter_config.json")))
    c.update(cfg or {})
    with open(os.path.join(dst, "adapter_config.json"), "wb") as f:
        f.write(raw_cfg if raw_cfg is not None else json.dumps(c).encode())
    return str(dst)


def test_malformed_configs_and_overflowing_factors_are_refused(setup, tmp_path):
    """PEFT's LoraConfig keeps whatever the JSON holds: a rank or lora_alpha of the wrong type
    raised ValueError / TypeError inside the engine (HTTP 500), and a finite lora_alpha or factor
    whose fold ``B * lora_alpha / r`` overflows float32 was served (every logprob NaN); float8
    factors raised NotImplementedError. Fails on the old code (r "abc" raised ValueError;
    lora_alpha 1e308 and a 3e38 factor were loaded)."""
    _, adapters, llm = setup["llama"]  # a1: r 8, alpha 16 (scaling 2), float32
    lora = lora_of(llm.engine.model)
    held = dict(lora.adapters)
    cases = [({"r": "abc"}, None, None, "r must be an integer, got 'abc'"),
             ({"r": None}, None, None, "r must be an integer, got None"),
             ({"r": 8.5}, None, None, "r must be an integer, got 8.5"),
             ({"r": True}, None, None, "r must be an integer, got True"),
             ({"lora_alpha": "x"}, None, None, "lora_alpha must be a finite number, got 'x'"),
             ({"lora_alpha": float("nan")}, None, None, "lora_alpha must be a finite number, got nan"),
             ({"lora_alpha": 1e308}, None, None, "once scaled by 1.25e\\+307 and served in torch.float32"),
             # 3e38 is a finite float32; times the scaling 2 it is not
             ({}, None, 3e38, "magnitude 6e\\+38 once scaled by 2 and served in torch.float32"),
             ({}, b'{"peft_type": "LORA", "r": 8, "x": "\xff"}', None, "is not valid JSON")]
    for i, (cfg, raw, factor, words) in enumerate(cases):
        path = _variant(adapters[1], tmp_path / f"v{i}", cfg, raw, factor)
        with pytest.raises(LoRAAdapterError, match=words):
            lora.load(60 + i, path)
    # float8 factors: isfinite has no float8 kernel on the CPU (NotImplementedError, an HTTP 500)
    for i, dtype in enumerate((torch.float8_e4m3fn, torch.int32)):
        path = _variant(adapters[1], tmp_path / f"d{i}", dtype=dtype)
        with pytest.raises(LoRAAdapterError, match=f"lora_A of {dtype} and lora_B of {dtype}; factors must be one of"):
            lora.load(80 + i, path)
    assert lora.adapters == held


def test_offline_lora_request(setup):
    """vLLM's offline ``generate(..., lora_request=LoRARequest(name, id, path))``: the adapter is read
    at its id's first use; a list picks one per prompt (None: the base model)."""
    from rlserve.lora.request import LoRARequest

    base, adapters, llm = setup["llama"]
    lora = lora_of(llm.engine.model)
    for i, path in adapters.items():
        if not lora.has(i):
            lora.load(i, path)
    p = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], [_params(2), _params(0)])]
    req = LoRARequest("a2-again", 12, adapters[2])
    got = llm.generate(PROMPTS[:2], p, lora_request=[req, None])
    assert [o.outputs[0].token_ids for o in got] == want and lora.has(12)
    assert llm.generate(PROMPTS[0], p, lora_request=req)[0].outputs[0].token_ids == want[0]
    with pytest.raises(LoRAAdapterError, match="lora_int_id must be an integer >= 1"):
        llm.generate(PROMPTS[0], p, lora_request=LoRARequest("x", 0, adapters[2]))
    lora.remove(12)


@pytest.mark.parametrize("arch,targets", [("qwen2", None), ("opt", ["q_proj", "k_proj", "v_proj", "out_proj",
                                                                   "fc1", "fc2"])])
def test_other_architectures(arch, targets, tiny_model, tmp_path):
    """Qwen2 (q/k/v biases) and OPT (its own projection names, unpacked q/k/v): base + one adapter in
    one batch = PEFT's merged model."""
    base = tiny_model(arch)
    path = make_adapter(base, tmp_path / "a", seed=5, r=8, targets=targets)
    llm = LLM(base, dtype="float32", device="cpu", enable_lora=True, max_loras=1, max_lora_rank=8)
    lora_of(llm.engine.model).load(1, path)
    params = [_params(0), _params(1)]
    outs = llm.generate([PROMPTS[0]] * 2, params)
    for o, p in zip(outs, params):
        want_ids, want_lps = hf_greedy_logprobs(merged_model(base, path if p.lora_int_id else None),
                                                o.prompt_token_ids, NEW_TOKENS)
        c = o.outputs[0]
        assert list(c.token_ids) == want_ids
        torch.testing.assert_close(torch.tensor([c.logprobs[i][t] for i, t in enumerate(c.token_ids)]),
                                   torch.tensor(want_lps), atol=LP_ATOL, rtol=0)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids


def test_fast_decode_layer_is_kept_for_base_steps(setup):
    """With adapters loaded, a step with every row on the base model still takes the CPU fast decode
    layer (which calls kernels directly and would skip a hook); a step with adapters right after it
    does not, even one shaped like a decode step: a prompt whose blocks but its last token are in the
    prefix cache (block size 4, 9 tokens) computes one token per sequence, as a decode step does."""
    base, adapters, llm = setup["llama"]
    lora = lora_of(llm.engine.model)
    for i, path in adapters.items():
        if not lora.has(i):
            lora.load(i, path)
    layers = llm.engine.model.model.layers
    cached = [list(range(3, 12)), list(range(12, 21))]  # two rows: inside the packed-linear row range everywhere
    first = llm.generate(cached, [_params(1), _params(1)])
    base_out = llm.generate(PROMPTS[:2], [_params(0), _params(0)])
    if any("_cpu_fast_ok" not in layer.__dict__ for layer in layers):
        pytest.skip("the CPU fast decode layer does not apply on this machine (C kernels / oneDNN missing)")
    assert all(layer.__dict__["_cpu_fast_ok"] for layer in layers)
    hits = llm.engine.block_manager.prefix_hit_tokens
    again = llm.generate(cached, [_params(1), _params(1)])
    assert llm.engine.block_manager.prefix_hit_tokens - hits == 16  # 8 of 9 tokens of each prompt
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    for o in first:
        want, _ = hf_greedy_logprobs(merged_model(base, adapters[1]), o.prompt_token_ids, NEW_TOKENS)
        assert list(o.outputs[0].token_ids) == want
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], [_params(0), _params(0)])] == \
        [o.outputs[0].token_ids for o in base_out]
    assert all(layer.__dict__.get("_cpu_fast_ok") for layer in layers)


def test_lora_config_is_checked_at_start():
    """--enable-lora with tensor parallelism is refused before anything loads (TP > 1 with adapters is
    not built: the slot buffers and kernels hold whole layers; the NCCL adapter sync's test,
    tests/gpu/test_lora_gpu.py::test_adapter_sync_over_nccl, skips on one GPU); so are ranks that are
    not vLLM's and no adapter slots."""
    from rlserve.config import EngineConfig
    from rlserve.errors import InvalidRequestError

    for kw, words in (({"enable_lora": True, "tensor_parallel_size": 2}, "needs --tensor-parallel-size 1"),
                      ({"enable_lora": True, "max_lora_rank": 48}, "max_lora_rank must be one of"),
                      ({"enable_lora": True, "max_loras": 0}, "max_loras must be >= 1")):
        with pytest.raises(InvalidRequestError, match=words):
            EngineConfig(model="unused", **kw)


def test_llm_enable_lora_without_peft_fails_at_construction(tiny_model, monkeypatch):
    """``LLM(path, enable_lora=True)`` without PEFT: one ImportError naming the extra, before any
    engine starts (the check ``rlserve serve --enable-lora`` makes: rlserve.lora.require_peft). The
    old code built the engine and failed at the first adapter load (ModuleNotFoundError: peft)."""
    import importlib.util

    from rlserve.engine import llm as llm_module

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    monkeypatch.setattr(llm_module, "LLMEngine", lambda *a, **k: pytest.fail("the engine was started"))
    with pytest.raises(ImportError) as ei:
        llm_module.LLM(tiny_model("llama"), device="cpu", enable_lora=True)
    assert str(ei.value) == "enable_lora=True needs the peft package: pip install 'rlserve[lora]'"
