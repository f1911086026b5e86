"""The rounding of the fp8-cache attention paths against float64, modelled in torch on the CPU (no GPU).

The decode kernel on an fp8 cache (``rlserve.layers.triton_attention.FP8_OPERAND``) computes, per query
head, ``s = (q . k) x scale`` in float32 from exact operands (every fp8 value is a bf16 and a float16
value; bf16 queries stay exact in float16 inside its range), ``p = exp(s - max)`` in float32, rounds
``p`` to the dot's input dtype (bf16 for ``"bf16"``, the kernel before session 17; float16 for
``"f16"`` / ``"asm"``), accumulates ``p . v`` in float32 and divides by ``sum(p)`` (float32, of the
unrounded p), and stores the output in bf16. This script applies exactly those roundings with torch
(reductions in float32, in another order than the tensor cores: a few float32 ulps) and reports the
output error against float64 attention over the same fp8 cache, before and after the bf16 store:
so the error of each operand path itself, not the fp8 cache's (the same for both).

Inputs: ``--heads`` queries (normal, std ``--q-std``), contexts of ``--context`` keys and values drawn
normal(0, 1) and rounded to e4m3 (scale 1), softmax scale head_dim^-0.5.

Usage: ``python benchmarks/kv_fp8_rounding.py --context 2048 --heads 512``
"""

from __future__ import annotations

import argparse
import json

import torch


def attention(q, k, v, scale, p_dtype):
    """``q [H, D]`` (float64 values of bf16), ``k, v [H, N, D]`` (float64 values of fp8); ``p_dtype`` None:
    float64 throughout; else the kernel's float32 scores, p rounded to ``p_dtype``, float32 sums."""
    if p_dtype is None:
        s = torch.einsum("hd,hnd->hn", q, k) * scale
        p = torch.softmax(s, dim=-1)
        return torch.einsum("hn,hnd->hd", p, v)
    s = torch.einsum("hd,hnd->hn", q.float(), k.float()) * scale
    p = torch.exp(s - s.amax(-1, keepdim=True))
    den = p.sum(-1, keepdim=True)
    pr = p.to(p_dtype).float()
    return torch.einsum("hn,hnd->hd", pr, v.float()) / den


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=512, help="query heads (each its own context)")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--q-std", default="1,4", help="comma-separated query scales (4: peakier softmax)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    g = torch.Generator().manual_seed(args.seed)
    H, N, D = args.heads, args.context, args.head_dim
    k = torch.randn(H, N, D, generator=g).to(torch.float8_e4m3fn).double()
    v = torch.randn(H, N, D, generator=g).to(torch.float8_e4m3fn).double()
    rows = []
    for q_std in (float(x) for x in args.q_std.split(",")):
        q = (torch.randn(H, D, generator=g) * q_std).to(torch.bfloat16).double()
        ref = attention(q, k, v, D**-0.5, None)
        for name, pd in (("bf16 (before s17)", torch.bfloat16), ("f16 / asm", torch.float16)):
            out = attention(q, k, v, D**-0.5, pd).double()
            stored = out.to(torch.bfloat16).double()
            r = {"path": name, "q_std": q_std, "heads": H, "context": N,
                 "max_abs_err": (out - ref).abs().max().item(), "mean_abs_err": (out - ref).abs().mean().item(),
                 "max_abs_err_bf16_out": (stored - ref).abs().max().item(),
                 "mean_abs_err_bf16_out": (stored - ref).abs().mean().item(),
                 "mean_abs_out": ref.abs().mean().item()}
            rows.append(r)
            print(json.dumps({a: (float(f"{b:.4g}") if isinstance(b, float) else b) for a, b in r.items()}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return {"rows": rows}


if __name__ == "__main__":
    main()
