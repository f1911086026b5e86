"""The C kernels of ``rlserve.layers.cpu_fused`` (what ``fused_ops`` runs on float32 CPU
tensors) against the PyTorch code they replace: ``RMSNorm``, ``SiluAndMul``, q/k norm +
``RotaryEmbedding`` + ``write_kv_cache``, and whole tiny models (greedy tokens and logprobs
with and without them; HF agreement is ``tests/test_models.py``'s, which runs them)."""

from __future__ import annotations

import pytest
import torch

from rlserve.layers import cpu_fused, fused_ops
from rlserve.layers.activation import SiluAndMul
from rlserve.layers.attention import write_kv_cache
from rlserve.layers.norm import RMSNorm
from rlserve.layers.rotary import RotaryEmbedding

ULP = 2.0 ** -23


@pytest.fixture
def reference():
    """Yields a switch: ``reference(True)`` runs the callers' PyTorch code, ``False`` the C
    kernels (the default on CPU)."""
    assert cpu_fused.available(), "a C compiler is on this machine: the kernels must build"
    prev = fused_ops.set_fused_kernels(True)
    yield lambda on: fused_ops.set_fused_kernels(not on)
    fused_ops.set_fused_kernels(*prev)


def assert_ulps(got, ref, ulps, scale=0.0):
    """``got`` within ``ulps`` units in the last place of ``ref``, or of ``scale`` where a
    sum cancelled (the inputs' magnitude bounds the error there)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype
    err = (got - ref).abs()
    tol = ulps * ULP * (ref.abs() + scale) + 1e-7
    assert (err <= tol).all(), (err - tol).max().item()


@pytest.mark.parametrize("N", [7, 64, 576])
@pytest.mark.parametrize("threads", [1, 2])
def test_rms_norm(N, threads, reference):
    g = torch.Generator().manual_seed(N)
    norm = RMSNorm(N, eps=1e-5)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(N, generator=g))
    x = torch.randn(300, N, generator=g)[:, :N]
    r = torch.randn(300, 2 * N, generator=g)[:, N:]  # a strided residual
    reference(True)
    ref, ref_res = norm(x, r)
    ref_plain = norm(x)
    reference(False)
    assert fused_ops.fused_enabled(x)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, res = norm(x, r)
        plain = norm(x)
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(res, ref_res)  # the residual sum is rounded exactly like x + r
    assert_ulps(out, ref, 4)  # only the order of the float32 mean differs
    assert_ulps(plain, ref_plain, 4)
    assert fused_ops.rms_norm(x[:0], norm.weight, 1e-5).shape == (0, N)


@pytest.mark.parametrize("d", [5, 80, 1536])
def test_silu_and_mul(d, reference):
    g = torch.Generator().manual_seed(d)
    x = 4 * torch.randn(3, 7, 2 * d, generator=g)
    x[0, 0, :4] = torch.tensor([-120.0, 100.0, 0.0, -0.0])  # saturated exp, zeros
    reference(True)
    ref = SiluAndMul()(x)
    reference(False)
    out = SiluAndMul()(x)
    assert torch.isfinite(out).all()
    assert_ulps(out, ref, 4)


@pytest.mark.parametrize("qk_norm,head_dim,rotary_dim", [(True, 64, 64), (False, 64, 64), (False, 48, 24)])
def test_qkv_norm_rope_write(qk_norm, head_dim, rotary_dim, reference):
    H, Hkv, T, P, nb = 9, 3, 6, 4, 8
    g = torch.Generator().manual_seed(head_dim + rotary_dim + qk_norm)
    qkv = torch.randn(T, (H + 2 * Hkv) * head_dim + 3, generator=g)[:, 3:]  # strided rows
    pos = torch.tensor([0, 1, 2, 7, 30, 63])
    slots = torch.tensor([5, 6, -1, 9, 20, 31])  # -1: a padding row writes nothing
    rope = RotaryEmbedding(head_dim, rotary_dim, 64, {"rope_type": "default", "rope_theta": 10000.0})
    qn, kn = RMSNorm(head_dim, 1e-6), RMSNorm(head_dim, 1e-6)
    qn.weight.data.copy_(1 + 0.2 * torch.randn(head_dim, generator=g))
    kn.weight.data.copy_(1 + 0.2 * torch.randn(head_dim, generator=g))

    reference(True)  # op by op, as LlamaAttention does without fused kernels
    q, k, v = qkv.split([H * head_dim, Hkv * head_dim, Hkv * head_dim], dim=-1)
    if qk_norm:
        q = qn(q.reshape(T, H, head_dim)).reshape(T, -1)
        k = kn(k.reshape(T, Hkv, head_dim)).reshape(T, -1)
    q_ref, k_ref = rope(pos, q, k)
    kc_ref = torch.full((nb, P, Hkv, head_dim), 7.0)
    vc_ref = kc_ref.clone()
    write_kv_cache(k_ref.view(T, Hkv, head_dim), v.reshape(T, Hkv, head_dim), kc_ref, vc_ref, slots)

    reference(False)
    kc, vc = torch.full_like(kc_ref, 7.0), torch.full_like(vc_ref, 7.0)
    q_out = fused_ops.qkv_norm_rope_write(qkv, pos, rope.cos_cache, rope.sin_cache, H, Hkv, head_dim, kc, vc, slots,
                                          qn.weight if qk_norm else None, kn.weight if qk_norm else None, 1e-6)
    if qk_norm:
        assert_ulps(q_out, q_ref, 8, scale=4.0)  # the normed inputs are O(1)
        assert_ulps(kc, kc_ref, 8, scale=4.0)
    else:  # rotary alone rounds exactly as PyTorch does
        assert torch.equal(q_out, q_ref) and torch.equal(kc, kc_ref)
    assert torch.equal(vc, vc_ref)
    with pytest.raises(ValueError):
        fused_ops.qkv_norm_rope_write(qkv, pos, rope.cos_cache, rope.sin_cache, H, Hkv, head_dim, kc.double(),
                                      vc.double(), slots)


def test_other_dtypes_keep_pytorch(reference):
    reference(False)
    assert not fused_ops.fused_enabled(torch.zeros(2, 8, dtype=torch.bfloat16))
    assert fused_ops.fused_enabled(torch.zeros(2, 8))
    reference(True)
    assert not fused_ops.fused_enabled(torch.zeros(2, 8))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_model_with_kernels_equals_pytorch_path(arch, tiny_model, reference):
    """A whole tiny model in float32 (prefill, prefix-cache hit, decode): greedy tokens equal
    and logprobs within 1e-5 with the C kernels and with the PyTorch code."""
    from rlserve import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6, logprobs=2)
    prompts = ["The capital of France is", "Hello world", "The capital of France is a"]
    path = tiny_model(arch)
    reference(True)
    ref = LLM(path, dtype="float32", device="cpu", block_size=4).generate(prompts, params)
    reference(False)
    got = LLM(path, dtype="float32", device="cpu", block_size=4).generate(prompts, params)
    for a, b in zip(got, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for da, db in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for t in db:
                assert abs(da[t] - db[t]) < 1e-5


def test_weight_sync_is_served_with_the_kernels(tiny_model, tmp_path, reference):
    """After a weight update (the engine's load path that every sync ends in), the CPU path
    (C kernels, native decode attention, oneDNN LM head) serves the new weights: greedy
    tokens equal HF transformers float32 on the new checkpoint, before and after."""
    from rlserve import LLM, SamplingParams
    from rlserve.loader import iterate_checkpoint
    from tests.test_engine import hf_greedy
    from tests.tiny_models import make_tiny_model

    reference(False)
    old, new = tiny_model("llama"), make_tiny_model("llama", tmp_path / "new", seed=1)
    llm = LLM(old, dtype="float32", device="cpu", block_size=4)
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    prompts = [[5, 9, 13, 2, 7], [3, 3, 8]]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert before == hf_greedy(old, prompts, 8)
    llm.engine.load_weights(iterate_checkpoint(new))
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert after == hf_greedy(new, prompts, 8)
    assert after != before  # the update changed what is served
