"""The CPU team's linear kernel (``csrc/cpu_team.c``) of two source versions, one thread, CPU time.

Builds ``cpu_team.c`` of this tree and of ``--old-rev`` (``git show REV:...``), each with the files it
includes of its own revision (``paged_decode.c``, ``paged_prefill.c``, ...: :mod:`benchmarks.csrc_revision`),
with the flags of :mod:`rlserve.layers.cpu_build`, checks that the two give the same bits (rows 1-200 of a
3,000 x 1,536 linear with a bias), then times SmolLM2-135M's 30 layers of linears (qkv 960 x
576, o 576 x 576, gate_up 3,072 x 576, down 576 x 1,536; random weights, ~415 MB) plus the LM
head (49,152 x 576) from memory at each ``--rows``, the two versions alternating (which goes
first alternates too): ``time.thread_time`` of the calling thread with the calls on it alone
(team argument 1), median of ``--reps`` per turn. CPU time, because wall time on the shared
machine mostly measures the other work; the load average is printed with every line.

``--in-cache``: also times each ``--rows`` on a 256 x 576 weight (590 KB: in one core's L2) the
same way, alternating, in batches of 10 calls: the fastest batch of ``--in-cache`` batches per version
(the calls' own speed: a batch that the scheduler or another program's cache traffic interrupted
is slower, never faster) and the median, as GFLOP/s of thread CPU time (ctypes' call overhead, ~1 us
a call, included for both versions).

Usage:
    python benchmarks/cpu_gemm_ab.py --old-rev 5cca558 --rows 1 8 16 32 128
    python benchmarks/cpu_gemm_ab.py --old-rev main --rows 1 8 16 32 --in-cache 300
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.csrc_revision import compile_lib, sources  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M's linears (out, in)
LAYERS, VOCAB, HIDDEN = 30, 49152, 576
ROOT = Path(__file__).resolve().parent.parent  # the repository (git's working directory)
_P, _I = ctypes.c_void_p, ctypes.c_int64


def build(rev: str | None, out: Path) -> ctypes.CDLL:
    """``cpu_team.c`` of git revision ``rev`` (``None``: this tree) with the files it includes of
    the same revision, compiled in the new directory ``out``, its GEMM entry point typed."""
    lib = compile_lib(sources(rev, ROOT, "cpu_team.c"), "cpu_team.c", out)
    lib.rlserve_gemm_f32.argtypes = [_P] * 4 + [_I] * 6 + [ctypes.c_int]
    lib.rlserve_gemm_f32.restype = ctypes.c_int
    return lib


def pack(w: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` -> ``[ceil(N / 32), K, 32]`` panels (as :func:`rlserve.layers.cpu_gemm.pack`)."""
    n, k = w.shape
    p = -(-n // 32)
    if p * 32 != n:
        w = torch.cat([w, w.new_zeros(p * 32 - n, k)])
    return w.reshape(p, 32, k).transpose(1, 2).contiguous()


def gemm(lib, x, packed, n, out, bias=None) -> None:
    """out[m, n] = x @ w^T (+ bias) by ``lib``'s rlserve_gemm_f32, team argument 1 (the calling thread)."""
    m, k = x.shape
    # the old signature has no team argument: an extra int argument is ignored by its C code
    rc = lib.rlserve_gemm_f32(x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                              out.data_ptr(), m, n, k, k, out.stride(0), 0, 1)
    if rc != 0:
        raise RuntimeError(f"rlserve_gemm_f32 returned {rc}")


def in_cache(libs, rows, batches: int, g: torch.Generator, n: int = 256, k: int = 576) -> None:
    """Print one JSON line per row count: each version's GFLOP/s on an ``n x k`` weight that stays
    in L2, the fastest and the median batch of 10 calls (thread CPU time), versions alternating
    every 10 batches."""
    w = pack(torch.randn(n, k, generator=g) * 0.05)
    for m in rows:
        x, out = torch.randn(m, k, generator=g), torch.empty(m, n)
        times = {v: [] for v in libs}
        load0 = os.getloadavg()[0]
        for turn in range(max(1, batches // 10)):
            for v in libs if turn % 2 == 0 else list(libs)[::-1]:
                for _ in range(10):
                    t0 = time.thread_time_ns()
                    for _ in range(10):
                        gemm(libs[v], x, w, n, out)
                    times[v].append(time.thread_time_ns() - t0)
        gf = {v: {"best": round(20.0 * m * n * k / min(t), 1), "median": round(20.0 * m * n * k / sorted(t)[len(t) // 2], 1)}
              for v, t in times.items()}
        print(json.dumps({"in_cache_rows": m, "n": n, "k": k, "gflops_old": gf["old"], "gflops_new": gf["new"],
                          "batches": len(times["old"]), "load_before_after": [round(load0, 2), round(os.getloadavg()[0], 2)]}),
              flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old-rev", required=True, help="git revision of the old rlserve/layers/csrc/cpu_team.c")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 128])
    p.add_argument("--turns", type=int, default=4, help="alternating turns per version and row count")
    p.add_argument("--reps", type=int, default=3, help="passes over the model per turn (median)")
    p.add_argument("--in-cache", type=int, default=0, metavar="BATCHES",
                   help="also time each row count in L2 (256 x 576 weight): batches of 10 calls per version")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="cpu-gemm-ab-"))
    libs = {"old": build(args.old_rev, tmp / "old"), "new": build(None, tmp / "new")}
    g = torch.Generator().manual_seed(0)
    w, b = pack(torch.randn(3000, 1536, generator=g)), torch.randn(3072, generator=g)
    for m in (1, 5, 13, 16, 24, 40, 100, 200):
        x = torch.randn(m, 1536, generator=g)
        outs = {v: torch.empty(m, 3000) for v in libs}
        for v, lib in libs.items():
            gemm(lib, x, w, 3000, outs[v], b)
        if not torch.equal(outs["old"], outs["new"]):
            print(f"DIFFERENT BITS at {m} rows")
            return 1
    if args.in_cache:
        in_cache(libs, args.rows, args.in_cache, g)
    weights = [[pack(torch.randn(n, k, generator=g) * 0.05) for n, k in SHAPES] for _ in range(LAYERS)]
    head = pack(torch.randn(VOCAB, HIDDEN, generator=g) * 0.05)

    def one_pass(lib, m) -> float:
        xs = {k: torch.randn(m, k) for _, k in SHAPES}
        outs = {n: torch.empty(m, n) for n, _ in SHAPES}
        logits = torch.empty(m, VOCAB)
        t = []
        for _ in range(args.reps):
            t0 = time.thread_time()
            for layer in weights:
                for (n, k), pw in zip(SHAPES, layer):
                    gemm(lib, xs[k], pw, n, outs[n])
            gemm(lib, xs[HIDDEN], head, VOCAB, logits)
            t.append(1e3 * (time.thread_time() - t0))
        return sorted(t)[len(t) // 2]

    for m in args.rows:
        res = {"old": [], "new": []}
        load0 = os.getloadavg()[0]
        for turn in range(args.turns):
            for v in ("old", "new") if turn % 2 == 0 else ("new", "old"):
                res[v].append(round(one_pass(libs[v], m), 1))
        print(json.dumps({"rows": m, "old_rev": args.old_rev, "cpu_ms_old": res["old"], "cpu_ms_new": res["new"],
                          "load_before_after": [round(load0, 2), round(os.getloadavg()[0], 2)]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
