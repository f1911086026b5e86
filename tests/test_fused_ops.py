"""The fused Triton kernels of ``rlserve.layers.fused_ops`` on CPU, through Triton's
interpreter, against the PyTorch code they replace (``RMSNorm``, ``SiluAndMul``, q/k norm +
``RotaryEmbedding`` + ``write_kv_cache``), and a whole Qwen3 model with and without them.

float32 must agree to float32 rounding (only the order of the norm's mean differs); float16
(the interpreter has no bfloat16) must agree within one unit in the last place, since each
kernel rounds where the op-by-op code rounds. ``tests/gpu/test_fused_ops_gpu.py`` repeats
this in bfloat16 on the compiled kernels.
"""

from __future__ import annotations

import pytest
import torch

import tests.triton_interp  # noqa: F401  (skips this module, or sets TRITON_INTERPRET=1 first)
from rlserve.layers import fused_ops  # noqa: E402
from rlserve.layers.activation import SiluAndMul  # noqa: E402
from rlserve.layers.attention import write_kv_cache  # noqa: E402
from rlserve.layers.norm import RMSNorm  # noqa: E402
from rlserve.layers.rotary import RotaryEmbedding  # noqa: E402


@pytest.fixture
def fused_on_cpu():
    prev = fused_ops.set_fused_kernels(True, on_cpu=True)
    yield
    fused_ops.set_fused_kernels(*prev)


def _ulp(dtype):
    return {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10}[dtype]


def assert_close_ulp(got, ref, dtype, ulps=1.0):
    assert got.shape == ref.shape and got.dtype == ref.dtype
    err = (got.float() - ref.float()).abs()
    tol = ulps * _ulp(dtype) * ref.float().abs() + (1e-6 if dtype == torch.float32 else 1e-4)
    assert (err <= tol).all(), (err - tol).max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("N", [64, 96])
def test_rms_norm_with_and_without_residual(dtype, N, fused_on_cpu):
    g = torch.Generator().manual_seed(N)
    norm = RMSNorm(N, eps=1e-5, params_dtype=dtype)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(N, generator=g))
    x = torch.randn(5, N, generator=g).to(dtype)
    r = torch.randn(5, N, generator=g).to(dtype)
    fused_ops.set_fused_kernels(False)
    ref, ref_res = norm(x, r)
    ref_plain = norm(x)
    fused_ops.set_fused_kernels(True, on_cpu=True)
    out, res = norm(x, r)
    assert torch.equal(res, ref_res)  # the residual sum is rounded exactly like x + r
    assert_close_ulp(out, ref, dtype)
    assert_close_ulp(norm(x), ref_plain, dtype)
    assert fused_ops.rms_norm(x[:0], norm.weight, 1e-5).shape == (0, N)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_and_mul(dtype, fused_on_cpu):
    g = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(2, 3, 2 * 80, generator=g)).to(dtype)  # 3-D input, d not a power of two
    fused_ops.set_fused_kernels(False)
    ref = SiluAndMul()(x)
    fused_ops.set_fused_kernels(True, on_cpu=True)
    out = SiluAndMul()(x)
    assert_close_ulp(out, ref, dtype)


def _rope(head_dim, rotary_dim):
    return RotaryEmbedding(head_dim, rotary_dim, 64, {"rope_type": "default", "rope_theta": 10000.0})


def test_qkv_heads_per_program_fills_one_wave(monkeypatch):
    """Auto: the smallest power of two of heads per program whose grid fits one wave of
    one-warp programs (32 per SM; the interpreter counts 4 SMs), at most next_pow2(heads)."""
    monkeypatch.setattr(fused_ops, "_QKV_HEADS_PER_PROGRAM", None)
    cpu = torch.device("cpu")
    assert fused_ops._qkv_heads_per_program(6, 6, cpu) == 1  # 36 programs <= 128
    assert fused_ops._qkv_heads_per_program(64, 6, cpu) == 4  # 384, 192 > 128 >= 64 x 2
    assert fused_ops._qkv_heads_per_program(1000, 6, cpu) == 8  # capped at next_pow2(6)
    monkeypatch.setattr(fused_ops, "_QKV_HEADS_PER_PROGRAM", 2)
    assert fused_ops._qkv_heads_per_program(1000, 6, cpu) == 2


@pytest.mark.parametrize("dtype,qk_norm,head_dim,rotary_dim,variant", [
    (dt, *case, "heads") for dt in (torch.float32, torch.float16)
    for case in ((True, 32, 32), (False, 32, 32), (False, 48, 24))
] + [(torch.float16, True, 32, 32, v) for v in ("heads4", "per_head", "many", "auto")])
def test_qkv_norm_rope_write_equals_op_by_op(dtype, qk_norm, head_dim, rotary_dim, variant, fused_on_cpu, monkeypatch):
    """``variant``: ``heads`` the decode-batch kernel with the 6 heads of a token in one
    program of 8 (two masked), ``heads4`` programs of 4 (the second holds the key heads and two
    masked), ``per_head`` one program per token and head, ``auto`` the default choice
    (:func:`fused_ops._qkv_heads_per_program`: one here), ``many`` the
    long-batch variant (several tokens per program; 6 tokens over programs of 4, so the last
    program is partly past the batch)."""
    if variant == "many":
        monkeypatch.setattr(fused_ops, "_QKV_MANY_TOKENS", 4)
        monkeypatch.setattr(fused_ops, "_QKV_TOKENS_PER_PROGRAM", 4)
    monkeypatch.setattr(fused_ops, "_QKV_HEADS_PER_PROGRAM", {"heads": 8, "heads4": 4, "per_head": 1}.get(variant))
    H, Hkv, T, P, nb = 4, 2, 6, 4, 8
    g = torch.Generator().manual_seed(head_dim + rotary_dim + qk_norm)
    qkv = torch.randn(T, (H + 2 * Hkv) * head_dim, generator=g).to(dtype)
    pos = torch.tensor([0, 1, 2, 7, 30, 63])
    slots = torch.tensor([5, 6, -1, 9, 20, 31])  # -1: a padding row writes nothing
    qw = (1 + 0.2 * torch.randn(head_dim, generator=g)).to(dtype)
    kw = (1 + 0.2 * torch.randn(head_dim, generator=g)).to(dtype)
    rope = _rope(head_dim, rotary_dim)
    eps = 1e-6

    # op by op, as LlamaAttention does without the fused kernel
    fused_ops.set_fused_kernels(False)
    q, k, v = qkv.split([H * head_dim, Hkv * head_dim, Hkv * head_dim], dim=-1)
    if qk_norm:
        qn, kn = RMSNorm(head_dim, eps, dtype), RMSNorm(head_dim, eps, dtype)
        qn.weight.data.copy_(qw)
        kn.weight.data.copy_(kw)
        q = qn(q.reshape(T, H, head_dim)).reshape(T, -1)
        k = kn(k.reshape(T, Hkv, head_dim)).reshape(T, -1)
    q_ref, k_ref = rope(pos, q, k)
    kc_ref = torch.full((nb, P, Hkv, head_dim), 7.0, dtype=dtype)
    vc_ref = kc_ref.clone()
    valid = slots >= 0
    write_kv_cache(k_ref.view(T, Hkv, head_dim), v.reshape(T, Hkv, head_dim), kc_ref, vc_ref, slots)

    fused_ops.set_fused_kernels(True, on_cpu=True)
    kc = torch.full_like(kc_ref, 7.0)
    vc = torch.full_like(vc_ref, 7.0)
    q_out = fused_ops.qkv_norm_rope_write(qkv, pos, rope.cos_cache, rope.sin_cache, H, Hkv, head_dim, kc, vc, slots,
                                          qw if qk_norm else None, kw if qk_norm else None, eps)
    assert_close_ulp(q_out, q_ref, dtype)
    assert_close_ulp(kc, kc_ref, dtype)
    assert torch.equal(vc, vc_ref)  # values are copied, never rounded
    untouched = torch.ones(nb * P, dtype=torch.bool)
    untouched[slots[valid]] = False
    assert (kc.view(nb * P, -1)[untouched] == 7.0).all()


def test_qwen3_model_fused_equals_unfused(tiny_model, fused_on_cpu, monkeypatch):
    """A whole tiny Qwen3 (q/k norm) and Llama in float32: greedy tokens and logprobs with
    the fused kernels equal the PyTorch path."""
    from rlserve import LLM, SamplingParams

    calls = {"qkv": 0, "norm": 0, "silu": 0}
    for name, key in (("qkv_norm_rope_write", "qkv"), ("rms_norm", "norm"), ("silu_and_mul", "silu")):
        fn = getattr(fused_ops, name)
        monkeypatch.setattr(fused_ops, name, lambda *a, _fn=fn, _k=key, **kw: calls.__setitem__(_k, calls[_k] + 1)
                            or _fn(*a, **kw))

    params = SamplingParams(temperature=0, max_tokens=3, min_tokens=3, logprobs=2)
    prompts = ["The capital of France is", "Hello world"]
    for arch in ("qwen3", "llama"):
        path = tiny_model(arch)
        fused_ops.set_fused_kernels(False)
        ref = LLM(path, dtype="float32", device="cpu", block_size=4).generate(prompts, params)
        fused_ops.set_fused_kernels(True, on_cpu=True)
        got = LLM(path, dtype="float32", device="cpu", block_size=4).generate(prompts, params)
        for a, b in zip(got, ref):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for da, db in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                for t in db:
                    assert abs(da[t] - db[t]) < 1e-4
    assert min(calls.values()) > 0, calls  # the fused path ran


# --------------------------------------------------------------------------- one-pass sampling
def _meta(params, outs=None):
    from rlserve.engine.core.sampler import SamplingMetadata

    outs = outs or [[] for _ in params]
    return SamplingMetadata(params=params, prompt_token_ids=[[1] for _ in params], output_token_ids=outs)


@pytest.fixture
def small_sampling_blocks(monkeypatch):
    """16-wide vocabulary blocks: the interpreter stays fast and rows span many chunks."""
    from rlserve.engine.core import fused_sampling

    monkeypatch.setattr(fused_sampling, "_BLOCK", 16)


def test_fused_sampling_greedy_and_logprobs(fused_on_cpu, small_sampling_blocks):
    from rlserve.engine.core.sampler import Sampler
    from rlserve.engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(0)
    V = 300  # 19 blocks of 16: the chunk merge and the masked tail are exercised
    logits = torch.randn(5, V + 64, generator=g)  # 64 padded columns, never sampled
    logits[:, V:] = 100.0
    logits[2, 7] = logits[2, 290] = 50.0  # a tie: the lowest index wins, as torch.argmax
    params = [SamplingParams(temperature=0)] * 5
    out = Sampler(set(), V)(logits, _meta(params))
    ref = logits[:, :V]
    assert out.token_ids.tolist() == ref.argmax(-1).tolist()
    want = torch.log_softmax(ref, -1).gather(1, out.token_ids[:, None]).squeeze(1)
    assert torch.allclose(out.logprobs, want, atol=1e-5)
    assert out.topk_token_ids.shape == (5, 0)


def test_fused_sampling_takes_half_precision_logits(fused_on_cpu, small_sampling_blocks):
    """Logits in a model dtype (what the engine hands over) sample as their float32 copy."""
    import random

    from rlserve.engine.core import fused_sampling
    from rlserve.engine.sampling_params import SamplingParams

    V = 300
    logits = (3 * torch.randn(4, V, generator=torch.Generator().manual_seed(1))).half()
    params = [SamplingParams(temperature=t) for t in (0.0, 0.7, 0.0, 1.3)]
    tok, lp = fused_sampling.sample(logits, params, [[]] * 4, V, random.Random(2))
    tok32, lp32 = fused_sampling.sample(logits.float(), params, [[]] * 4, V, random.Random(2))
    assert torch.equal(tok, tok32) and torch.equal(lp, lp32)
    assert tok[0] == logits[0].float().argmax() and tok[2] == logits[2].float().argmax()


def test_fused_sampling_follows_softmax_and_seeds(fused_on_cpu, small_sampling_blocks):
    from rlserve.engine.core import fused_sampling
    from rlserve.engine.core.sampler import Sampler
    from rlserve.engine.sampling_params import SamplingParams

    V = 6
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0])
    # 400 rows (was 800: half of the interpreter run's slowest case): the 4-sigma bound below is then
    # 0.088 (p = 0.745 of token 5), under the 0.14 that a wrong temperature (1.0 for 0.7) moves it
    B = 400
    params = [SamplingParams(temperature=0.7)] * B
    out = Sampler(set(), V, generator_seed=3)(base.repeat(B, 1), _meta(params))
    freq = torch.bincount(out.token_ids, minlength=V).float() / B
    p = torch.softmax(base / 0.7, -1)
    assert (freq - p).abs().max() < 4 * (p * (1 - p) / B).sqrt().max() + 1e-3  # ~4 sigma
    assert torch.allclose(out.logprobs, torch.log_softmax(base, -1)[out.token_ids], atol=1e-5)
    # unseeded: reproducible per generator seed; seeded rows: the same token wherever they sit
    first = Sampler(set(), V, generator_seed=3)(base.repeat(40, 1), _meta(params[:40]))
    assert torch.equal(first.token_ids, out.token_ids[:40])  # the first call's key again
    seeded = SamplingParams(temperature=1.0, seed=1234)
    a = Sampler(set(), V)(base.repeat(3, 1), _meta([SamplingParams(temperature=1.0), seeded, seeded],
                                                   [[], [5, 5], [5, 5]]))
    b = Sampler(set(), V, generator_seed=9)(base.repeat(1, 1), _meta([seeded], [[1, 2]]))
    assert a.token_ids[1] == a.token_ids[2] == b.token_ids[0]
    draws = {Sampler(set(), V)(base[None], _meta([seeded], [[0] * n])).token_ids.item() for n in range(12)}
    assert len(draws) > 1  # the draw moves with the position
    # anything beyond temperature keeps the general path
    for extra in (dict(top_k=2), dict(top_p=0.5), dict(min_p=0.1), dict(repetition_penalty=1.2), dict(logprobs=2)):
        assert not fused_sampling.eligible(base[None], [SamplingParams(temperature=0.7, **extra)], [[]], V)
    assert not fused_sampling.eligible(base[None], [SamplingParams(min_tokens=3)], [[1]], V)
    assert fused_sampling.eligible(base[None], [SamplingParams(min_tokens=3)], [[1, 2, 3]], V)
