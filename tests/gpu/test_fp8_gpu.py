"""fp8 W8A8 on a CUDA GPU: the ``torch._scaled_mm`` path against the emulated (CPU) path.

- quantization is bit-identical on GPU and CPU (same float32 division, same fp8 rounding);
- ``fp8_linear_scaled_mm`` == ``fp8_linear_emulated`` on the same operands, up to the fp8
  tensor cores' reduced-precision accumulation (bounded relative to the sum of |products|) and the output rounding (bf16 / fp16 / fp32
  outputs, shapes that need K / N padding, an empty batch, biases), and == the CPU result;
- a linear layer picks ``_scaled_mm`` by itself on sm89+ and runs inside a CUDA graph, which
  sees in-place re-quantized weights on replay;
- whole tiny models: GPU fp8 (bf16 activations) vs CPU fp8 emulated vs unquantized fp32
  logits, and the engine serving ``quantization="fp8"`` with CUDA graphs. The numbers are
  printed and written as JSON to ``$RLSERVE_GPU_REPORT/fp8.json`` when that is set.
- a speed comparison of ``_scaled_mm`` against a bf16 matmul (printed, not asserted).
"""

from __future__ import annotations

import json
import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from rlserve.layers.fp8 import (  # noqa: E402
    FP8_DTYPE,
    Fp8Config,
    Fp8LinearMethod,
    fp8_linear_emulated,
    fp8_linear_scaled_mm,
    quantize_per_row,
    scaled_mm_supported,
)
from rlserve.layers.linear import ReplicatedLinear  # noqa: E402
from tests.gpu.report import write_report  # noqa: E402

DEV = torch.device("cuda")
needs_fp8 = pytest.mark.skipif(not torch.cuda.is_available() or not scaled_mm_supported(DEV),
                               reason="fp8 _scaled_mm needs compute capability >= 8.9")
REPORT: dict = {}
# bound on |_scaled_mm - exact| / sum|products| (see test_scaled_mm_equals_emulated)
FP8_MMA_REL_BOUND = 2.0 ** -8


def _u8(t):
    return t.view(torch.uint8)


def _operands(T, K, N, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, K, generator=g) * torch.logspace(-2, 1, max(T, 1))[:T].unsqueeze(1)).to(dtype)
    w = torch.randn(N, K, generator=g) * 0.05
    w[0, 0] = 3.0  # an outlier in row 0
    b = torch.randn(N, generator=g).to(dtype)
    return x, w, b


def _write_report():
    write_report("fp8", REPORT)


def test_quantization_bit_identical_on_gpu_and_cpu():
    x, w, _ = _operands(33, 256, 96, dtype=torch.float32)
    for t in (x, w, x.bfloat16()):
        qc, sc = quantize_per_row(t)
        qg, sg = quantize_per_row(t.to(DEV))
        assert torch.equal(_u8(qg).cpu(), _u8(qc))
        assert torch.equal(sg.cpu(), sc)


@needs_fp8
@pytest.mark.parametrize("T,K,N", [(1, 64, 64), (7, 576, 960), (128, 576, 1536), (1000, 1536, 576),
                                   (5, 72, 40), (3, 64, 100), (0, 64, 64)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scaled_mm_equals_emulated(T, K, N, out_dtype):
    x, w, b = _operands(T, K, N, dtype=out_dtype)
    wq, ws = quantize_per_row(w)
    ws = ws.view(-1)
    xg, wqg, wsg, bg = x.to(DEV), wq.to(DEV), ws.to(DEV), b.to(DEV)
    fast = fp8_linear_scaled_mm(xg, wqg, wsg, bg, out_dtype)
    emu_gpu = fp8_linear_emulated(xg, wqg, wsg, bg, out_dtype)
    emu_cpu = fp8_linear_emulated(x, wq, ws, b, out_dtype)
    assert fast.shape == (T, N) and fast.dtype == out_dtype
    if T == 0:
        return
    # Same function up to how the products are summed. Hopper's fp8 tensor cores do not keep a
    # full float32 accumulator: "the accumulation precision of FP8 GEMM on NVIDIA H800 GPUs is
    # limited to retaining around 14 bits" (DeepSeek-V3 technical report, arXiv:2412.19437,
    # section 3.3.2). So the error is bounded relative to the sum of |products| -- the size of
    # what is accumulated (an output that cancels to near zero makes a tolerance relative to the
    # output meaningless) -- plus the output dtype's rounding. Measured on an H200 (2026-12-01,
    # `python benchmarks/fp8_mma_error.py --seeds 3`: 165 cases, K = 16..8192, float32 output):
    # at most 2^-10.1 of that sum (2^-12.2 at K=16, largest 2^-10.1 at K=128, 2^-14.9 at
    # K=8192), against 2^-23 for the float32 emulation. Asserted at 2^-8: ~4x the largest
    # measured error, and 32 truncations of 2^-13 each (a ~14-bit accumulator).
    # (Before 2026-12-01 this bound was 2^-20, from a run that happened to pick other kernels;
    # 12 of 21 cases then failed on an H200.)
    xq, xs = quantize_per_row(x)
    mag = (xq.float().abs() @ wq.float().abs().t()) * xs * ws.view(1, -1)  # [T, N] float32
    ulp = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -23}[out_dtype]
    for got in (fast, emu_gpu):
        err = (got.float().cpu() - emu_cpu.float()).abs()
        allowed = FP8_MMA_REL_BOUND * mag + ulp * (emu_cpu.float().abs() + b.float().abs()) + 1e-6
        normalized = ((err - ulp * (emu_cpu.float().abs() + b.float().abs())).clamp_min(0) / mag.clamp_min(1e-30))
        REPORT.setdefault("scaled_mm_err_over_sum_abs_products", {})[f"{T}x{K}x{N} {out_dtype}"] = normalized.max().item()
        assert (err <= allowed).all(), (err - allowed).max().item()
    exact = x.float() @ w.t() + b.float()
    rel = ((fast.float().cpu() - exact).norm() / exact.norm()).item()
    REPORT.setdefault("scaled_mm_vs_exact_rel", {})[f"{T}x{K}x{N} {out_dtype}"] = rel
    assert rel < 0.05


@needs_fp8
def test_layer_uses_scaled_mm_and_runs_in_cuda_graph():
    torch.manual_seed(0)
    with torch.device(DEV):
        lin = ReplicatedLinear(576, 1536, bias=True, params_dtype=torch.bfloat16, quant_config=Fp8Config())
    assert isinstance(lin.quant_method, Fp8LinearMethod)
    w = torch.randn(1536, 576) * 0.02
    lin.weight.weight_loader(lin.weight, w)
    lin.bias.weight_loader(lin.bias, torch.randn(1536))
    x = torch.randn(16, 576, device=DEV, dtype=torch.bfloat16)
    assert lin.quant_method.use_scaled_mm(x)
    calls = []
    orig = torch._scaled_mm

    def spy(*a, **k):
        calls.append(1)
        return orig(*a, **k)

    torch._scaled_mm = spy
    try:
        y = lin(x)
    finally:
        torch._scaled_mm = orig
    assert calls and y.dtype == torch.bfloat16
    ref = fp8_linear_emulated(x, lin.weight, lin.weight_scale, lin.bias)
    torch.testing.assert_close(y.float(), ref.float(), rtol=1e-2, atol=1e-2)

    # CUDA graph: capture once, replay on new inputs and after an in-place weight re-quantization
    static_x = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            lin(static_x)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = lin(static_x)
    static_x.copy_(torch.randn_like(static_x))
    graph.replay()
    torch.testing.assert_close(static_y, lin(static_x), rtol=0, atol=0)
    ptr = lin.weight.data_ptr()
    lin.weight.weight_loader(lin.weight, w * 3 + 0.01)  # a weight sync
    assert lin.weight.data_ptr() == ptr
    graph.replay()
    torch.testing.assert_close(static_y, lin(static_x), rtol=0, atol=0)
    exact = static_x.float() @ (w * 3 + 0.01).t().to(DEV) + lin.bias.float()
    assert ((static_y.float() - exact).norm() / exact.norm()).item() < 0.06


@needs_fp8
@pytest.mark.parametrize("arch", ["llama", "qwen2", "opt", "smollm"])
def test_model_fp8_gpu_vs_cpu_and_unquantized(arch, tiny_model):
    from transformers import AutoConfig

    from rlserve.config import EngineConfig
    from rlserve.loader import load_model
    from tests.test_fp8_models import _generate, _prompts

    path = tiny_model(arch)
    hf = AutoConfig.from_pretrained(path)

    def load(device, dtype, quant):
        ec = EngineConfig(model=path, device=str(device), dtype=str(dtype).replace("torch.", ""), quantization=quant)
        return load_model(ec, hf, device, dtype)

    prompts = _prompts(hf.vocab_size)
    ref, _ = _generate(load("cpu", torch.float32, None), prompts, 1)
    cpu8, _ = _generate(load("cpu", torch.float32, "fp8"), prompts, 1)
    gpu = load(DEV, torch.bfloat16, "fp8")
    # the GPU model's fp8 weights are bit-identical to the CPU model's
    cpu_model = load("cpu", torch.float32, "fp8")
    for (n, p), (_, q) in zip(gpu.named_parameters(), cpu_model.named_parameters()):
        if p.dtype == FP8_DTYPE or n.endswith("weight_scale"):
            assert torch.equal(p.data.cpu().view(torch.uint8) if p.dtype == FP8_DTYPE else p.data.cpu(),
                               q.data.view(torch.uint8) if q.dtype == FP8_DTYPE else q.data), n
    gpu_logits = _gpu_generate(gpu, prompts)
    gpu32_logits = _gpu_generate(load(DEV, torch.float32, "fp8"), prompts, torch.float32)
    bf16_logits = _gpu_generate(load(DEV, torch.bfloat16, None), prompts)

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    row = {
        "gpu_fp8_fp32act_vs_cpu_fp8_rel": rel(gpu32_logits, cpu8),
        "gpu_fp8_fp32act_vs_fp32_rel": rel(gpu32_logits, ref),
        "gpu_fp8_bf16act_vs_fp32_rel": rel(gpu_logits, ref),
        "gpu_fp8_bf16act_vs_fp32_max_abs": (gpu_logits - ref).abs().max().item(),
        "gpu_fp8_bf16act_vs_fp32_top1": (gpu_logits.argmax(-1) == ref.argmax(-1)).float().mean().item(),
        "gpu_bf16_vs_fp32_rel": rel(bf16_logits, ref),
        "cpu_fp8_vs_fp32_rel": rel(cpu8, ref),
    }
    REPORT.setdefault("models", {})[arch] = row
    print(arch, row)
    _write_report()
    # The GPU (_scaled_mm) and CPU (emulated) models compute the same function up to accumulation
    # precision (see test_scaled_mm_equals_emulated); through a model those last-bit differences
    # flip some activations to the neighbouring fp8 value (a 2^-3 step), so the two logits differ
    # by a fraction of the fp8 error itself. Measured on an H200 (2026-11-29): GPU-vs-CPU 0.7-1.6%
    # against an fp8 error of 4.1-4.9%. Asserted: the GPU's fp8 error equals the CPU's within 25%,
    # and GPU-vs-CPU stays under half the fp8 error.
    fp8_err = row["cpu_fp8_vs_fp32_rel"]
    assert abs(row["gpu_fp8_fp32act_vs_fp32_rel"] - fp8_err) <= 0.25 * fp8_err
    assert row["gpu_fp8_fp32act_vs_cpu_fp8_rel"] < 0.5 * fp8_err
    assert row["gpu_fp8_bf16act_vs_fp32_rel"] < 0.08


def _gpu_generate(model, prompts, dtype=torch.bfloat16):
    from rlserve.layers.attention import Attention, AttentionMetadata

    block = 4
    seqs = [list(p) for p in prompts]
    per = -(-max(map(len, seqs)) // block)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(seqs))]
    for m in model.modules():
        if isinstance(m, Attention):
            m.k_cache = torch.zeros(per * len(seqs), block, m.num_kv_heads, m.head_dim, dtype=dtype, device=DEV)
            m.v_cache = torch.zeros_like(m.k_cache)
    qlens = [len(s) for s in seqs]
    ids = torch.tensor([t for s in seqs for t in s], device=DEV)
    pos = torch.tensor([i for s in seqs for i in range(len(s))], device=DEV)
    meta = AttentionMetadata.build(qlens, qlens, tables, block, DEV)
    with torch.no_grad():
        return model.compute_logits(model(ids, pos, meta)).float().cpu()


@needs_fp8
def test_engine_serves_fp8_with_cuda_graphs(tiny_model):
    from rlserve import LLM, SamplingParams
    from rlserve.loader import iterate_checkpoint

    path = tiny_model("llama")
    kw = dict(device="cuda", num_kv_blocks=256, max_num_seqs=8, block_size=16)
    prompts = ["The capital of France is", "Hello world! Hello there", "Once upon a time", "def main():"]
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
    fp8 = LLM(path, dtype="bfloat16", quantization="fp8", **kw)
    assert fp8.engine.model.model.layers[0].mlp.gate_up_proj.weight.dtype == FP8_DTYPE
    out8 = [o.outputs[0].token_ids for o in fp8.generate(prompts, params)]
    fp8.engine.load_weights(iterate_checkpoint(path))  # re-quantize in place (weight sync)
    again = [o.outputs[0].token_ids for o in fp8.generate(prompts, params)]
    assert again == out8
    eager = LLM(path, dtype="bfloat16", quantization="fp8", enforce_eager=True, **kw)
    assert [o.outputs[0].token_ids for o in eager.generate(prompts, params)] == out8
    bf16 = LLM(path, dtype="bfloat16", **kw)
    outb = [o.outputs[0].token_ids for o in bf16.generate(prompts, params)]
    agree = sum(a == b for x, y in zip(out8, outb) for a, b in zip(x, y)) / sum(map(len, outb))
    REPORT["engine_greedy_agreement_fp8_vs_bf16_tiny_llama"] = agree
    print("engine greedy agreement fp8 vs bf16:", agree)
    _write_report()


@needs_fp8
def test_speed_scaled_mm_vs_bf16():
    """Not asserted: prints ms per call of the fp8 linear (quantizing x included) and bf16."""
    res = {}
    for T, K, N in [(1, 4096, 4096), (16, 4096, 14336), (256, 4096, 14336), (4096, 4096, 4096), (8192, 4096, 14336)]:
        x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(N, K, device=DEV, dtype=torch.bfloat16) * 0.02
        wq, ws = quantize_per_row(w)
        ws = ws.view(-1)

        def bench(fn, n=20):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) / n * 1e3

        res[f"{T}x{K}x{N}"] = {
            "fp8_ms": bench(lambda: fp8_linear_scaled_mm(x, wq, ws)),
            "bf16_ms": bench(lambda: x @ w.t()),
        }
    REPORT["speed_ms"] = res
    print(json.dumps(res, indent=1))
    _write_report()
