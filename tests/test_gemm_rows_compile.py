"""The small-batch decode GEMM (``rlserve.layers.gemm_rows_kernels``) compiled ahead of time for an H100
(sm_90) by Triton's CUDA backend on this machine, no GPU needed: what the interpreter cannot show.

- the weight loads are software-pipelined (``cp.async``, several stages of shared memory): a kernel that
  streams weights with one load in flight per program leaves HBM bandwidth unused, which is the whole
  point of the kernel (this is what the runtime's specialization of 16-byte aligned pointers and strides
  gives, so the same attributes are passed here);
- the split-K ticket is one acquire-release atomic at GPU scope after a CTA barrier (every thread's
  partial stored before the ticket is taken), and the counter reset a GPU-scope exchange.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_aot import compile_sm90  # noqa: E402  (skips this module where it cannot run)
from rlserve.layers import gemm_rows_kernels  # noqa: E402

ARGS = ["X", "R", "NW", "W", "B", "OUT", "RES_OUT", "WS", "WSS", "CNT", "M", "N", "stride_x", "stride_r", "stride_o",
        "stride_ro", "stride_w", "eps"]
CONST = ["K", "K_PER", "PROLOGUE", "HAS_RES", "HAS_BIAS", "BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT", "IEEE", "PDL"]


def _compile(K, K_PER, PROLOGUE, BM, BN, BK, SPLIT, stages):
    sig = dict(zip(ARGS, ["*bf16"] * 7 + ["*fp32", "*fp32", "*i32"] + ["i32"] * 7 + ["fp32"]))
    sig.update({c: "constexpr" for c in CONST})
    const = dict(K=K, K_PER=K_PER, PROLOGUE=PROLOGUE, HAS_RES=PROLOGUE == 1, HAS_BIAS=False, BLOCK_M=BM,
                 BLOCK_N=BN, BLOCK_K=BK, SPLIT=SPLIT, IEEE=False, PDL=False)
    # what the launcher's specialization sees: 16-byte aligned pointers, N and strides multiples of 16 (M is
    # not specialized)
    return compile_sm90(gemm_rows_kernels._gemm_rows_kernel, sig, const, {*range(10), 11, 12, 13, 14, 15, 16}, 4,
                        stages)


@pytest.mark.parametrize("case", [
    # Qwen3-8B o_proj at 16 rows (K split in 4), down_proj with SiLU-and-mul at 64 rows (split in 8),
    # qkv_proj with the add + RMSNorm at 16 rows (split in 2)
    dict(K=4096, K_PER=1024, PROLOGUE=0, BM=16, BN=64, BK=128, SPLIT=4, stages=4, stage_bytes=(16 + 64) * 128 * 2),
    dict(K=12288, K_PER=1536, PROLOGUE=2, BM=64, BN=128, BK=64, SPLIT=8, stages=4,
         stage_bytes=(64 + 128) * 64 * 2),
    dict(K=4096, K_PER=2048, PROLOGUE=1, BM=16, BN=64, BK=128, SPLIT=2, stages=3, stage_bytes=64 * 128 * 2),
])
def test_pipelined_and_split_k_ticket_for_sm90(case):
    stage_bytes = case.pop("stage_bytes")
    k = _compile(**case)
    assert "async_copy_global_to_local" in k.asm["ttgir"]  # cp.async: loads in flight across iterations
    assert k.metadata.shared >= 2 * stage_bytes, k.metadata.shared  # at least two stages of x + W tiles
    ptx = k.asm["ptx"]
    atom = ptx.index("atom.global.gpu.acq_rel.add")
    assert "bar.sync" in ptx[:atom]  # the CTA barrier before the ticket
    assert "atom.global.gpu.relaxed.exch" in ptx[atom:]  # the reset after the reduction


# Qwen3-8B's linears: (N, K, the form the model folds into them)
LINEARS_8B = {"qkv": (6144, 4096, 1), "o": (4096, 4096, 0), "gate_up": (24576, 4096, 1), "down": (4096, 12288, 2)}


@pytest.mark.parametrize("bm", [16, 64])
@pytest.mark.parametrize("prologue", [0, 1, 2])
def test_qwen3_8b_linears_run_in_one_wave_on_an_h100(bm, prologue):
    """The split plan (``gemv.rows_tile`` on 132 SMs) and each row tile's shared memory (``_ROWS_TILE``,
    ``gemv.rows_stages``; 1 KB a program reserved of an SM's 228 KB): every Qwen3-8B linear's programs fit the
    SMs at once, plain (the default runs all four plain) and in its folded form. Session 17's 64-row tile
    (128 x 128 x 3 stages: 144 KB, one program an SM) ran qkv / o / down in two waves of 4-7 K steps, and
    the folded norm's norm-weight tile at 4 stages (84 KB at 16 rows) gate_up's 384 programs in 1.45."""
    from rlserve.layers import gemv, triton_attention

    bn, bk, _ = gemv._ROWS_TILE[bm]
    k = _compile(K=4096, K_PER=512, PROLOGUE=prologue, BM=bm, BN=bn, BK=bk, SPLIT=8,
                 stages=gemv.rows_stages(bm, prologue))
    per_sm = 228 * 1024 // (k.metadata.shared + 1024)
    prev = triton_attention._SM_COUNT.get(0)
    triton_attention._SM_COUNT[0] = 132
    try:
        for name, (N, K, form) in LINEARS_8B.items():
            if prologue in (0, form):
                _, bn_, _, split, _ = gemv.rows_tile(bm, N, K, torch.device("cuda", 0))
                assert -(-N // bn_) * split <= per_sm * 132, (name, k.metadata.shared, split)
    finally:
        if prev is None:
            triton_attention._SM_COUNT.pop(0)
        else:
            triton_attention._SM_COUNT[0] = prev


def _k_loop(ttgir: str) -> str:
    """The text of the kernel's (one) ``scf.for`` body in ``ttgir``."""
    start = ttgir.index("scf.for")
    end = ttgir.index("scf.yield", start)
    return ttgir[start:end]


@pytest.mark.parametrize("case", [
    # Qwen3-8B qkv_proj with the add + RMSNorm at 16 rows (split in 2), down_proj with SiLU-and-mul (split in 4)
    dict(K=4096, K_PER=2048, PROLOGUE=1, BM=16, BN=64, BK=128, SPLIT=2, stages=3),
    dict(K=12288, K_PER=3072, PROLOGUE=2, BM=16, BN=64, BK=128, SPLIT=4, stages=4),
])
def test_folded_prologue_loads_are_all_pipelined(case):
    """Issue 37: every load of the folded forms' K loop is an asynchronous copy issued stages ahead (no
    ``tt.load`` left in the loop). The norm weight loaded as a ``[BLOCK_K]`` vector was 2 bytes a thread,
    too small for ``cp.async``: a synchronous L2 load, a shared-memory broadcast and a CTA barrier in every
    K step (the loop's critical path), which the ``[BLOCK_M, BLOCK_K]`` tile load removes."""
    loop = _k_loop(_compile(**case).asm["ttgir"])
    assert "async_copy_global_to_local" in loop
    assert "tt.load" not in loop, [line.strip()[:120] for line in loop.splitlines() if "tt.load" in line]
