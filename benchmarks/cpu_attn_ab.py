"""The CPU decode attention kernel (``csrc/paged_decode.c``) of two source versions, one thread, CPU time.

Builds ``paged_decode.c`` of this tree and of ``--old-rev`` (``git show REV:...``) with the flags of
:mod:`rlserve.layers.cpu_build`, checks both against PyTorch's float32
``scaled_dot_product_attention`` (each sequence's context gathered, ``enable_gqa``), then times
SmolLM2-135M's decode attention (9 query heads, 3 KV heads, head_dim 64, blocks of 16) for
``--batch`` sequences of ``--ctx LO HI`` tokens (uniform; issue 37's closed loop: 128-256) over
``--layers`` layers, the two versions alternating turn by turn (which goes first alternates too):
``time.thread_time`` of one pass over all layers on the calling thread (the kernel's
``num_threads`` 1), median of ``--reps`` passes per turn. Every layer has its own K and V cache
(``[blocks, 16, 3, 64]`` float32) with the same shuffled block table, as the engine lays them out,
so with 30 layers the K/V read per pass (``kv_mb`` in the output) comes from memory; ``--hot``
instead runs one layer's cache ``--layers`` times (it stays in L2: the kernel's compute alone).
Prints one JSON line per turn and a summary with GB/s of K/V and GFLOP/s (2 flops per
multiply-add: ``4 * H * D`` per context token) per version; the load average with every line.

Usage:
    python benchmarks/cpu_attn_ab.py --old-rev main --turns 6 --reps 3
    python benchmarks/cpu_attn_ab.py --old-rev main --hot --ctx 128 512
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.csrc_revision import compile_lib, sources  # noqa: E402
from rlserve.layers import cpu_attention  # noqa: E402

H, HKV, D, BS = 9, 3, 64, 16  # SmolLM2-135M's attention, the engine's block size
SCALE = D**-0.5


def build(files: dict[str, str], out: Path):
    """The attention kernel's entry point of ``files`` (a version of ``paged_decode.c``), compiled into ``out``."""
    return cpu_attention.bind(compile_lib(files, "paged_decode.c", out))


def workload(batch: int, lo: int, hi: int, layers: int, hot: bool, seed: int) -> dict:
    """Context lengths, one shuffled block table, per-layer caches (one shared cache when ``hot``) and queries."""
    rng = random.Random(seed)
    lens = [rng.randint(lo, hi) for _ in range(batch)]
    need = [-(-n // BS) for n in lens]
    free = list(range(2 * sum(need)))
    rng.shuffle(free)
    mb = max(need)
    bt = torch.zeros(batch, mb, dtype=torch.int32)
    for b, n in enumerate(need):
        bt[b, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
    g = torch.Generator().manual_seed(seed)
    caches = [(torch.randn(len(free) + sum(need), BS, HKV, D, generator=g),
               torch.randn(len(free) + sum(need), BS, HKV, D, generator=g)) for _ in range(1 if hot else layers)]
    q = [torch.randn(batch, H, D, generator=g) for _ in range(layers)]
    return {"lens": lens, "bt": bt, "sl": torch.tensor(lens, dtype=torch.int32), "caches": caches, "q": q,
            "out": [torch.empty_like(x) for x in q], "layers": layers}


def sdpa_reference(q, kc, vc, bt, lens) -> torch.Tensor:
    """``[B, H, D]``: PyTorch float32 SDPA over each sequence's gathered context (GQA as HF's repeat_kv)."""
    outs = []
    for b, n in enumerate(lens):
        blocks = bt[b, : -(-n // BS)].long()
        k = kc[blocks].reshape(-1, HKV, D)[:n].transpose(0, 1)[None]  # [1, Hkv, n, D]
        v = vc[blocks].reshape(-1, HKV, D)[:n].transpose(0, 1)[None]
        outs.append(F.scaled_dot_product_attention(q[b][None, :, None], k, v, scale=SCALE, enable_gqa=True)[0, :, 0])
    return torch.stack(outs)


def run_pass(fn, wl: dict, outs: list | None = None) -> None:
    """All layers' attention, one thread; appends each layer's output to ``outs`` when given."""
    for layer in range(wl["layers"]):
        kc, vc = wl["caches"][layer % len(wl["caches"])]
        q, out = wl["q"][layer], wl["out"][layer]
        rc = cpu_attention.call(fn, q, kc, vc, wl["bt"], wl["sl"], out, H, HKV, D, SCALE, 1)
        if rc:
            raise RuntimeError(f"kernel refused the shapes: {rc}")
        if outs is not None:
            outs.append(out.clone())


def _median_ms(fn, wl: dict, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.thread_time()
        run_pass(fn, wl)
        times.append(1e3 * (time.thread_time() - t0))
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old-rev", default="main", help="git revision of the baseline paged_decode.c")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--ctx", type=int, nargs=2, default=[128, 256], metavar=("LO", "HI"))
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--hot", action="store_true", help="one layer's cache for every layer (in cache: compute)")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    root = Path(__file__).resolve().parent.parent
    tmp = Path(tempfile.mkdtemp(prefix="cpu_attn_ab_"))
    fns = {"new": build(sources(None, root), tmp / "new"), "old": build(sources(args.old_rev, root), tmp / "old")}
    wl = workload(args.batch, args.ctx[0], args.ctx[1], args.layers, args.hot, args.seed)
    kv_bytes = sum(wl["lens"]) * 2 * HKV * D * 4 * args.layers
    flops = sum(wl["lens"]) * 4 * H * D * args.layers
    check = {}
    for name, fn in fns.items():  # float32 rounding: see tests/test_cpu_attention.py's tolerance
        outs: list = []
        run_pass(fn, wl, outs)
        err = 0.0
        for layer in (0, args.layers - 1):
            kc, vc = wl["caches"][layer % len(wl["caches"])]
            ref = sdpa_reference(wl["q"][layer], kc, vc, wl["bt"], wl["lens"])
            torch.testing.assert_close(outs[layer], ref, atol=2e-6, rtol=2e-5)
            err = max(err, float((outs[layer] - ref).abs().max()))
        check[name] = err
    res: dict = {"new": [], "old": []}
    for turn in range(args.turns):
        for name in (("old", "new") if turn % 2 == 0 else ("new", "old")):
            res[name].append(_median_ms(fns[name], wl, args.reps))
        print(json.dumps({"turn": turn, "old_ms": round(res["old"][-1], 2), "new_ms": round(res["new"][-1], 2),
                          "load": os.getloadavg()[0]}), flush=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    print(json.dumps({
        "case": {"batch": args.batch, "ctx": args.ctx, "mean_ctx": sum(wl["lens"]) / args.batch, "layers": args.layers,
                 "hot": args.hot, "kv_mb": round(kv_bytes / 1e6, 1), "old_rev": args.old_rev},
        "max_abs_diff_vs_sdpa": check,
        **{f"{k}_ms": [round(x, 2) for x in v] for k, v in res.items()},
        **{f"{k}_median_ms": round(v, 2) for k, v in med.items()},
        **{f"{k}_gb_s": round(kv_bytes / med[k] / 1e6, 2) for k in med},
        **{f"{k}_gflop_s": round(flops / med[k] / 1e6, 2) for k in med},
        "new_over_old": round(med["new"] / med["old"], 3),
        "new_lower_in_turns": sum(a < b for a, b in zip(res["new"], res["old"])),
        "load_after": os.getloadavg()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
