"""The fp8 KV cache (``--kv-cache-dtype fp8`` / ``fp8_e5m2``) on a CUDA GPU, compiled kernels.

- the Triton cache writer stores the bytes torch's quantizer stores (``saturate(x / scale)``,
  round to nearest even: the hardware conversion; the CPU interpreter cannot check this, it
  rounds some values wrongly);
- the fused q/k-norm + rotary + write kernel stores its keys / values within one fp8 rounding
  (2^-4 relative for e4m3) of what it stores into a bf16 cache;
- decode and prefill on an fp8 cache against the float64 torch reference reading the same
  cache (tolerances: test_gpu_attention's bf16 ones, 2e-2), with the bytes turned into float16
  dot operands by a cast (``"f16"``) and, for V, by inline assembly (``"asm"``,
  ``triton_attention.FP8_OPERAND``); the inline assembly gives every e4m3 / e5m2 byte's value;
- the engine, tiny Qwen3 in float32: fp8 with CUDA graphs gives the same tokens and logprobs as
  fp8 eager (the graphs replay the same kernels), and the logprobs of the same tokens are within
  e4m3's bound of the float32 cache's (tests/test_kv_fp8.py states it).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ta = pytest.importorskip("rlserve.layers.triton_attention")
if not ta.HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

from rlserve import LLM, SamplingParams  # noqa: E402
from rlserve.layers import fused_ops, kv_quant  # noqa: E402
from rlserve.layers.attention import torch_paged_attention, write_kv_cache  # noqa: E402
from rlserve.layers.rotary import RotaryEmbedding  # noqa: E402
from rlserve.layers.triton_attention_kernels import _kv_operand  # noqa: E402
from tests.attention_cases import make_paged_case  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

DEV = torch.device("cuda")
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("cache_dtype", FP8)
def test_triton_writer_stores_torchs_bytes(cache_dtype):
    g = torch.Generator(device=DEV).manual_seed(0)
    k = torch.randn(300, 8, 128, generator=g, device=DEV, dtype=torch.bfloat16) * 20
    v = torch.randn(300, 8, 128, generator=g, device=DEV, dtype=torch.bfloat16) * 20
    k[0, 0, 0] = 1e5  # saturates
    ks, vs = torch.tensor([0.07], device=DEV), torch.tensor([0.03], device=DEV)
    slots = torch.randperm(40 * 16, device=DEV)[:300]
    slots[5] = -1
    kc = torch.zeros(40, 16, 8, 128, dtype=cache_dtype, device=DEV)
    vc = torch.zeros_like(kc)
    kc2, vc2 = kc.clone(), vc.clone()
    ta.triton_write_kv_cache(k, v, kc, vc, slots, ks, vs)
    write_kv_cache(k, v, kc2, vc2, slots, ks, vs)
    assert torch.equal(kc.view(torch.uint8), kc2.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vc2.view(torch.uint8))
    assert kc.view(-1, 8, 128)[slots[0], 0, 0].float().item() == torch.finfo(cache_dtype).max


@pytest.mark.parametrize("tokens", [7, 2048])
def test_fused_write_within_one_fp8_rounding(tokens):
    H, Hkv, D, bs = 16, 8, 128, 16
    g = torch.Generator(device=DEV).manual_seed(1)
    qkv = torch.randn(tokens, (H + 2 * Hkv) * D, generator=g, device=DEV, dtype=torch.bfloat16) * 3
    pos = torch.arange(tokens, device=DEV)
    rope = RotaryEmbedding(D, D, 4096, {"rope_type": "default", "rope_theta": 1e6}).to(DEV)
    qw = torch.rand(D, generator=g, device=DEV, dtype=torch.bfloat16) + 0.5
    kw = torch.rand(D, generator=g, device=DEV, dtype=torch.bfloat16) + 0.5
    nb = -(-tokens // bs)
    slots = torch.arange(tokens, device=DEV)
    # scales that keep every value inside e4m3's range: |k|, |v| stay below 22.4 = 448 x 0.05 here
    ks, vs = torch.tensor([0.05], device=DEV), torch.tensor([0.05], device=DEV)
    kb, vb = (torch.zeros(nb, bs, Hkv, D, dtype=torch.bfloat16, device=DEV) for _ in range(2))
    k8, v8 = (torch.zeros(nb, bs, Hkv, D, dtype=torch.float8_e4m3fn, device=DEV) for _ in range(2))
    args = (qkv, pos, rope.cos_cache, rope.sin_cache, H, Hkv, D)
    qb = fused_ops.qkv_norm_rope_write(*args, kb, vb, slots, qw, kw, 1e-6)
    q8 = fused_ops.qkv_norm_rope_write(*args, k8, v8, slots, qw, kw, 1e-6, k_scale=ks, v_scale=vs)
    assert torch.equal(qb, q8)
    for c8, cb, s in ((k8, kb, ks), (v8, vb, vs)):
        back, ref = c8.float() * s, cb.float()
        # e4m3 rounding (2^-4) on top of the bf16 cache's own rounding (2^-8), + e4m3's subnormal step x scale
        assert ((back - ref).abs() <= (2.0 ** -4 + 2.0 ** -8) * ref.abs() + 2.0 ** -9 * s).all()


@triton.jit
def _operand_kernel(X, Y, N: tl.constexpr, KV_CVT: tl.constexpr, IS_V: tl.constexpr):
    offs = tl.arange(0, N)
    q = tl.zeros([N], dtype=tl.float16)
    tl.store(Y + offs, _kv_operand(tl.load(X + offs), q, KV_CVT, IS_V))


@pytest.mark.parametrize("cache_dtype,kv_cvt,is_v", [
    (torch.float8_e4m3fn, 1, False), (torch.float8_e4m3fn, 2, True), (torch.float8_e5m2, 3, True)])
def test_fp8_operands_exact_for_every_byte(cache_dtype, kv_cvt, is_v):
    """Every fp8 byte as a float16 operand, by Triton's cast (1) and by the inline assembly V takes
    under ``"asm"`` (2: e4m3's hardware conversion, 3: e5m2's byte shift): its value exactly (NaN
    bytes compared as NaN; the saturating writer never stores them). Signs are compared on every non-NaN byte
    (so -0.0, byte 0x80, stays -0.0); a NaN's sign bit is not a value (the hardware conversion returns the
    canonical +NaN for e4m3's 0xFF: session 21's H100 run)."""
    x = torch.arange(256, dtype=torch.uint8, device=DEV).view(cache_dtype)
    y = torch.zeros(256, dtype=torch.float16, device=DEV)
    _operand_kernel[(1,)](x, y, N=256, KV_CVT=kv_cvt, IS_V=is_v, num_warps=1)  # 8 values a thread: asm packs 4
    torch.testing.assert_close(y.float(), x.float(), atol=0, rtol=0, equal_nan=True)
    finite = ~torch.isnan(x.float())
    assert int(finite.sum()) == (254 if cache_dtype == torch.float8_e4m3fn else 250)  # e4m3: 0x7F, 0xFF; e5m2: 6
    assert torch.equal(torch.signbit(y)[finite], torch.signbit(x.float())[finite])


@pytest.mark.parametrize("mode", ["f16", "asm"])  # "bf16", the kernel of sessions 13-16: 9 passed in s14
@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("query_lens,seq_lens", [([1] * 6, [1, 17, 300, 2048, 64, 1000]), ([30, 1, 200], [30, 77, 900])])
def test_attention_on_fp8_cache_matches_reference(cache_dtype, query_lens, seq_lens, mode, monkeypatch):
    monkeypatch.setattr(ta, "FP8_OPERAND", mode)
    q, kc, vc, meta = make_paged_case(query_lens, seq_lens, 16, 8, 128, 16, torch.bfloat16, DEV, seed=3)
    ks, vs = torch.tensor([0.05], device=DEV), torch.tensor([0.02], device=DEV)
    kc8 = kv_quant.quantize(kc.float() * 4, ks, cache_dtype)
    vc8 = kv_quant.quantize(vc.float() * 4, vs, cache_dtype)
    out = ta.triton_paged_attention(q, kc8, vc8, meta, 128 ** -0.5, k_scale=ks, v_scale=vs)
    ref = torch_paged_attention(q.double(), kc8, vc8, meta, 128 ** -0.5, k_scale=ks.double(), v_scale=vs.double())
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_engine_fp8_graphs_equal_eager_and_close_to_float32(tiny_model):
    path = tiny_model("qwen3")
    kw = dict(device="cuda", dtype="float32", num_kv_blocks=512, max_num_seqs=16, block_size=16)
    prompts = [[(7 * i + 3) % 200 + 5 for i in range(n)] for n in (5, 37, 90, 200)]  # + 24 <= max_model_len 256
    sp = SamplingParams(temperature=0, max_tokens=24, logprobs=0)
    graphs = LLM(path, kv_cache_dtype="fp8", **kw)
    assert graphs.engine.executor.runner.use_cuda_graphs
    eager = LLM(path, kv_cache_dtype="fp8", enforce_eager=True, **kw)
    a, b = graphs.generate(prompts, sp), eager.generate(prompts, sp)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for la, lb in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            # same kernels; the graphs plan their KV splits for max_model_len (float32 rounding)
            assert la == pytest.approx(lb, abs=1e-4)
    full = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, a)]
    tf = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    ref = LLM(path, **kw).generate(full, tf)
    got = graphs.generate(full, tf)
    for r, o in zip(ref, got):
        lr = [next(iter(d.values())) for d in r.prompt_logprobs[1:]]
        lo = [next(iter(d.values())) for d in o.prompt_logprobs[1:]]
        diff = max(abs(x - y) for x, y in zip(lr, lo))
        assert 0 < diff <= 2.0 ** -4 * (max(lr) - min(lr)), diff
