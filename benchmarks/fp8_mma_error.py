"""Accumulation error of the GPU's fp8 matrix product (``torch._scaled_mm``) over many shapes.

``fp8_linear_scaled_mm`` and the emulated fp8 linear compute the same function except for
how the products of the fp8 operands are summed: the emulation sums in float32 (and is
within float32 rounding of the exact sum), the GPU in its fp8 tensor cores. On Hopper those
do not keep a full float32 accumulator: DeepSeek-V3's technical report (arXiv:2412.19437,
section 3.3.2, "Increasing Accumulation Precision") measured that "the accumulation
precision of FP8 GEMM on NVIDIA H800 GPUs is limited to retaining around 14 bits", so
each partial sum may lose up to ~2^-13 of its magnitude.

This script measures, for random per-row-quantized operands (activations spread over four
decades, one outlier weight, the test's ``_operands``), the largest error of the float32
output of ``torch._scaled_mm`` (no bias, so no output rounding beyond float32) against the
exact (float64) sum, divided by the sum of |products| at that output::

    e = max |fast - exact| / (sum_k |xq_k * wq_k| * x_scale * w_scale)

over shapes ``T x K x N`` and seeds, and the same for the float32 emulation. It prints one
line per K and the maximum, in units of 2^-k. ``tests/gpu/test_fp8_gpu.py`` bounds the
error with these numbers.

Usage:
    python benchmarks/fp8_mma_error.py [--seeds 6] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rlserve.layers.fp8 import fp8_linear_emulated, fp8_linear_scaled_mm, quantize_per_row  # noqa: E402


def operands(T: int, K: int, N: int, seed: int):
    """The operands of ``tests/gpu/test_fp8_gpu.py::_operands`` (float32)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g) * torch.logspace(-2, 1, max(T, 1))[:T].unsqueeze(1)
    w = torch.randn(N, K, generator=g) * 0.05
    w[0, 0] = 3.0
    return x, w


def measure(T: int, K: int, N: int, seed: int, dev: torch.device) -> dict:
    x, w = operands(T, K, N, seed)
    x, w = x.to(dev), w.to(dev)
    wq, ws = quantize_per_row(w)
    ws = ws.view(-1)
    xq, xs = quantize_per_row(x)
    scale = xs.double() * ws.double().view(1, -1)
    exact = (xq.double() @ wq.double().t()) * scale  # float64 on the GPU: exact products, ~2^-53 sums
    mag = (xq.double().abs() @ wq.double().abs().t()) * scale
    fast = fp8_linear_scaled_mm(x, wq, ws, None, torch.float32).double()
    emu = fp8_linear_emulated(x.cpu(), wq.cpu(), ws.cpu(), None, torch.float32).to(dev).double()
    den = mag.clamp_min(1e-300)
    return {
        "fast": ((fast - exact).abs() / den).max().item(),
        "emulated": ((emu - exact).abs() / den).max().item(),
    }


def log2_or_inf(v: float) -> float:
    return math.log2(v) if v > 0 else float("-inf")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    Ks = [16, 32, 64, 72, 128, 256, 576, 1024, 1536, 4096, 8192]
    TNs = [(1, 64), (7, 960), (128, 1536), (1000, 576), (256, 4096)]
    by_k = {}
    for K in Ks:
        worst = {"fast": 0.0, "emulated": 0.0}
        for T, N in TNs:
            for seed in range(args.seeds):
                r = measure(T, K, N, seed, dev)
                worst["fast"] = max(worst["fast"], r["fast"])
                worst["emulated"] = max(worst["emulated"], r["emulated"])
        by_k[K] = worst
        print(f"K={K:5d}  fast max err / sum|products| = {worst['fast']:.3e} (2^{log2_or_inf(worst['fast']):.1f})"
              f"   float32 emulation {worst['emulated']:.3e} (2^{log2_or_inf(worst['emulated']):.1f})", flush=True)
    overall = max(v["fast"] for v in by_k.values())
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes_TN": TNs, "seeds": args.seeds,
            "by_K": by_k, "max_fast": overall, "max_fast_log2": log2_or_inf(overall)}
    print(f"max over {len(Ks) * len(TNs) * args.seeds} cases: {overall:.3e} = 2^{log2_or_inf(overall):.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1)
    return info


if __name__ == "__main__":
    main()
