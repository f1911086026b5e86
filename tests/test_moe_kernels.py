"""The fused-MoE Triton kernel on CPU through Triton's interpreter (``TRITON_INTERPRET=1``):
:func:`rlserve.layers.moe_kernels.experts_triton` against the dense float32 reference for
several tile configurations (blocks of one expert, padding rows, column / K tails), fp8 weights
against the fp8 emulation, and a tiny Qwen3-MoE engine with ``RLSERVE_MOE_BACKEND=triton`` against
the CPU loop. Skipped with CUDA present (``tests/gpu/test_moe_gpu.py`` runs the compiled
kernel) or without Triton. The interpreter has no bfloat16 dot: float16 covers reduced precision.
"""

from __future__ import annotations

import pytest
import torch

import tests.triton_interp  # noqa: F401  (skips this module, or sets TRITON_INTERPRET=1 first)
from rlserve.layers import moe_kernels as mk  # noqa: E402
from rlserve.layers.fp8 import quantize_per_row  # noqa: E402
from rlserve.layers.moe import experts_fp8_emulated, experts_reference, route  # noqa: E402

E, K, H, I = 8, 2, 40, 48  # H and I not multiples of the tiles: masked K / N tails


def _operands(T, dtype, seed=0):
    from tests.test_moe_paths import make_operands

    return make_operands(T, E, K, H, I, dtype, seed)


@pytest.mark.parametrize("config", [None, (16, 16, 16, 1, 4, 1), (16, 32, 32, 2, 4, 1)])
@pytest.mark.parametrize("T", [1, 5, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_experts_equal_reference(T, dtype, config):
    """float32 (IEEE dots): ``atol 1e-5`` (48-term float32 sums in another order, outputs ~1).
    float16: relative Frobenius error below 4e-3 (the intermediate and output are rounded to
    float16, unit roundoff 2^-11 = 4.9e-4, each; 8 x that as margin for the K-slot terms)."""
    x, w13, w2, weights, ids = _operands(T, dtype, seed=T)
    got = mk.experts_triton(x, w13, w2, weights, ids, config=config)
    ref = experts_reference(x, w13, w2, weights, ids)
    assert got.dtype == dtype and got.shape == (T, H)
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    else:
        assert ((got.float() - ref).norm() / ref.norm()).item() < 4e-3


@pytest.mark.parametrize("config", sorted({c for _, c in mk.TUNED_SM90[(128, 768)]}))
def test_triton_experts_tuned_tiles_equal_reference(config):
    """The tuned table's tiles (up to 128 x 256, K steps of 64 / 128) over this small shape: every
    block mostly padding rows, N and K tails masked; float32 with the 1e-5 bound above. The
    interpreter ignores ``num_warps`` / ``num_stages``: those run on a GPU only
    (``tests/gpu/test_moe_gpu.py::test_tuned_table_configs_near_float32_reference``)."""
    x, w13, w2, weights, ids = _operands(20, torch.float32, seed=3)
    got = mk.experts_triton(x, w13, w2, weights, ids, config=config)
    torch.testing.assert_close(got, experts_reference(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_m", [1, 4, 16])
@pytest.mark.parametrize("T", [1, 3, 40])
def test_triton_align_contract(T, block_m):
    """The two-kernel permutation meets :func:`moe_align_torch`'s contract (pairs of an expert
    in any order); 128 experts / top-8 exercises the histogram's padded bins."""
    from tests.test_moe_paths import check_alignment

    for n_exp, k in ((E, K), (128, 8)):
        ids = route(torch.randn(T, n_exp, generator=torch.Generator().manual_seed(T)), k, True)[1]
        check_alignment(ids, n_exp, block_m, mk.moe_align_triton(ids, n_exp, block_m))


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("n_exp,k", [(8, 2), (60, 4), (128, 8)])
def test_topk_softmax_equals_route(n_exp, k, renormalize):
    """The fused routing kernel: the same ids as ``torch.topk`` of the float32 softmax (random
    logits: no ties) and weights within 1e-6 (float32 exp / sum in another order; weights <= 1)."""
    from rlserve.layers.moe import route_torch

    logits = torch.randn(7, n_exp, generator=torch.Generator().manual_seed(n_exp))
    w, ids = mk.topk_softmax(logits, k, renormalize)
    rw, rids = route_torch(logits, k, renormalize)
    assert ids.dtype == torch.int64 and torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, atol=1e-6, rtol=1e-5)
    w16 = mk.topk_softmax(logits.half(), k, renormalize)[0]
    assert w16.dtype == torch.float16  # one float16 rounding of the float32 weight (unit roundoff 2^-11)
    torch.testing.assert_close(w16, route_torch(logits.half(), k, renormalize)[0], atol=1e-3, rtol=2**-10)


def test_triton_fp8_equals_emulation():
    """fp8 weights and per-row fp8 activations: the kernel's float32 products of the same fp8
    values equal :func:`experts_fp8_emulated` up to float32 summation order (``atol 1e-5``)."""
    x, w13, w2, weights, ids = _operands(6, torch.float32, seed=3)
    q13, s13 = quantize_per_row(w13)
    q2, s2 = quantize_per_row(w2)
    got = mk.experts_triton(x, q13, q2, weights, ids, s13.squeeze(-1), s2.squeeze(-1))
    emu = experts_fp8_emulated(x, q13, q2, weights, ids, s13.squeeze(-1), s2.squeeze(-1))
    torch.testing.assert_close(got, emu, atol=1e-5, rtol=1e-5)


def test_engine_with_triton_experts_equals_loop(tiny_model, monkeypatch):
    """A float32 tiny Qwen3-MoE engine whose experts run the (interpreted) kernel: greedy tokens
    equal the CPU loop's."""
    from rlserve import LLM, SamplingParams

    path = tiny_model("qwen3_moe")
    prompts = [[5, 17, 42, 9, 77, 3], [100, 101, 7]]
    params = SamplingParams(temperature=0, max_tokens=5, min_tokens=5)
    ref = [o.outputs[0].token_ids for o in LLM(path, dtype="float32", device="cpu").generate(prompts, params)]
    calls = []
    real = mk.experts_triton
    monkeypatch.setattr(mk, "experts_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("RLSERVE_MOE_BACKEND", "triton")
    got = [o.outputs[0].token_ids for o in LLM(path, dtype="float32", device="cpu").generate(prompts, params)]
    assert calls and got == ref
