"""The attention kernels on an fp8 KV cache compiled ahead of time for an H100 (sm_90) by Triton's CUDA
backend on this machine, no GPU needed: what the interpreter cannot show (it cannot run the inline
assembly of ``FP8_OPERAND = "asm"`` either).

Under ``"asm"`` (the default) the V tile is converted to float16 before it reaches shared memory and is
read back with ``ldmatrix.trans`` as a bf16 cache's is: no byte-wise shared-memory reads
(``ld.shared.b8``: what Triton compiles for a cast fp8 V, 128 a thread for a 128-token tile, plus the
repacking) and no ``cvt.bf16.f16`` (the slow conversion of the bf16 target the kernel had before
session 17); K stays a cast to float16 (``cvt.rn.f16x2.e4m3x2``, read from shared memory 8 bytes at a
time). The same attributes as the runtime's specialization (16-byte aligned pointers and strides).
"""

from __future__ import annotations

import re

import pytest

from tests.triton_aot import compile_sm90  # noqa: E402  (skips this module where it cannot run)
from rlserve.layers import triton_attention_kernels as kern  # noqa: E402

ALIGNED = {"Q", "KC", "VC", "BT", "SEQ_LENS", "ORDER", "QSL", "OUT", "PART_O", "PART_LSE", "stride_qt", "stride_qh",
           "stride_cs", "stride_ch", "stride_ot", "stride_oh"}


def _compile(fn, args: list[tuple[str, str]], const: dict, warps: int, stages: int) -> str:
    sig = dict(args)
    sig.update({c: "constexpr" for c in const})
    return compile_sm90(fn, sig, const, {i for i, name in enumerate(sig) if name in ALIGNED}, warps, stages).asm["ptx"]


def decode_ptx(kv: str, kv_cvt: int, block_n: int = 128) -> str:
    """The decode kernel as the engine launches it for a Qwen3-0.6B layer (GQA group 2, head_dim 128,
    16-token pages, one split), bf16 queries, cache of Triton type ``kv``."""
    args = [("Q", "*bf16"), ("KC", kv), ("VC", kv), ("BT", "*i32"), ("SEQ_LENS", "*i32"), ("ORDER", "*i32"),
            ("OUT", "*bf16"), ("PART_O", "*fp32"), ("PART_LSE", "*fp32"), ("K_SCALE", "*fp32"), ("V_SCALE", "*fp32"),
            ("qk_scale", "fp32")] + [(n, "i32") for n in ("stride_qt", "stride_qh", "stride_cs", "stride_ch",
                                                          "stride_bt", "stride_ot", "stride_oh", "NUM_HEADS", "GROUP",
                                                          "NUM_SPLITS")]
    const = dict(GROUP_PAD=16, HEAD_DIM=128, D_PAD=128, PAGE=16, BLOCK_N=block_n, SPLIT=False, DOT_PRECISION="tf32",
                 ORDERED=True, KV_FP8=True, PDL=False, KV_CVT=kv_cvt)
    return _compile(kern._decode_kernel, args, const, 4, 3)


def prefill_ptx(kv: str, kv_cvt: int) -> str:
    args = [("Q", "*bf16"), ("KC", kv), ("VC", kv), ("BT", "*i32"), ("SEQ_LENS", "*i32"), ("QSL", "*i32"),
            ("OUT", "*bf16"), ("K_SCALE", "*fp32"), ("V_SCALE", "*fp32"), ("qk_scale", "fp32")] + [
        (n, "i32") for n in ("stride_qt", "stride_qh", "stride_cs", "stride_ch", "stride_bt", "stride_ot", "stride_oh",
                             "GROUP")]
    const = dict(HEAD_DIM=128, D_PAD=128, PAGE=16, BLOCK_M=128, BLOCK_N=64, DOT_PRECISION="tf32", KV_FP8=True,
                 KV_CVT=kv_cvt)
    return _compile(kern._prefill_kernel, args, const, 8, 2)


def count(ptx: str, pattern: str) -> int:
    return len(re.findall(pattern, ptx))


@pytest.mark.parametrize("kv,kv_cvt,cvt", [("*fp8e4nv", 2, r"cvt\.rn\.f16x2\.e4m3x2"), ("*fp8e5", 3, r"prmt\.b32")])
@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_asm_mode_reads_v_with_ldmatrix_not_bytes(kv, kv_cvt, cvt, kernel):
    ptx = decode_ptx(kv, kv_cvt) if kernel == "decode" else prefill_ptx(kv, kv_cvt)
    assert count(ptx, r"ld\.shared(\.v\d)?\.[bu]8\b") == 0  # no byte-wise shared-memory reads
    if kernel == "decode":  # (prefill's 128-row tiles: V is read from shared memory by the MMA itself)
        assert count(ptx, r"ldmatrix\.sync\.aligned\.m8n8\.x4\.trans\.shared\.b16") > 0  # V as float16, transposed
    assert count(ptx, r"cvt\.bf16\.f16") == 0
    assert count(ptx, cvt) > 0  # the conversion (e4m3: the hardware one; e5m2: the byte moved up, a cast or asm)
    assert count(ptx, r"cp\.async\.cg\.shared\.global") > 0  # K/V loads software-pipelined, 16 bytes each


def test_asm_mode_conversions_per_tile():
    """The decode kernel's conversions for a 128-token e4m3 tile (4 warps, 128 threads, 2 x 128 x 128
    values): one ``cvt.rn.f16x2.e4m3x2`` per pair of values a thread, 2 x 128 x 128 / 2 / 128 = 128,
    against the cast to bf16's 128 + 256 ``cvt.bf16.f16`` (the kernel before session 17)."""
    ptx = decode_ptx("*fp8e4nv", 2)
    assert count(ptx, r"cvt\.rn\.f16x2\.e4m3x2") == 128
    old = decode_ptx("*fp8e4nv", 0)
    assert count(old, r"cvt\.rn\.f16x2\.e4m3x2") == 128 and count(old, r"cvt\.bf16\.f16") == 256
