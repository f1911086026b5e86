"""The fused Triton kernels (``rlserve.layers.fused_ops``) compiled on a CUDA GPU.

- bf16 / fp16 / fp32, Qwen3-0.6B and SmolLM2 layer shapes: each kernel against the op-by-op
  PyTorch code it replaces, on the same GPU. The kernels round where that code rounds, so
  the residual sum and the values copied to the cache are equal, and every other result is
  within two units in the last place: ``rsqrt`` / ``exp`` and the order of the norm's float32
  mean may move an intermediate across a rounding boundary (one unit), which the following
  rounded multiply can carry into the output (a second unit). Seen on an H200: 8 of 1.2M
  fp16 norm outputs 1.5 units off, none beyond.
- the engine in float32 with CUDA graphs: greedy tokens and logprobs with the fused kernels
  equal those without (``tests/gpu/test_gpu_engine.py`` checks the fused default against
  Hugging Face).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from rlserve.layers import fused_ops  # noqa: E402
from rlserve.layers.activation import SiluAndMul  # noqa: E402
from rlserve.layers.attention import write_kv_cache  # noqa: E402
from rlserve.layers.norm import RMSNorm  # noqa: E402
from rlserve.layers.rotary import RotaryEmbedding  # noqa: E402

DEV = torch.device("cuda")
EPS_OF = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


@pytest.fixture
def fused_switch():
    prev = fused_ops.set_fused_kernels(True)
    yield fused_ops.set_fused_kernels
    fused_ops.set_fused_kernels(*prev)


def assert_within_ulp(got, ref, dtype, ulps):
    """|got - ref| <= ulps x eps(dtype) x |ref| (+ a floor for values near 0)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype
    err = (got.float() - ref.float()).abs()
    tol = ulps * EPS_OF[dtype] * ref.float().abs() + (1e-6 if dtype == torch.float32 else 1e-3 * EPS_OF[dtype])
    bad = err > tol
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} differ beyond {ulps} ulp; max excess {(err - tol).max()}"


DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,N", [(1, 1024), (37, 576), (300, 4096)])
def test_rms_norm(dtype, T, N, fused_switch):
    g = torch.Generator(device=DEV).manual_seed(T + N)
    norm = RMSNorm(N, eps=1e-6, params_dtype=dtype).to(DEV)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(N, generator=g, device=DEV))
    x = (4 * torch.randn(T, N, generator=g, device=DEV)).to(dtype)
    r = (4 * torch.randn(T, N, generator=g, device=DEV)).to(dtype)
    fused_switch(False)
    ref, ref_res = norm(x, r)
    ref_plain = norm(x)
    fused_switch(True)
    out, res = norm(x, r)
    assert torch.equal(res, ref_res)
    assert_within_ulp(out, ref, dtype, ulps=2.0)
    assert_within_ulp(norm(x), ref_plain, dtype, ulps=2.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,d", [(1, 3072), (300, 1536), (5, 12288)])
def test_silu_and_mul(dtype, T, d, fused_switch):
    g = torch.Generator(device=DEV).manual_seed(d)
    x = (3 * torch.randn(T, 2 * d, generator=g, device=DEV)).to(dtype)
    fused_switch(False)
    ref = SiluAndMul()(x)
    fused_switch(True)
    # float32: Triton's exp is the hardware's approximate exp2 (a few float32 units off the
    # libm expf PyTorch uses; seen on an H200: 1 of 460,800 outputs just past 2 units)
    assert_within_ulp(SiluAndMul()(x), ref, dtype, ulps=8.0 if dtype == torch.float32 else 2.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,Hkv,D,qk_norm", [(16, 8, 128, True), (9, 3, 64, False), (4, 4, 80, True)])
def _qkv_case(dtype, H, Hkv, D, T, nb, P=16):
    """Inputs of ``fused_ops.qkv_norm_rope_write``: qkv, positions, slots (row 3 padding),
    q/k norm weights and a rotary embedding (seeded by the shape)."""
    g = torch.Generator(device=DEV).manual_seed(H * D)
    qkv = (2 * torch.randn(T, (H + 2 * Hkv) * D, generator=g, device=DEV)).to(dtype)
    pos = torch.randint(0, 4000, (T,), generator=g, device=DEV)
    slots = torch.randperm(nb * P, generator=g, device=DEV)[:T]
    slots[3] = -1  # a padding row
    qw = (1 + 0.2 * torch.randn(D, generator=g, device=DEV)).to(dtype)
    kw = (1 + 0.2 * torch.randn(D, generator=g, device=DEV)).to(dtype)
    with torch.device(DEV):
        rope = RotaryEmbedding(D, D, 4096, {"rope_type": "default", "rope_theta": 1e6})
    return qkv, pos, slots, qw, kw, rope


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,Hkv,D,qk_norm", [(32, 8, 128, True), (9, 3, 64, False), (4, 4, 80, True)])
def test_qkv_norm_rope_write_heads_per_program_bit_identical(dtype, H, Hkv, D, qk_norm, fused_switch, monkeypatch):
    """Decode batches take several heads of a token per program: the same queries, keys and
    values, bit for bit, as one program per token and head (8 heads; 4: tiles that mix query
    and key heads for the 9/3 layout, and a partly empty last tile)."""
    T, nb = 256, 32
    qkv, pos, slots, qw, kw, rope = _qkv_case(dtype, H, Hkv, D, T, nb)
    out = {}
    for heads in (1, 4, 8):
        monkeypatch.setattr(fused_ops, "_QKV_HEADS_PER_PROGRAM", heads)
        kc = torch.full((nb, 16, Hkv, D), 5.0, dtype=dtype, device=DEV)
        vc = torch.full_like(kc, 5.0)
        q = fused_ops.qkv_norm_rope_write(qkv, pos, rope.cos_cache, rope.sin_cache, H, Hkv, D, kc, vc, slots,
                                          qw if qk_norm else None, kw if qk_norm else None, 1e-6)
        out[heads] = (q, kc, vc)
    for heads in (4, 8):
        for a, b in zip(out[heads], out[1]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,Hkv,D,qk_norm", [(16, 8, 128, True), (9, 3, 64, False), (4, 4, 80, True)])
def test_qkv_norm_rope_write(dtype, H, Hkv, D, qk_norm, fused_switch):
    T, P, nb = 57, 16, 16
    qkv, pos, slots, qw, kw, rope = _qkv_case(dtype, H, Hkv, D, T, nb, P)
    fused_switch(False)
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    if qk_norm:
        qn, kn = RMSNorm(D, 1e-6, dtype).to(DEV), RMSNorm(D, 1e-6, dtype).to(DEV)
        qn.weight.data.copy_(qw)
        kn.weight.data.copy_(kw)
        q = qn(q.reshape(T, H, D)).reshape(T, -1)
        k = kn(k.reshape(T, Hkv, D)).reshape(T, -1)
    q_ref, k_ref = rope(pos, q, k)
    kc_ref = torch.full((nb, P, Hkv, D), 5.0, dtype=dtype, device=DEV)
    vc_ref = kc_ref.clone()
    write_kv_cache(k_ref.view(T, Hkv, D), v.reshape(T, Hkv, D), kc_ref, vc_ref, slots)
    fused_switch(True)
    kc, vc = torch.full_like(kc_ref, 5.0), torch.full_like(vc_ref, 5.0)
    q_out = fused_ops.qkv_norm_rope_write(qkv, pos, rope.cos_cache, rope.sin_cache, H, Hkv, D, kc, vc, slots,
                                          qw if qk_norm else None, kw if qk_norm else None, 1e-6)
    assert_within_ulp(q_out, q_ref, dtype, ulps=2.0)
    assert_within_ulp(kc, kc_ref, dtype, ulps=2.0)
    assert torch.equal(vc, vc_ref)


@pytest.mark.parametrize("arch", ["qwen3", "llama", "smollm"])
def test_engine_fused_equals_unfused_with_graphs(arch, tiny_model, fused_switch):
    from rlserve import LLM, SamplingParams

    from tests.gpu.test_gpu_engine import KW, PROMPTS

    path = tiny_model(arch)
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24, logprobs=3)
    runs = {}
    for on in (False, True):
        fused_switch(on)
        llm = LLM(path, dtype="float32", **KW)
        assert llm.engine.executor.runner.cuda_graphs is not None  # captured at startup
        runs[on] = llm.generate(PROMPTS, params)
        del llm
        torch.cuda.empty_cache()
    for a, b in zip(runs[True], runs[False]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for da, db in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for t in db:
                assert abs(da[t] - db[t]) < 1e-3


@pytest.mark.parametrize("B", [1, 64, 300])
def test_fused_sampling_greedy_equals_argmax_on_a_full_vocabulary(B):
    from rlserve.engine.core.sampler import Sampler, SamplingMetadata
    from rlserve.engine.sampling_params import SamplingParams

    V = 151936
    g = torch.Generator(device=DEV).manual_seed(B)
    logits = 5 * torch.randn(B, V, generator=g, device=DEV)
    params = [SamplingParams(temperature=0)] * B
    meta = SamplingMetadata(params, [[1]] * B, [[]] * B)
    out = Sampler(set(), V)(logits, meta)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    want = torch.log_softmax(logits, -1).gather(1, out.token_ids[:, None]).squeeze(1)
    assert torch.allclose(out.logprobs, want, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_sampling_reads_model_dtype_logits_as_their_float32_copy(dtype):
    """The engine hands the sampler logits in the model dtype (no float32 copy): the tokens and
    logprobs are those of the widened copy, bit for bit, greedy and sampled rows alike."""
    import random

    from rlserve.engine.core import fused_sampling
    from rlserve.engine.sampling_params import SamplingParams

    V, B = 151936, 64
    g = torch.Generator(device=DEV).manual_seed(7)
    logits = (5 * torch.randn(B, V, generator=g, device=DEV)).to(dtype)
    params = [SamplingParams(temperature=0.0 if i % 3 == 0 else 0.6, seed=i if i % 2 else None) for i in range(B)]
    outs = [[]] * B
    tok, lp = fused_sampling.sample(logits, params, outs, V, random.Random(5))
    tok32, lp32 = fused_sampling.sample(logits.float(), params, outs, V, random.Random(5))
    assert torch.equal(tok, tok32) and torch.equal(lp, lp32)
    assert torch.equal(tok[::3], logits[::3].float().argmax(-1))


def test_fused_sampling_follows_softmax():
    from rlserve.engine.core.sampler import Sampler, SamplingMetadata
    from rlserve.engine.sampling_params import SamplingParams

    V, B = 5000, 20000
    base = torch.randn(V, device=DEV) * 3
    params = [SamplingParams(temperature=0.6)] * B
    out = Sampler(set(), V)(base.repeat(B, 1), SamplingMetadata(params, [[1]] * B, [[]] * B))
    freq = torch.bincount(out.token_ids, minlength=V).float() / B
    p = torch.softmax(base / 0.6, -1)
    assert (freq - p).abs().max() < 5 * (p * (1 - p) / B).sqrt().max() + 1e-4


def test_logit_bias_on_cuda_equals_cpu():
    """logit_bias rows leave the one-pass path for the general sampler; on CUDA it gives the
    CPU sampler's greedy tokens and (raw, unbiased) logprobs, and a batch mixing biased and
    plain rows samples the plain ones as before (their tokens equal a batch without the bias)."""
    from rlserve.engine.core import fused_sampling
    from rlserve.engine.core.sampler import Sampler, SamplingMetadata
    from rlserve.engine.sampling_params import SamplingParams

    V, B = 151936, 8
    logits = 5 * torch.randn(B, V, generator=torch.Generator(device=DEV).manual_seed(3), device=DEV)
    top = logits.argmax(-1).tolist()
    params = [SamplingParams(temperature=0, logit_bias={top[i]: -100.0, 17: 1.0} if i % 2 else None)
              for i in range(B)]
    meta = SamplingMetadata(params, [[1]] * B, [[]] * B)
    assert not fused_sampling.eligible(logits, params, meta.output_token_ids, V)
    gpu = Sampler(set(), V)(logits, meta)
    cpu = Sampler(set(), V)(logits.cpu(), meta)
    assert gpu.token_ids.tolist() == cpu.token_ids.tolist()
    assert all(gpu.token_ids[i].item() != top[i] for i in range(1, B, 2))
    assert gpu.token_ids[0::2].tolist() == top[0::2]
    # float32 log_softmax on two devices: the reductions' order differs (a few ulps of ~12)
    assert torch.allclose(gpu.logprobs.cpu(), cpu.logprobs, atol=1e-4)
