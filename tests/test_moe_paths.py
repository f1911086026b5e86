"""The GPU expert paths' device-independent parts on CPU: the permutation of
:func:`rlserve.layers.moe_kernels.moe_align` (padding, bound, every pair once), the
``torch._grouped_mm`` path (PyTorch's CPU fallback of the same op) against the dense float32
reference, fp8 experts (``--quantization fp8``: loading both namings, export, the emulated path,
its error against float32, an engine that re-quantizes on a weight load) and the
``RLSERVE_MOE_BACKEND`` switch. The Triton kernel itself runs in ``tests/test_moe_kernels.py``
(interpreter) and ``tests/gpu/test_moe_gpu.py``."""

from __future__ import annotations

import pytest
import torch

from rlserve.layers import moe_kernels as mk
from rlserve.layers.fp8 import FP8_DTYPE, dequantize_per_row, quantize_per_row
from rlserve.layers.moe import FusedMoE, experts_auto, experts_fp8_emulated, experts_grouped, experts_reference, \
    route

T, E, K, H, I = 9, 16, 4, 48, 32


def make_operands(T, E, K, H, I, dtype=torch.float32, seed=0):
    """``(x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights [T, K], ids [T, K])``: Gaussian
    activations, weights scaled by 1/sqrt(fan-in) (outputs ~1), routing of Gaussian logits."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype)
    weights, ids = route(torch.randn(T, E, generator=g), K, True)
    return x, w13, w2, weights.to(dtype), ids


def _operands(seed=0, dtype=torch.float32, T=T):
    return make_operands(T, E, K, H, I, dtype, seed)


def check_alignment(ids: torch.Tensor, num_experts: int, block_m: int, result) -> None:
    """``result`` of a ``moe_align`` for ``ids [T, K]``: padded length within the bound, every pair
    exactly once, each expert's run holding its pairs then padding, blocks labelled."""
    sorted_ids, expert_ids, num_post, offs = (t.cpu() for t in result)
    N = ids.numel()
    counts = torch.bincount(ids.reshape(-1).cpu(), minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    bound = N + min(N, num_experts) * (block_m - 1)  # every expert with tokens padded by < block_m
    assert sorted_ids.shape == (-(-bound // block_m) * block_m,) and sorted_ids.dtype == torch.int32
    assert expert_ids.shape == (sorted_ids.shape[0] // block_m,)
    assert int(num_post) == int(padded.sum()) <= sorted_ids.shape[0]
    assert offs.tolist() == torch.cumsum(counts, 0).tolist()
    n = int(num_post)
    assert sorted(x for x in sorted_ids[:n].tolist() if x < N) == list(range(N)) and (sorted_ids[n:] == N).all()
    flat = ids.reshape(-1).cpu()
    start = 0
    for e in range(num_experts):  # expert e's run: its pairs, then padding, every block labelled e
        run = sorted_ids[start:start + int(padded[e])]
        real = run[:int(counts[e])]
        assert (real < N).all() and (flat[real.long()] == e).all() and (run[len(real):] == N).all()
        assert (expert_ids[start // block_m:(start + int(padded[e])) // block_m] == e).all()
        start += int(padded[e])


@pytest.mark.parametrize("block_m", [1, 4, 16])
@pytest.mark.parametrize("n_tok", [1, 3, 40])
def test_moe_align_pads_every_expert_run_within_the_bound(block_m, n_tok):
    ids = _operands(seed=n_tok, T=n_tok)[4]
    result = mk.moe_align_torch(ids, E, block_m)
    check_alignment(ids, E, block_m, result)
    flat = ids.reshape(-1)
    real = result[0][result[0] < ids.numel()].long()
    # the torch version keeps each expert's pairs ascending (experts ascending too)
    assert real.tolist() == sorted(real.tolist(), key=lambda i: (int(flat[i]), i))


def test_grouped_mm_path_equals_reference():
    """The permutation around ``torch._grouped_mm`` (gather by expert, per-expert offsets,
    weighted scatter back, K-slot sum): float32 ``atol 1e-5`` (sums of at most 48-term products
    in another order on outputs of ~1)."""
    x, w13, w2, weights, ids = _operands()
    try:
        got = mk.experts_grouped_mm(x, w13, w2, weights, ids)
    except (RuntimeError, NotImplementedError) as exc:  # no CPU fallback in this torch
        pytest.skip(f"torch._grouped_mm on CPU: {exc}")
    torch.testing.assert_close(got, experts_reference(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
    assert mk.experts_grouped_mm(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, H)


def test_backend_switch(monkeypatch):
    x, w13, w2, weights, ids = _operands()
    ref = experts_grouped(x, w13, w2, weights, ids)
    monkeypatch.setenv("RLSERVE_MOE_BACKEND", "loop")
    assert torch.equal(experts_auto(x, w13, w2, weights, ids), ref)
    monkeypatch.delenv("RLSERVE_MOE_BACKEND")
    assert torch.equal(experts_auto(x, w13, w2, weights, ids), ref)  # the CPU default: the loop
    monkeypatch.setenv("RLSERVE_MOE_BACKEND", "grouped_mm")  # PyTorch's CPU fallback of the op
    assert torch.equal(experts_auto(x, w13, w2, weights, ids), mk.experts_grouped_mm(x, w13, w2, weights, ids))
    monkeypatch.setenv("RLSERVE_MOE_BACKEND", "cutlass")
    with pytest.raises(ValueError, match="RLSERVE_MOE_BACKEND must be 'triton', 'grouped_mm' or 'loop'"):
        experts_auto(x, w13, w2, weights, ids)


def _fp8_layer(quantized: bool) -> FusedMoE:
    class Fp8:
        name = "fp8"

    return FusedMoE(E, K, H, I, renormalize=True, layer_id=0, params_dtype=torch.float32,
                    quant_config=Fp8() if quantized else None)


def test_fp8_experts_load_both_namings_and_export():
    """Per-expert and fused names quantize to the same fp8 bytes and scales (rows are
    quantized independently); the export is the dequantized weight."""
    _, w13, w2, _, _ = _operands(1)
    a, b = _fp8_layer(True), _fp8_layer(True)
    for e in range(E):
        a.load_expert(w13[e, :I], e, "gate_proj")
        a.load_expert(w13[e, I:], e, "up_proj")
        a.load_expert(w2[e], e, "down_proj")
    b.load_expert(w13, None, "gate_up_proj")
    b.load_expert(w2, None, "down_proj")
    assert a.w13_weight.dtype == FP8_DTYPE and a.w13_weight_scale.shape == (E, 2 * I)
    for name in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"):
        assert torch.equal(getattr(a, name).view(torch.uint8) if "scale" not in name else getattr(a, name),
                           getattr(b, name).view(torch.uint8) if "scale" not in name else getattr(b, name)), name
    q, s = quantize_per_row(w2[3])
    assert torch.equal(a.export_expert(3, "down_proj"), dequantize_per_row(q, s))
    # fp8 e4m3: each weight within half an ulp (2^-4 relative) of the original, plus the subnormal step
    assert ((a.export_expert(5, "gate_proj") - w13[5, :I]).abs()
            <= w13[5, :I].abs() * 2**-4 + s.max() * 2**-9).all()


def test_fp8_forward_is_the_emulation_and_near_float32():
    """The layer's fp8 forward on CPU is :func:`experts_fp8_emulated`; relative error against
    the float32 experts below 0.1 (fp8 e4m3's half-ulp is 2^-5..2^-4 relative on both operands of
    two chained GEMMs: ~5% for Gaussian operands; 6% measured at this shape)."""
    x, w13, w2, weights, ids = _operands(2)
    layer = _fp8_layer(True)
    layer.load_expert(w13, None, "gate_up_proj")
    layer.load_expert(w2, None, "down_proj")
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(9))
    weights, ids = route(logits, K, True)
    got = layer(x, logits)
    emu = experts_fp8_emulated(x, layer.w13_weight, layer.w2_weight, weights, ids, layer.w13_weight_scale,
                               layer.w2_weight_scale)
    assert torch.equal(got, emu)
    ref = experts_reference(x, w13, w2, weights, ids)
    err = ((got - ref).norm() / ref.norm()).item()
    assert 1e-3 < err < 0.1, err


def test_engine_fp8_experts_requantize_on_load(tiny_model):
    """``--quantization fp8`` on a tiny Qwen3-MoE: the experts are fp8; loading the checkpoint
    again (a weight sync's path) re-quantizes in place to the same bytes and greedy tokens."""
    from rlserve import LLM, SamplingParams
    from rlserve.loader import iterate_checkpoint

    path = tiny_model("qwen3_moe")
    llm = LLM(path, dtype="float32", device="cpu", quantization="fp8")
    experts = llm.engine.model.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == FP8_DTYPE and experts.w2_weight_scale.dtype == torch.float32
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    prompts = [[5, 17, 42, 9, 77, 3], [100, 101, 7]]
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    before = experts.w13_weight.view(torch.uint8).clone(), experts.w2_weight_scale.clone()
    experts.w13_weight.data.zero_()
    experts.w2_weight_scale.data.fill_(1.0)
    llm.engine.load_weights(iterate_checkpoint(path))
    assert torch.equal(experts.w13_weight.view(torch.uint8), before[0])
    assert torch.equal(experts.w2_weight_scale, before[1])
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == first
