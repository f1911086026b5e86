"""Sweep the batch-invariant GEMM's launch configurations per layer shape and row count M (issue 39).

For each linear layer of a model shape (``benchmarks/batch_invariant.py``'s ``linear_shapes``:
q/k/v, o, gate/up, down, the LM head) and each M of ``--ms``, it times (``triton.testing.do_bench``
medians, us, L2 flushed between calls as do_bench does) cuBLAS ``F.linear`` (the mode off), the
mode's tile by M (``rlserve.batch_invariant.gpu.tile``, session 14's) and every configuration of
``rlserve.batch_invariant.gemm_table.CANDIDATES`` that fits M (BLOCK_M 64 up to M = 512, 128 from
M = 128; a ``waves`` launch that gives the same program count as another is timed once), and
compares each one's output bit for bit with ``gemm_table.REFERENCE``'s on the same inputs. The
fastest configuration whose bits are equal is the layer's ``best`` at that M; a configuration that
differs is listed (``differ``) and never chosen. Per M, the sum over one forward step (each
layer's time x its count) for cuBLAS, the tile by M and the best.

``--table-out``: the best configurations as a table (``{"device", "gemms": {"NxK": [[M, cfg],
...]}}``, rewritten after each row) that ``gemm_table.use`` takes (``benchmarks/batch_invariant.py
cost --modes off,on:table=PATH``) and ``rlserve/batch_invariant/gemm_tuned.py`` commits.
``--device cpu`` (a dry run): the Triton interpreter in float32, one call timed, tiny shapes.

Usage:
    python benchmarks/bi_gemm_sweep.py --shapes qwen3-8b,qwen3-0.6b --ms 1,32,64,128,256,2048,8192 \\
        --json sweep.jsonl --table-out tuned.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fits(c, M: int) -> bool:
    """Whether the sweep times configuration ``c`` at M rows: the swapped form up to M = 64, BLOCK_M
    64 up to M = 512, BLOCK_M 128 from M = 128 (a 128-row tile at M <= 64 computes half padding; 64 rows beyond 512 were
    slower in every row of session 15's first GEMM table)."""
    if c.swap:
        return M <= 64
    return (c.BLOCK_M == 64 and M <= 512) or (c.BLOCK_M == 128 and M >= 128)


def warm(args) -> None:
    """``--warm I/N``: one call of each candidate tile shape ``I, I + N, ...`` on the shapes whose
    kernels the sweep, the model and the GPU tests compile (K and N multiples of 16 without bias,
    K = 200 with a bias)."""
    import torch

    from rlserve.batch_invariant import gemm_table, gpu

    i, n = (int(v) for v in args.warm.split("/"))
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    shapes = {(tuple(c[:5]), c.swap, c.tma): c for c in gemm_table.CANDIDATES}
    for c in list(shapes.values())[i::n]:
        for K, N, bias in ((256, 256, False), (200, 100, True)):
            w = torch.randn(N, K, device=dev, dtype=dtype)
            try:
                gpu.linear(torch.randn(64, K, device=dev, dtype=dtype), w,
                           torch.randn(N, device=dev, dtype=dtype) if bias else None, cfg=c)
            except Exception as e:  # noqa: BLE001 - the sweep and the tests report it again
                print(f"warm {tuple(c)} K={K}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    print(f"warm {args.warm}: {len(list(shapes)[i::n])} tiles compiled", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default="qwen3-8b,qwen3-0.6b")
    ap.add_argument("--ms", default="1,32,64,128,256,2048,8192", help="row counts M")
    ap.add_argument("--lm-head-max-m", type=int, default=256,
                    help="the LM head only up to this M (the runner computes logits of the sampled rows only)")
    ap.add_argument("--warmup-ms", type=float, default=1)
    ap.add_argument("--rep-ms", type=float, default=8)
    ap.add_argument("--max-candidates", type=int, default=0, help="only N candidates, spread over the list (a dry run)")
    ap.add_argument("--json", default=None, help="append one JSON line per (layer, M) and per step here")
    ap.add_argument("--table-out", default=None, help="write the best configurations here as a table")
    ap.add_argument("--warm", default=None, metavar="I/N",
                    help="only compile (Triton's disk cache) every N-th candidate tile from the I-th, with and "
                         "without a bias and K = 200: N such processes side by side compile them in parallel")
    args = ap.parse_args()
    if args.warm:
        return warm(args)

    import torch
    import torch.nn.functional as F

    from benchmarks.batch_invariant import linear_shapes
    from rlserve.batch_invariant import gemm_table, gpu

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:
        from triton.testing import do_bench

        def bench(fn):
            return 1000 * do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median")
    else:
        def bench(fn):
            t = time.perf_counter()
            fn()
            return 1e6 * (time.perf_counter() - t)
    name = torch.cuda.get_device_name(dev) if cuda else "cpu (interpreter)"
    sms = gpu._num_sms(dev)
    cands = list(gemm_table.CANDIDATES)
    if args.max_candidates:
        rest = [c for c in cands if c != gemm_table.REFERENCE]
        cands = [gemm_table.REFERENCE] + rest[::max(1, len(rest) // max(1, args.max_candidates - 1))][
            :args.max_candidates - 1]
    ms = [int(m) for m in args.ms.split(",")]
    table: dict[str, list] = {}

    def emit(row):
        if "layer" in row:
            print("GEMM " + json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")

    for shape in args.shapes.split(","):
        layers = linear_shapes(shape)
        for M in ms:
            step = {"cublas": 0.0, "tile_by_m": 0.0, "best": 0.0}
            for layer, K, N, count in layers:
                if layer == "lm_head" and M > args.lm_head_max_m:
                    continue
                g = torch.Generator(device=dev).manual_seed(K + N + M)
                w = torch.randn(N, K, device=dev, dtype=dtype, generator=g)
                x = torch.randn(M, K, device=dev, dtype=dtype, generator=g)
                ref = gpu.linear(x, w, cfg=gemm_table.REFERENCE).view(torch.int16 if cuda else torch.int32)
                t = gpu.tile(M, N, K, torch.bfloat16, sms)
                us = {"cublas": bench(lambda: F.linear(x, w)),
                      "tile_by_m": bench(lambda: gpu.linear(x, w, tile_shape=(t["BLOCK_M"], t["BLOCK_N"],
                                                                            t["num_warps"], t["num_stages"])))}
                timed, differ, failed, seen = {}, [], [], set()
                for c in cands:
                    if not (fits(c, M) or c == gemm_table.REFERENCE):
                        continue
                    tiles = -(-M // c.BLOCK_M) * -(-N // c.BLOCK_N)
                    launch = (tuple(c[:5]), c.swap, c.tma, tiles if c.waves == 0 else min(tiles, c.waves * sms))
                    if launch in seen:
                        continue
                    seen.add(launch)
                    try:
                        out = gpu.linear(x, w, cfg=c)
                    except Exception as e:  # noqa: BLE001 - a tile this Triton / GPU cannot compile
                        failed.append([list(c), type(e).__name__])
                        continue
                    if not torch.equal(out.view(ref.dtype), ref):
                        differ.append(list(c))
                        continue
                    timed[c] = bench(lambda c=c: gpu.linear(x, w, cfg=c))
                best = min(timed, key=timed.get)
                us["best"] = timed[best]
                for k in step:
                    step[k] += us[k] * count
                table.setdefault(f"{N}x{K}", []).append([M, list(best)])
                top = sorted(timed.items(), key=lambda kv: kv[1])[:5]
                if args.table_out:  # after each row: a sweep cut short leaves the rows it did
                    with open(args.table_out, "w") as f:
                        f.write(json.dumps({"device": name, "gemms": table}) + "\n")
                emit({"shape": shape, "layer": layer, "M": M, "K": K, "N": N, "count": count,
                      "us": {k: round(v, 1) for k, v in us.items()}, "best_cfg": list(best),
                      "reference_us": round(timed.get(gemm_table.REFERENCE, float("nan")), 1),
                      "top5": [[list(c), round(v, 1)] for c, v in top], "tried": len(seen), "differ": differ,
                      "failed": failed})
            tot = {k: round(v, 1) for k, v in step.items()}
            emit({"shape": shape, "M": M, "card": name, "step_gemm_us": tot,
                  "over_cublas_pct": {k: round((v / tot["cublas"] - 1) * 100, 1) for k, v in tot.items()}})
            print(f"STEP {shape} M={M}: GEMM us per forward step " + ", ".join(
                f"{k} {v} ({(v / tot['cublas'] - 1) * 100:+.1f}%)" for k, v in tot.items()), flush=True)


if __name__ == "__main__":
    main()
