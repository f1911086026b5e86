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

Usage:
    python benchmarks/cpu_gemm_ab.py --old-rev 5cca558 --rows 1 8 16 32 128
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
    m, k = x.shape
    # the old signature has no team argument: an extra int argument is ignored by its C code
    rc = lib.rlserve_gemm_f32(x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                              out.data_ptr(), m, n, k, k, out.stride(0), 0, 1)
    if rc != 0:
        raise RuntimeError(f"rlserve_gemm_f32 returned {rc}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old-rev", required=True, help="git revision of the old rlserve/layers/csrc/cpu_team.c")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 128])
    p.add_argument("--turns", type=int, default=4, help="alternating turns per version and row count")
    p.add_argument("--reps", type=int, default=3, help="passes over the model per turn (median)")
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
