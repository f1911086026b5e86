"""Heads per program of the fused q/k-norm + rotary + KV-write kernel, on a CUDA GPU.

``rlserve.layers.fused_ops.qkv_norm_rope_write`` on decode batches (``T < 1024`` tokens) gives
each program several heads of one token (``_qkv_heads_per_program``; one program per head is
the old kernel). For Qwen3-8B (32 query / 8 KV heads) and Qwen3-0.6B (16 / 8) layers, head_dim
128, bf16, q/k norm, full rotary, and ``T`` in 1, 64, 128, 256 tokens, this times every setting
(1, 2, 4, 8 heads, and the automatic choice): 20 calls captured in one CUDA graph
(``decode_step.graph_time``), median of 20 replays, GPU microseconds per call; and checks that
queries, keys and values equal those of one program per head bit for bit.

Usage:
    python benchmarks/qkv_heads.py
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from decode_step import graph_time  # noqa: E402
from rlserve.layers import fused_ops  # noqa: E402
from rlserve.layers.rotary import RotaryEmbedding  # noqa: E402


def run(T: int, H: int, Hkv: int, D: int = 128) -> list[dict]:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(T + H)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g, device=dev).bfloat16()
    pos = torch.randint(0, 4000, (T,), generator=g, device=dev)
    nb = -(-T // 16) + 1
    slots = torch.randperm(nb * 16, generator=g, device=dev)[:T]
    qw = (1 + 0.2 * torch.randn(D, generator=g, device=dev)).bfloat16()
    kw = (1 + 0.2 * torch.randn(D, generator=g, device=dev)).bfloat16()
    with torch.device(dev):
        rope = RotaryEmbedding(D, D, 4096, {"rope_type": "default", "rope_theta": 1e6})
    kc = torch.zeros(nb, 16, Hkv, D, dtype=torch.bfloat16, device=dev)
    vc = torch.zeros_like(kc)

    def f():
        return fused_ops.qkv_norm_rope_write(qkv, pos, rope.cos_cache, rope.sin_cache, H, Hkv, D, kc, vc, slots,
                                             qw, kw, 1e-6)

    rows, ref = [], None
    prev = fused_ops._QKV_HEADS_PER_PROGRAM
    try:
        for setting in (1, 2, 4, 8, None):
            fused_ops._QKV_HEADS_PER_PROGRAM = setting
            out = (f().clone(), kc.clone(), vc.clone())
            ref = ref or out
            us = graph_time(lambda: [f() for _ in range(20)], iters=20) * 1e6 / 20
            rows.append({"T": T, "H": H, "Hkv": Hkv, "setting": setting or "auto",
                         "heads_per_program": fused_ops._qkv_heads_per_program(T, H + Hkv, dev),
                         "us": round(us, 2),
                         "equal_to_per_head": all(torch.equal(x, y) for x, y in zip(out, ref))})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        fused_ops._QKV_HEADS_PER_PROGRAM = prev
    return rows


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("qkv_heads.py needs a CUDA GPU")
    for H in (32, 16):
        for T in (1, 64, 128, 256):
            run(T, H, 8)


if __name__ == "__main__":
    main()
