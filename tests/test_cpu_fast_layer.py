"""``rlserve.models.llama_cpu``: the CPU float32 decode step calling the kernels directly must
equal the module path bit for bit (same kernels, same arguments), be taken on decode steps
only, and step aside when switched off or when the fused kernels are off."""

from __future__ import annotations

import pytest
import torch

from rlserve.layers import fused_ops
from rlserve.layers.attention import AttentionMetadata
from rlserve.models import llama_cpu


@pytest.fixture
def fast_calls(monkeypatch):
    """Counts :func:`llama_cpu.layer_forward` calls; restores the on/off switch afterwards."""
    calls = []
    real = llama_cpu.layer_forward

    def counting(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(llama_cpu, "layer_forward", counting)
    prev = llama_cpu.set_enabled(True)
    yield calls
    llama_cpu.set_enabled(prev)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_fast_decode_equals_module_path(arch, tiny_model, fast_calls):
    """Greedy tokens and logprobs of a whole tiny model (prefill, prefix-cache hit, decode)
    are identical with the fast path on and off; on, every decode step's layers take it."""
    from rlserve import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6, logprobs=3)
    prompts = ["The capital of France is", "Hello world", "The capital of France is a"]
    path = tiny_model(arch)
    llama_cpu.set_enabled(False)  # a fresh engine each: a second generate would hit the prefix cache
    ref = LLM(path, dtype="float32", device="cpu", block_size=4).generate(prompts, params)
    assert fast_calls == []
    llama_cpu.set_enabled(True)
    llm = LLM(path, dtype="float32", device="cpu", block_size=4)
    got = llm.generate(prompts, params)
    n_layers = len(llm.engine.model.model.layers)
    assert fast_calls, "decode steps did not take the fast path"
    assert len(fast_calls) % n_layers == 0 and fast_calls[:n_layers] == list(llm.engine.model.model.layers)
    for a, b in zip(got, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # bit-equal, not close


def _decode_meta(batch: int) -> AttentionMetadata:
    return AttentionMetadata.build([1] * batch, [5] * batch, [[i] * 2 for i in range(batch)], 4)


def test_step_context_only_for_cpu_float32_decode(tiny_model):
    from rlserve import LLM

    llm = LLM(tiny_model("llama"), dtype="float32", device="cpu", block_size=4)
    llm.generate(["warm up"])  # binds the KV cache
    model = llm.engine.model.model
    layers = model.layers
    h = torch.zeros(2, model.embed_tokens.weight.shape[1])
    pos = torch.tensor([4, 4])
    assert llama_cpu.step_context(layers, h, pos, _decode_meta(2)) is not None
    prefill = AttentionMetadata.build([2, 1], [5, 5], [[0, 1], [2, 3]], 4)
    assert llama_cpu.step_context(layers, torch.zeros(3, h.shape[1]), torch.tensor([3, 4, 4]), prefill) is None
    assert llama_cpu.step_context(layers, h.double(), pos, _decode_meta(2)) is None
    prev = llama_cpu.set_enabled(False)
    try:
        assert llama_cpu.step_context(layers, h, pos, _decode_meta(2)) is None
    finally:
        llama_cpu.set_enabled(prev)
    prev_fused = fused_ops.set_fused_kernels(False)
    try:
        assert llama_cpu.step_context(layers, h, pos, _decode_meta(2)) is None
    finally:
        fused_ops.set_fused_kernels(*prev_fused)

