"""The fp8 KV cache (``--kv-cache-dtype fp8``) in the Triton kernels, on CPU through Triton's
interpreter: the cache writers (plain and fused with q/k norm + rotary) scale, saturate and place
what they store, and the decode / prefill kernels, reading fp8 and dequantizing in registers,
agree with the torch reference reading the same fp8 cache.

Tolerances: both sides dequantize the same fp8 values exactly (every e4m3 / e5m2 value is a
float32 / float16 value); they differ only in where the scales are multiplied (the kernels fold
``k_scale`` into the softmax scale and apply ``v_scale`` to the output), so float32 agrees to
float32 rounding: test_triton_interpret's 2e-6 for unit-normal K/V, times 3 for these cases'
3x larger values, rounded up to 1e-5; float16 to that module's float16 2e-3.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

import tests.triton_interp  # noqa: F401  (skips this module, or sets TRITON_INTERPRET=1 first)

for _name in ("rlserve.layers.triton_attention_kernels", "rlserve.layers.triton_attention"):
    if _name in sys.modules:  # built without the interpreter: rebuild (the kernels first)
        importlib.reload(sys.modules[_name])
from rlserve.layers import fused_ops, kv_quant  # noqa: E402
from rlserve.layers import triton_attention as ta  # noqa: E402
from rlserve.layers.attention import torch_paged_attention, write_kv_cache  # noqa: E402
from rlserve.layers.rotary import RotaryEmbedding  # noqa: E402
from tests.attention_cases import make_paged_case  # noqa: E402

import triton  # noqa: E402  (after tests.triton_interp set TRITON_INTERPRET=1)
import triton.language as tl  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def fp8_case(query_lens, seq_lens, H, Hkv, D, bs, q_dtype, cache_dtype, seed=0):
    """A paged case whose cache holds ``quantize(randn * 3, scale)`` in ``cache_dtype``, with
    scales that are not 1 (k 0.02, v 0.01: values up to ~300, inside e4m3's 448)."""
    q, kc, vc, meta = make_paged_case(query_lens, seq_lens, H, Hkv, D, bs, torch.float32, seed=seed)
    ks, vs = torch.tensor([0.02]), torch.tensor([0.01])
    kc8 = kv_quant.quantize(kc * 3, ks, cache_dtype)
    vc8 = kv_quant.quantize(vc * 3, vs, cache_dtype)
    return q.to(q_dtype), kc8, vc8, ks, vs, meta


@triton.jit
def _cast_kernel(X, C, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(C + offs, tl.load(X + offs).to(C.dtype.element_ty))


def interp_fp8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (float32) converted to ``dtype`` by the interpreter's own float32 -> fp8 cast.
    Triton 3.9's interpreter rounds some values wrongly (it drops the carry at a binade edge:
    31.7 -> 16, not 32), so a kernel's bytes are compared with this, not with torch's; torch's
    rounding is the compiled kernels' (tests/gpu/test_gpu_kv_fp8.py)."""
    flat = x.float().contiguous().reshape(-1)
    n = triton.next_power_of_2(max(flat.numel(), 1))
    src = torch.zeros(n)
    src[: flat.numel()] = flat
    out = torch.zeros(n, dtype=dtype)
    _cast_kernel[(1,)](src, out, N=n)
    return out[: flat.numel()].view(x.shape)


def saturated(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fmax = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-fmax, fmax)


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
def test_write_kv_cache_fp8_scales_saturates_and_skips(cache_dtype):
    g = torch.Generator().manual_seed(3)
    k = torch.randn(7, 2, 8, generator=g) * 50
    v = torch.randn(7, 2, 8, generator=g) * 50
    k[0, 0, 0] = 1e6  # saturates to the largest finite value (not inf / nan)
    ks, vs = torch.tensor([0.5]), torch.tensor([0.25])
    slots = torch.tensor([3, -1, 17, 0, -1, 19, 5])
    kc, vc = torch.zeros(5, 4, 2, 8, dtype=cache_dtype), torch.zeros(5, 4, 2, 8, dtype=cache_dtype)
    ta.triton_write_kv_cache(k, v, kc, vc, slots, ks, vs)
    keep = slots >= 0
    for cache, x, s in ((kc, k, ks), (vc, v, vs)):
        rows = cache.view(-1, 2, 8)
        want = interp_fp8(saturated(x[keep], s, cache_dtype), cache_dtype)
        assert torch.equal(rows[slots[keep]].view(torch.uint8), want.view(torch.uint8))
        others = torch.ones(rows.shape[0], dtype=torch.bool)
        others[slots[keep]] = False
        assert int(rows[others].view(torch.uint8).count_nonzero()) == 0  # slots never written
    assert kc.view(-1, 2, 8)[3, 0, 0].float().item() == torch.finfo(cache_dtype).max
    # values fp8 holds exactly (x / scale on the fp8 grid): the same bytes as the torch writer
    exact = kv_quant.quantize(k, ks, cache_dtype).float() * ks
    kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
    ta.triton_write_kv_cache(exact, exact, kc2, vc2, slots, ks, ks)
    ref_k, ref_v = torch.zeros_like(kc), torch.zeros_like(vc)
    write_kv_cache(exact, exact, ref_k, ref_v, slots, ks, ks)
    assert torch.equal(kc2.view(torch.uint8), ref_k.view(torch.uint8))


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("seq_lens,H,Hkv,D,bs,splits", [
    ([5, 40, 17], 4, 2, 16, 4, None),
    ([5, 40, 17], 4, 2, 16, 4, 3),  # split-K: v_scale on every partial
    ([70, 1], 4, 1, 24, 16, 2),  # MQA, head_dim not a power of two
])
def test_decode_fp8_matches_reference_fp32(cache_dtype, seq_lens, H, Hkv, D, bs, splits):
    q, kc, vc, ks, vs, meta = fp8_case([1] * len(seq_lens), seq_lens, H, Hkv, D, bs, torch.float32, cache_dtype)
    out = ta.triton_paged_attention(q, kc, vc, meta, D**-0.5, num_splits=splits, k_scale=ks, v_scale=vs)
    ref = torch_paged_attention(q, kc, vc, meta, D**-0.5, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # the scales are applied: 1.0 scales give another result (1/0.01 times the values)
    other = ta.triton_paged_attention(q, kc, vc, meta, D**-0.5, num_splits=splits)
    assert not torch.allclose(other, out, atol=1e-3)


@pytest.mark.parametrize("query_lens,seq_lens", [([7, 1, 12], [7, 9, 30]), ([33], [33])])
def test_prefill_fp8_matches_reference_fp32(query_lens, seq_lens):
    q, kc, vc, ks, vs, meta = fp8_case(query_lens, seq_lens, 4, 2, 16, 4, torch.float32, E4M3, seed=1)
    out = ta.triton_paged_attention(q, kc, vc, meta, 0.25, k_scale=ks, v_scale=vs)
    ref = torch_paged_attention(q, kc, vc, meta, 0.25, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("decode", [True, False])
def test_fp16_queries_on_fp8_cache(decode):
    ql = [1, 1] if decode else [6, 11]
    q, kc, vc, ks, vs, meta = fp8_case(ql, [20, 11], 4, 2, 16, 4, torch.float16, E4M3, seed=2)
    out = ta.triton_paged_attention(q, kc, vc, meta, 0.25, k_scale=ks, v_scale=vs)
    ref = torch_paged_attention(q.float(), kc, vc, meta, 0.25, k_scale=ks, v_scale=vs)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("tokens", [3, 40])  # decode-sized (heads per program) and prefill-sized kernels
def test_fused_qkv_write_quantizes_like_the_torch_writer(tokens, monkeypatch):
    """``qkv_norm_rope_write`` into an fp8 cache stores ``saturate(x / scale)`` of the keys /
    values it writes into a float32 cache (cast by the interpreter: :func:`interp_fp8`)."""
    monkeypatch.setattr(fused_ops, "_QKV_MANY_TOKENS", 32)  # 40 tokens take the prefill variant
    prev = fused_ops.set_fused_kernels(True, on_cpu=True)
    try:
        H, Hkv, D, bs = 4, 2, 16, 4
        g = torch.Generator().manual_seed(5)
        qkv = torch.randn(tokens, (H + 2 * Hkv) * D, generator=g) * 4
        pos = torch.arange(tokens, dtype=torch.long)
        rope = RotaryEmbedding(D, D, 2048, {"rope_type": "default", "rope_theta": 10000.0})
        nb = -(-tokens // bs) + 1
        slots = torch.arange(tokens, dtype=torch.long)
        slots[1] = -1
        qw, kw = torch.rand(D, generator=g) + 0.5, torch.rand(D, generator=g) + 0.5
        ks, vs = torch.tensor([0.03]), torch.tensor([0.02])
        kf, vf = torch.zeros(nb, bs, Hkv, D), torch.zeros(nb, bs, Hkv, D)
        k8, v8 = torch.zeros(nb, bs, Hkv, D, dtype=E4M3), torch.zeros(nb, bs, Hkv, D, dtype=E4M3)
        args = (qkv, pos, rope.cos_cache, rope.sin_cache, H, Hkv, D)
        q_f = fused_ops.qkv_norm_rope_write(*args, kf, vf, slots, qw, kw, 1e-6)
        q_8 = fused_ops.qkv_norm_rope_write(*args, k8, v8, slots, qw, kw, 1e-6, k_scale=ks, v_scale=vs)
        assert torch.equal(q_f, q_8)
        assert torch.equal(k8.view(torch.uint8), interp_fp8(saturated(kf, ks, E4M3), E4M3).view(torch.uint8))
        assert torch.equal(v8.view(torch.uint8), interp_fp8(saturated(vf, vs, E4M3), E4M3).view(torch.uint8))
        assert int(k8.view(torch.uint8).view(-1, Hkv, D)[1].count_nonzero()) == 0
    finally:
        fused_ops.set_fused_kernels(*prev)


def test_fp8_operand_mode_picks_the_kernel_variant(monkeypatch):
    bf, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    assert ta.fp8_operand_mode(bf, bf) == 0  # model-dtype cache: a plain cast
    assert ta.fp8_operand_mode(f32, E4M3, "asm") == 0  # float32 queries keep IEEE float32 dots
    assert ta.fp8_operand_mode(bf, E4M3, "bf16") == 0
    assert ta.fp8_operand_mode(bf, E4M3, "f16") == 1
    assert ta.fp8_operand_mode(f16, E5M2, "asm") == 1  # the interpreter cannot run inline assembly
    monkeypatch.setattr(ta, "interpreter_enabled", lambda: False)
    assert ta.fp8_operand_mode(bf, E4M3, "asm") == 2
    assert ta.fp8_operand_mode(f16, E5M2, "asm") == 3
    monkeypatch.setattr(ta, "FP8_OPERAND", "f16")
    assert ta.fp8_operand_mode(bf, E4M3) == 1
    with pytest.raises(ValueError, match="fp8 operand mode"):
        ta.fp8_operand_mode(bf, E4M3, "int8")


def test_set_fp8_operand_parses_mode_and_tile(monkeypatch):
    monkeypatch.setattr(ta, "FP8_OPERAND", ta.FP8_OPERAND)
    monkeypatch.setattr(ta, "DECODE_BLOCK_N_FP8", ta.DECODE_BLOCK_N_FP8)
    assert ta.set_fp8_operand("asm:128") == "asm:128"
    assert (ta.FP8_OPERAND, ta.DECODE_BLOCK_N_FP8) == ("asm", 128)
    assert ta.set_fp8_operand("f16") == "f16:128"  # the tile stays
    for bad in ("int8", "asm:96", "asm:8"):
        with pytest.raises(ValueError):
            ta.set_fp8_operand(bad)
    assert (ta.FP8_OPERAND, ta.DECODE_BLOCK_N_FP8) == ("f16", 128)  # a refused spec changes nothing


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("query_lens,seq_lens,splits", [([1, 1, 1], [5, 40, 17], 3), ([7, 1, 12], [7, 9, 30], None)])
@pytest.mark.parametrize("mode", ["f16", "asm"])
def test_bf16_queries_float16_operands_match_float64(cache_dtype, query_lens, seq_lens, splits, mode, monkeypatch):
    """bf16 queries on an fp8 cache, K/V as float16 operands (``"asm"`` runs as ``"f16"`` in the
    interpreter: the same values; its assembly is checked compiled, tests/test_kv_fp8_compile.py, and
    on the GPU), decode (split) and prefill, against the float64 reference reading the same cache. Tolerance: the output's bf16
    rounding, a whole ulp (2^-7 relative: the interpreter's float32 -> bf16 store truncates, where
    the GPU rounds to nearest) plus p rounded to float16 before p.v (2^-11 x max|v| ~ 10 here:
    5e-3; atol 1e-2)."""
    monkeypatch.setattr(ta, "FP8_OPERAND", mode)
    q, kc, vc, ks, vs, meta = fp8_case(query_lens, seq_lens, 4, 2, 16, 4, torch.bfloat16, cache_dtype, seed=4)
    assert ta.fp8_operand_mode(q.dtype, kc.dtype) == 1
    ref = torch_paged_attention(q.double(), kc, vc, meta, 0.25, k_scale=ks.double(), v_scale=vs.double())
    out = ta.triton_paged_attention(q, kc, vc, meta, 0.25, num_splits=splits, k_scale=ks, v_scale=vs)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=2**-7)


def test_float16_operands_clamp_queries_past_float16_range(monkeypatch):
    """A bf16 query element past float16's largest finite value (65504) is clamped there, not
    turned into inf (inf x 0 would give NaN scores); the output stays finite."""
    monkeypatch.setattr(ta, "FP8_OPERAND", "f16")
    q, kc, vc, ks, vs, meta = fp8_case([1, 1], [9, 20], 4, 2, 16, 4, torch.bfloat16, E4M3, seed=6)
    q[0, 0, 0] = 1e6
    assert ta.fp8_operand_mode(q.dtype, kc.dtype) == 1
    out = ta.triton_paged_attention(q, kc, vc, meta, 0.25, k_scale=ks, v_scale=vs)
    assert torch.isfinite(out.float()).all()


def test_asm_compile_failure_falls_back_to_f16(monkeypatch):
    """``FP8_OPERAND = "asm"`` whose kernels do not compile (a Triton / GPU without the inline
    assembly): the call is repeated with ``"f16"``, which stays for the process; other errors
    propagate."""
    class CompilationError(Exception):  # triton.compiler.errors.CompilationError's name
        pass

    calls = []

    def fake(q, kc, vc, meta, scale, *rest):
        calls.append(ta.FP8_OPERAND)
        if ta.FP8_OPERAND == "asm":
            raise CompilationError("at 10:4: inline asm")
        return q + 1

    monkeypatch.setattr(ta, "paged_attention", fake)
    monkeypatch.setattr(ta, "FP8_OPERAND", "asm")
    monkeypatch.setattr(ta, "interpreter_enabled", lambda: False)
    q, kc = torch.zeros(1, 2, 4, dtype=torch.bfloat16), torch.zeros(1, 1, 1, 4, dtype=E4M3)
    assert torch.equal(ta.triton_paged_attention(q, kc, kc, None, 1.0), q + 1)
    assert calls == ["asm", "f16"] and ta.FP8_OPERAND == "f16"

    def broken(*args):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(ta, "paged_attention", broken)
    monkeypatch.setattr(ta, "FP8_OPERAND", "asm")
    with pytest.raises(RuntimeError, match="out of memory"):
        ta.triton_paged_attention(q, kc, kc, None, 1.0)
    assert ta.FP8_OPERAND == "asm"
