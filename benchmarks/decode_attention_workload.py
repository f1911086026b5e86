"""Decode attention over the offline workload's steps: kernel plans side by side (GPU only).

Replays the attention inputs of ``throughput.py``'s workload (``--num-seqs`` sequences, prompt
and output lengths in ``[--min-len, --max-len]``, seed 0): at decode step ``t`` the sequences
whose output is longer than ``t`` are in the batch, each with a context of ``prompt + t``
tokens. For every ``--stride``-th step and every variant, a CUDA graph of ``--layers``
attention calls (each on its own KV cache, so L2 holds none of the next call's K/V; about
2 GB each at 256 x 2056 tokens) at the batch size the engine would replay (the smallest
captured size >= B, padding rows of context 0, ``max_seq_len = max_model_len``, as
``DecodeCUDAGraphs`` does) is replayed ``--iters`` times; the time per call x the model's
layers x the stride, summed over the sampled steps, estimates the workload's decode
attention time (to compare with ``throughput.py --kernel-profile``'s ``_decode_kernel`` +
``_decode_reduce_kernel`` rows) and its K/V read rate.

Variants (``--variants``, comma-separated): ``default`` (the kernel as configured),
``warpsK`` / ``blocknN`` (``DECODE_NUM_WARPS = K`` / ``DECODE_BLOCK_N = N``), ``chunkN``
(fixed-size chunks of ``N`` tokens: only with the kernel of the commit that added this file,
which had them; measured slower at every batch size and not kept, see BENCHMARKS.md). Usage,
on the GPU machine:

    python3 benchmarks/decode_attention_workload.py --shape qwen3-0.6b --variants default,warps8
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# (heads, kv heads, head dim, layers) of the model shapes the issue names
SHAPES = {"qwen3-0.6b": (16, 8, 128, 28), "qwen3-8b": (32, 8, 128, 36)}


def workload_steps(num_seqs: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    """Per decode step ``t = 1..max_out-1``: the contexts (tokens) of the sequences still
    decoding, in request order."""
    from throughput import make_workload

    prompts, out_lens = make_workload(num_seqs, min_len, max_len, 151936, seed)
    plens = [len(p) for p in prompts]
    return [[p + t for p, o in zip(plens, out_lens) if o > t] for t in range(1, max(out_lens))]


def run_variant(name: str, ta, shape, steps, args, caches, bt, max_model_len, block_size) -> list[dict]:
    """Per sampled step: ``{t, B, bs, us_per_call}`` for one variant."""
    from rlserve.engine.worker.cuda_graph import capture_sizes
    from rlserve.layers.attention import AttentionMetadata

    H, Hkv, D, _ = shape
    kw = {}
    ta.DECODE_NUM_WARPS, ta.DECODE_BLOCK_N = 4, 64
    if name.startswith("chunk"):  # needs triton_paged_attention(chunk=): this file's first commit only
        kw["chunk"] = int(name[5:])
    elif name.startswith("warps"):
        ta.DECODE_NUM_WARPS = int(name[5:])
    elif name.startswith("blockn"):
        ta.DECODE_BLOCK_N = int(name[6:])
    elif name != "default":
        raise ValueError(f"unknown variant {name!r}")
    sizes = capture_sizes(args.num_seqs)
    dev = torch.device("cuda")
    seq_buf = torch.zeros(args.num_seqs, dtype=torch.int32, device=dev)
    q = torch.randn(args.num_seqs, H, D, device=dev, dtype=torch.bfloat16)
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    rows = []
    for t in range(0, len(steps), args.stride):
        ctx = steps[t]
        B = len(ctx)
        if B == 0:
            continue
        bs = next(s for s in sizes if s >= B)
        seq_buf.zero_()
        seq_buf[:B] = torch.tensor(ctx, dtype=torch.int32)
        if bs not in graphs:
            meta = AttentionMetadata(
                slot_mapping=torch.full((bs,), -1, device=dev), query_start_loc=torch.arange(bs + 1, device=dev,
                                                                                              dtype=torch.int32),
                seq_lens=seq_buf[:bs], block_tables=bt[:bs], max_query_len=1, max_seq_len=max_model_len,
                block_size=block_size, query_start_loc_cpu=list(range(bs + 1)), seq_lens_cpu=[max_model_len] * bs,
            )

            def fwd():
                meta.backend_cache.clear()
                for kc, vc in caches:
                    ta.triton_paged_attention(q[:bs], kc, vc, meta, D**-0.5, **kw)

            fwd()  # compile
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fwd()
            graphs[bs] = g
        g = graphs[bs]
        g.replay()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(args.iters):
            g.replay()
        e1.record()
        e1.synchronize()
        us = e0.elapsed_time(e1) * 1000 / args.iters / len(caches)
        rows.append({"t": t + 1, "B": B, "bs": bs, "tokens": sum(ctx), "us_per_call": round(us, 2)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--variants", default="default,warps8")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stride", type=int, default=16, help="time every STRIDE-th decode step")
    ap.add_argument("--layers", type=int, default=8, help="attention calls (own KV caches) per replay")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    from rlserve.layers import triton_attention as ta

    shape = SHAPES[args.shape]
    H, Hkv, D, n_layers = shape
    block_size = 16
    max_model_len = 2 * args.max_len + 8  # throughput.py's bound for this workload
    steps = workload_steps(args.num_seqs, args.min_len, args.max_len, args.seed)
    mb = -(-max_model_len // block_size)
    nblocks = args.num_seqs * mb
    g = torch.Generator(device="cuda").manual_seed(0)
    bt = torch.randperm(nblocks, device="cuda", generator=g).to(torch.int32).view(args.num_seqs, mb)
    caches = []
    for _ in range(args.layers):
        kc = torch.empty(nblocks, block_size, Hkv, D, device="cuda", dtype=torch.bfloat16).normal_()
        caches.append((kc, torch.empty_like(kc).normal_()))
    kv_bytes_per_token = 2 * Hkv * D * 2
    out = {"shape": args.shape, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "args": vars(args), "variants": {}}
    for name in args.variants.split(","):
        rows = run_variant(name, ta, shape, steps, args, caches, bt, max_model_len, block_size)
        est_ms = sum(r["us_per_call"] for r in rows) * n_layers * args.stride / 1000
        tbps = sum(r["tokens"] * kv_bytes_per_token / (r["us_per_call"] * 1e-6) for r in rows) / len(rows) / 1e12
        read = sum(r["tokens"] for r in rows) * kv_bytes_per_token * n_layers * args.stride
        out["variants"][name] = {"est_workload_ms": round(est_ms, 1), "tb_per_s_of_total": round(
            read / (est_ms / 1000) / 1e12, 3), "mean_step_tb_per_s": round(tbps, 3), "steps": rows}
        print(f"{name:>10}: est. workload decode attention {est_ms:8.1f} ms, K/V read at "
              f"{read / (est_ms / 1000) / 1e12:.3f} TB/s", flush=True)
    names = list(out["variants"])
    print("step    B   bs  " + "  ".join(f"{n:>9}" for n in names) + "   (us per call)")
    for i, r in enumerate(out["variants"][names[0]]["steps"]):
        print(f"{r['t']:4d} {r['B']:4d} {r['bs']:4d}  " + "  ".join(
            f"{out['variants'][n]['steps'][i]['us_per_call']:9.1f}" for n in names))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
