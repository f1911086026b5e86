"""Mixture-of-experts on a CUDA GPU: the expert path (today :func:`rlserve.layers.moe.experts_grouped`,
one GEMM pair per expert; the grouped-GEMM kernel of the next round must pass the same checks)
against the dense float32 reference :func:`rlserve.layers.moe.experts_reference`, and a tiny
Qwen3-MoE served on the GPU in float32 against Hugging Face (greedy tokens and routed-experts
replay ids).

Not run in this session (no device time): written to the CPU tests' contracts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from rlserve.layers.moe import experts_grouped, experts_reference, route  # noqa: E402

# Qwen3-30B-A3B's expert shape (128 experts, top-8, hidden 2048, moe_intermediate 768)
E, K, H, I = 128, 8, 2048, 768


def _operands(T: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, device="cuda", generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) / I**0.5).to(dtype)
    weights, ids = route(torch.randn(T, E, device="cuda", generator=g), K, renormalize=True)
    return x, w13, w2, weights.to(dtype), ids


@pytest.mark.parametrize("T", [1, 7, 256])
def test_float32_experts_equal_reference(T):
    """float32 with TF32 off: the same sums in another order; ``atol 1e-4`` on outputs of
    magnitude ~1 (2048- and 768-term float32 dot products, ~1e-6 relative each)."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        x, w13, w2, weights, ids = _operands(T, torch.float32)
        got = experts_grouped(x, w13, w2, weights, ids)
        ref = experts_reference(x, w13, w2, weights, ids)
        assert got.dtype == torch.float32 and got.shape == (T, H)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


@pytest.mark.parametrize("T", [1, 64, 512])
def test_bf16_experts_near_float32_reference(T):
    """bf16 operands against the float32 reference of the same (bf16-rounded) operands:
    relative Frobenius error below 1e-2 -- bf16's unit roundoff is 2^-8 = 3.9e-3 and the path
    rounds twice (the SiLU-gated intermediate and the output), with float32 accumulation."""
    x, w13, w2, weights, ids = _operands(T, torch.bfloat16)
    got = experts_grouped(x, w13, w2, weights, ids)
    ref = experts_reference(x, w13, w2, weights, ids)
    assert got.dtype == torch.bfloat16
    err = (got.float() - ref).norm() / ref.norm()
    assert err < 1e-2, float(err)


def test_tiny_qwen3_moe_on_gpu_equals_hf(tiny_model):
    """float32 engine on the GPU: greedy tokens == HF's (CPU float32), and with replay on the
    routed ids == HF's router top-k for every forwarded token."""
    from rlserve.engine.llm import LLM
    from rlserve.engine.sampling_params import SamplingParams
    from tests.test_engine import hf_greedy
    from tests.test_moe_replay import hf_routed

    path = tiny_model("qwen3_moe")
    prompts = [[5, 17, 42, 9, 77, 3], [100, 101, 7]]
    llm = LLM(path, dtype="float32", device="cuda", enable_return_routed_experts=True)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, min_tokens=12))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 12)
    for o in outs:
        full = o.prompt_token_ids + o.outputs[0].token_ids
        np.testing.assert_array_equal(o.outputs[0].routed_experts.astype(np.int64), hf_routed(path, full[:-1]))
