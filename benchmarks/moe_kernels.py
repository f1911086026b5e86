"""One MoE layer's routed experts on a GPU: the fused-MoE Triton kernel (a few tile
configurations), ``torch._grouped_mm`` and the per-expert loop, bf16 and fp8, against the HBM
floor of the experts the batch touches.

Shape: Qwen3-30B-A3B's experts by default (128 experts, top-8, hidden 2048, moe_intermediate 768;
``--experts/--top-k/--hidden/--inter`` change it), random weights, routing of random logits
(softmax -> top-8 -> renormalize). For each batch of ``T`` tokens:

- ``graph_us``: GPU time of the whole expert path (permutation, two GEMMs, SiLU-and-mul, the
  top-k sum) replayed from a CUDA graph (no Python launch cost), median of ``--iters``; the loop
  cannot be captured (it reads the per-expert counts on the host), so it has ``eager_us`` only.
- ``eager_us``: the same launched from Python, synchronised each call (what an eager step pays).
- the floor: bytes of the distinct experts the batch routes to (``3 * H * I`` weights each, in the
  weight dtype, plus fp8 scales) divided by the device-to-device copy bandwidth measured in the
  same run (bytes read + written, :func:`decode_step.measure_copy_bandwidth`).

Usage:
    python benchmarks/moe_kernels.py --tokens 1,64,256,2048 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from decode_step import cuda_time, graph_time, measure_copy_bandwidth  # noqa: E402

from rlserve.layers import moe_kernels as mk  # noqa: E402
from rlserve.layers.fp8 import quantize_per_row  # noqa: E402
from rlserve.layers.moe import experts_grouped, route  # noqa: E402

#: Triton tile configurations tried per batch (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages)
SWEEP = [
    (16, 64, 128, 1, 4, 4), (16, 128, 128, 1, 4, 3), (16, 64, 64, 1, 4, 4),
    (32, 64, 128, 1, 4, 3), (64, 128, 64, 8, 4, 3), (64, 128, 64, 8, 8, 4), (128, 128, 64, 8, 8, 3),
]


def vllm024_default(tokens: int, num_experts: int) -> tuple[int, int, int, int, int, int]:
    """vLLM 0.24.0's default fused-MoE tiles for bf16 / fp16 experts without a tuned table
    (``fused_moe.get_default_config``, its general branch; ``M`` = the batch's tokens), as
    ``(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages)``: what vLLM ran on the H100 for
    Qwen3-30B-A3B (it ships no H100 table for E=128, N=768). rlserve's default rule
    (:func:`rlserve.layers.moe_kernels.kernel_config`) is an older vLLM's two classes."""
    M = tokens
    bm = 16 if M <= 32 else 32 if M <= 96 else 64 if M <= 512 else 128
    return (bm, 64 if M <= 64 else 128, 128 if M <= 64 else 64, 16 if M // max(num_experts, 1) > 128 else 1,
            4 if M <= 128 else 8, 4 if M <= 32 else 3)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,64,256,2048")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="time every configuration of SWEEP")
    ap.add_argument("--tuned", action="store_true",
                    help="also time the sm90 tuned table's config (moe_kernels.TUNED_SM90) where it differs from "
                         "vLLM's default rule ('triton'), and report its largest difference from 'triton''s output")
    ap.add_argument("--vllm-default", action="store_true",
                    help="also time vLLM 0.24's default rule's config (vllm024_default) where it differs")
    ap.add_argument("--triton-only", action="store_true", help="leave out grouped_mm, the loop and fp8")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    E, K, H, I = args.experts, args.top_k, args.hidden, args.inter
    dev = torch.device("cuda")
    bw = measure_copy_bandwidth(dev)
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, device=dev, generator=g) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device=dev, generator=g) / I**0.5).to(torch.bfloat16)
    q13, s13 = quantize_per_row(w13)
    q2, s2 = quantize_per_row(w2)
    s13, s2 = s13.squeeze(-1), s2.squeeze(-1)
    cap = torch.cuda.get_device_capability()
    rows = []
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e9:.0f} GB/s; experts E={E} K={K} "
          f"H={H} I={I}", flush=True)
    for T in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
        tw, ti = route(torch.randn(T, E, device=dev, generator=g), K, True)
        tw = tw.to(torch.bfloat16)
        used = int(torch.unique(ti).numel())
        floor_bf16 = used * 3 * H * I * 2 / bw
        floor_fp8 = used * (3 * H * I + 4 * (2 * I + H)) / bw
        paths = {f"triton{'' if c == mk.kernel_config(T * K, E) else str(c)}":
                 (lambda c=c: mk.experts_triton(x, w13, w2, tw, ti, config=c))
                 for c in ([mk.kernel_config(T * K, E)] + ([c for c in SWEEP if c != mk.kernel_config(T * K, E)]
                                                           if args.sweep else []))}
        tuned = mk.pick(mk.config_table(E, I, K, tuned=True), T * K)
        if args.tuned and tuned != mk.kernel_config(T * K, E):
            paths[f"triton_tuned{tuned}"] = lambda c=tuned: mk.experts_triton(x, w13, w2, tw, ti, config=c)
        vd = vllm024_default(T, E)
        if args.vllm_default and vd != mk.kernel_config(T * K, E) and not (args.tuned and vd == tuned):
            paths[f"triton_vllm024{vd}"] = lambda c=vd: mk.experts_triton(x, w13, w2, tw, ti, config=c)
        if not args.triton_only:
            if cap >= (9, 0):
                paths["grouped_mm"] = lambda: mk.experts_grouped_mm(x, w13, w2, tw, ti)
            paths["loop"] = lambda: experts_grouped(x, w13, w2, tw, ti)
            paths["triton_fp8"] = lambda: mk.experts_triton(x, q13, q2, tw, ti, s13, s2)
        base_out = None
        for name, fn in paths.items():
            row = {"T": T, "path": name, "experts_used": used,
                   "floor_us": (floor_fp8 if "fp8" in name else floor_bf16) * 1e6}
            try:
                if name.startswith("triton") and "fp8" not in name:  # same bf16 sums, other tiles
                    out_now = fn().float()
                    base_out = out_now if base_out is None else base_out
                    row["max_abs_diff_vs_triton"] = (out_now - base_out).abs().max().item()
                row["eager_us"] = cuda_time(fn, iters=args.iters) * 1e6
                if name != "loop":
                    row["graph_us"] = graph_time(fn, iters=args.iters) * 1e6
            except Exception as exc:  # a configuration that does not compile / fit: recorded, skipped
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            best = row.get("graph_us", row.get("eager_us"))
            if best:
                row["x_floor"] = best / row["floor_us"]
            rows.append(row)
            print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    out = {"device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bw / 1e9, "E": E, "K": K, "H": H, "I": I,
           "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
