"""fp8 KV cache attention kernels: how a K/V byte becomes a dot operand, against the HBM floor.

One Qwen3-0.6B attention layer (16 query heads, 8 KV heads, head_dim 128, 16-token pages handed
out in a shuffled order), ``--batch`` sequences of ``--context`` tokens each, bf16 queries:

- decode (``triton_paged_attention`` with one query per sequence, the engine's split plan), timed
  as a CUDA-graph replay (median of ``--iters``): the bf16 cache (the kernel's default tiles),
  then the fp8 e4m3 cache under each of ``--configs`` ``MODE:BLOCK_N:WARPS:STAGES``
  (``triton_attention.FP8_OPERAND``: ``bf16`` the kernel of sessions 13-16, ``f16``, ``asm``;
  ``DECODE_BLOCK_N_FP8``, ``DECODE_NUM_WARPS``, ``DECODE_NUM_STAGES_FP8``, 0 = Triton's default),
  in that order (the first ``bf16`` row is the reference of ``max_diff_vs_bf16_mode``). Each row: microseconds, the K/V bytes read over the time
  (TB/s), the floor ``K/V bytes / copy bandwidth`` (a 2 GiB device copy measured in the same run,
  read + write bytes) and time / floor, and the largest |difference| from the bf16 cache's output
  and from the ``bf16`` mode's (the fp8 rounding itself, and what the operand mode adds);
- prefill (``--prefill-prompts`` prompts of ``--prefill-len`` tokens, no cache hits), the bf16
  cache and each fp8 mode: microseconds (plain launches, CUDA events).

On a CPU (``--device cpu``, Triton's interpreter: run with ``TRITON_INTERPRET=1``) it only
smoke-tests this script at a tiny shape (wall times of the interpreter mean nothing).

Usage (GPU):
    python3 benchmarks/kv_fp8_kernels.py --batch 256 --context 2048 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from decode_step import cuda_time, graph_time, measure_copy_bandwidth, wall_time  # noqa: E402

H, HKV, D, PAGE = 16, 8, 128, 16


def paged_cache(seq_lens: list[int], dev, g: torch.Generator):
    """bf16 ``[num_blocks, PAGE, HKV, D]`` K and V (normal, std 1; drawn on ``dev`` with ``g``, a
    generator of that device) and the shuffled block tables."""
    per = [-(-s // PAGE) for s in seq_lens]
    nb = sum(per) + 1
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(nb)).tolist()
    tables, i = [], 0
    for n in per:
        tables.append(perm[i : i + n])
        i += n
    kc = torch.randn(nb, PAGE, HKV, D, generator=g, device=dev, dtype=torch.bfloat16)
    vc = torch.randn(nb, PAGE, HKV, D, generator=g, device=dev, dtype=torch.bfloat16)
    return kc, vc, tables


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--configs", default="bf16:64:4:0,asm:128:4:0,asm:64:4:0,f16:64:4:0,asm:128:8:0,asm:128:4:1,"
                    "f16:128:4:0", help="fp8 decode rows, MODE:BLOCK_N:WARPS:STAGES each (0: Triton's default)")
    ap.add_argument("--modes", default="bf16,f16,asm", help="the prefill rows' FP8_OPERAND values")
    ap.add_argument("--prefill-prompts", type=int, default=8)
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    from rlserve.layers import kv_quant
    from rlserve.layers import triton_attention as ta
    from rlserve.layers.attention import AttentionMetadata

    dev = torch.device(args.device)
    gpu = dev.type == "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    bw = measure_copy_bandwidth(dev)
    card = torch.cuda.get_device_name(dev) if gpu else "cpu (interpreter smoke run)"
    info = {"card": card, "copy_TBps": bw / 1e12, "batch": args.batch, "context": args.context,
            "triton": getattr(ta.triton, "__version__", None), "torch": torch.__version__}
    print(json.dumps(info), flush=True)
    out = {"info": info, "decode": [], "prefill": []}
    B, ctx = args.batch, args.context
    kc, vc, tables = paged_cache([ctx] * B, dev, g)
    ones = torch.ones(1, device=dev)
    k8, v8 = kv_quant.quantize(kc, ones, torch.float8_e4m3fn), kv_quant.quantize(vc, ones, torch.float8_e4m3fn)
    meta = AttentionMetadata.build([1] * B, [ctx] * B, tables, PAGE, dev)
    q = torch.randn(B, H, D, generator=g, device=dev, dtype=torch.bfloat16)
    timer = graph_time if gpu else (lambda fn, iters: wall_time(fn, warmup=1, iters=iters))
    knobs = ("FP8_OPERAND", "DECODE_BLOCK_N_FP8", "DECODE_NUM_WARPS", "DECODE_NUM_STAGES_FP8")
    base = {k: getattr(ta, k) for k in knobs}

    def row(kind, mode, bn, nw, st, cache, itemsize, ref_bf16, ref_mode):
        kv_bytes = B * ctx * HKV * D * 2 * itemsize
        r = {"kind": kind, "mode": mode, "block_n": bn, "warps": nw, "stages": st,
             "splits": ta.plan_num_splits(B, HKV, ctx, dev)}
        try:
            res = ta.triton_paged_attention(q, cache[0], cache[1], meta, D**-0.5)
            t = timer(lambda: ta.triton_paged_attention(q, cache[0], cache[1], meta, D**-0.5), iters=args.iters)
            r.update(us=t * 1e6, kv_TBps=kv_bytes / t / 1e12, floor_us=kv_bytes / bw * 1e6)
            r["x_floor"] = r["us"] / r["floor_us"]
            if ref_bf16 is not None:
                r["max_diff_vs_bf16_cache"] = (res.float() - ref_bf16.float()).abs().max().item()
            if ref_mode is not None:
                r["max_diff_vs_bf16_mode"] = (res.float() - ref_mode.float()).abs().max().item()
        except Exception as e:  # a configuration that does not compile or run: say so, go on
            r["error"] = repr(e)[:300]
            res = None
        print("decode", json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}),
              flush=True)
        out["decode"].append(r)
        return res

    try:
        ref = row("bf16 cache", None, ta.DECODE_BLOCK_N, ta.DECODE_NUM_WARPS, 0, (kc, vc), 2, None, None)
        ref_mode = None
        for cfg in args.configs.split(","):
            mode, bn, nw, st = cfg.split(":")
            bn, nw, st = int(bn), int(nw), int(st)
            ta.FP8_OPERAND, ta.DECODE_BLOCK_N_FP8, ta.DECODE_NUM_WARPS = mode, bn, nw
            ta.DECODE_NUM_STAGES_FP8 = st or None
            res = row("fp8 cache", mode, bn, nw, st, (k8, v8), 1, ref, ref_mode)
            if mode == "bf16" and ref_mode is None:
                ref_mode = res
        for k, v in base.items():
            setattr(ta, k, v)
        del kc, vc, k8, v8, ref, ref_mode
        if gpu:
            torch.cuda.empty_cache()

        # prefill: prompts without cache hits (the offline workload's prompts)
        n, L = args.prefill_prompts, args.prefill_len
        pk, pv, ptables = paged_cache([L] * n, dev, g)
        pk8, pv8 = kv_quant.quantize(pk, ones, torch.float8_e4m3fn), kv_quant.quantize(pv, ones, torch.float8_e4m3fn)
        pmeta = AttentionMetadata.build([L] * n, [L] * n, ptables, PAGE, dev)
        pq = torch.randn(n * L, H, D, generator=g, device=dev, dtype=torch.bfloat16)
        ptimer = cuda_time if gpu else (lambda fn, iters: wall_time(fn, warmup=1, iters=iters))
        for mode, cache in [(None, (pk, pv))] + [(m, (pk8, pv8)) for m in args.modes.split(",")]:
            if mode is not None:
                ta.FP8_OPERAND = mode
            r = {"kind": "prefill", "cache": "bf16" if mode is None else "fp8", "mode": mode, "prompts": n, "len": L}
            try:
                r["us"] = ptimer(lambda: ta.triton_paged_attention(pq, cache[0], cache[1], pmeta, D**-0.5),
                                 iters=args.iters) * 1e6
            except Exception as e:
                r["error"] = repr(e)[:300]
            print("prefill", json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}),
                  flush=True)
            out["prefill"].append(r)
    finally:
        for k, v in base.items():
            setattr(ta, k, v)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
