"""The CPU decode step's two memory streams on 2 MiB pages vs the system's default pages, one thread, CPU time.

Builds two copies of each stream in one process, one through
:func:`rlserve.layers.cpu_hugepages.empty` (2 MiB-aligned, ``MADV_HUGEPAGE``) and one through a
plain ``torch.empty`` (small pages where ``/sys/kernel/mm/transparent_hugepage/enabled`` is
``madvise``, the CI machines' setting; under ``always`` both may get huge pages and the A/B
measures nothing), and times them alternating (which goes first alternates too):

- ``gemm-R``: SmolLM2-135M's 30 layers of linears + the LM head from memory at R rows
  (:mod:`cpu_gemm_ab`'s shapes and packing, the team's kernel on the calling thread alone);
- ``attention``: the paged decode attention (``rlserve/layers/cpu_attention.py``) of 30 layers'
  K/V caches, ``--batch`` sequences of 128-512 tokens, blocks of 16 in shuffled order.

``time.thread_time`` of the calling thread, median of ``--reps`` per turn; one JSON line per
workload with every turn's figure and the load average. Values are checked equal between the
two copies (same bits: only the pages differ).

Usage:
    python benchmarks/cpu_hugepages_ab.py --rows 1 16 --turns 6
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cpu_gemm_ab import HIDDEN, LAYERS, SHAPES, VOCAB, pack  # noqa: E402
from rlserve.layers import cpu_attention, cpu_gemm, cpu_hugepages  # noqa: E402

H, HKV, D, BS = 9, 3, 64, 16  # SmolLM2-135M's attention


def _copy_to(t: torch.Tensor, huge: bool) -> torch.Tensor:
    """``t``'s values in new memory: on 2 MiB pages (``huge``) or plain."""
    os.environ["RLSERVE_CPU_HUGEPAGES"] = "1" if huge else "0"
    out = cpu_hugepages.empty(t.shape, t.dtype)
    out.copy_(t)
    return out


def _median_ms(fn, reps: int) -> float:
    t = []
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        t.append(1e3 * (time.thread_time() - t0))
    return sorted(t)[len(t) // 2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--batch", type=int, default=16, help="sequences of the attention workload")
    p.add_argument("--turns", type=int, default=6, help="alternating turns per page size and workload")
    p.add_argument("--reps", type=int, default=3, help="passes per turn (median)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if not cpu_gemm.available() or not cpu_attention.available():
        print("the CPU kernels are not built here")
        return 1
    lib = cpu_gemm._lib()
    g = torch.Generator().manual_seed(0)
    weights = {True: [], False: []}
    for _ in range(LAYERS):
        for n, k in SHAPES:
            w = pack(torch.randn(n, k, generator=g) * 0.05)
            weights[True].append((_copy_to(w, True), n, k))
            weights[False].append((_copy_to(w, False), n, k))
    head = pack(torch.randn(VOCAB, HIDDEN, generator=g) * 0.05)
    weights[True].append((_copy_to(head, True), VOCAB, HIDDEN))
    weights[False].append((_copy_to(head, False), VOCAB, HIDDEN))
    del head

    rng = random.Random(0)
    lens = [rng.randint(128, 512) for _ in range(args.batch)]
    per_seq = -(-512 // BS)
    nblocks = args.batch * per_seq + 8
    caches = {True: [], False: []}
    for _ in range(LAYERS):
        kc, vc = torch.randn(nblocks, BS, HKV, D, generator=g), torch.randn(nblocks, BS, HKV, D, generator=g)
        free = list(range(nblocks))
        rng.shuffle(free)
        bt = torch.tensor([free[i * per_seq:(i + 1) * per_seq] for i in range(args.batch)], dtype=torch.int32)
        for huge in (True, False):
            caches[huge].append((_copy_to(kc, huge), _copy_to(vc, huge), bt))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(args.batch, H, D, generator=g)

    def gemm_pass(huge: bool, m: int, outs: dict) -> None:
        xs = {k: torch.randn(m, k, generator=torch.Generator().manual_seed(k)) for _, k in SHAPES}
        for wp, n, k in weights[huge]:
            out = outs.setdefault((n, m), torch.empty(m, n))
            rc = lib.rlserve_gemm_f32(xs[k].data_ptr(), wp.data_ptr(), None, out.data_ptr(), m, n, k, k, n, 0, 1)
            if rc != 0:
                raise RuntimeError(f"rlserve_gemm_f32 returned {rc}")

    def attention_pass(huge: bool, outs: list) -> None:
        outs.clear()
        for kc, vc, bt in caches[huge]:
            outs.append(cpu_attention.paged_decode(q, kc, vc, bt, seq_lens, 0.125))

    workloads = [(f"gemm-{m}", m) for m in args.rows] + [("attention", None)]
    for name, m in workloads:
        got = {True: {}, False: {}} if m is not None else {True: [], False: []}
        for huge in (True, False):  # warm-up, and the values of both copies
            gemm_pass(huge, m, got[huge]) if m is not None else attention_pass(huge, got[huge])
        same = (all(torch.equal(got[True][key], got[False][key]) for key in got[True]) if m is not None else
                all(torch.equal(a, b) for a, b in zip(got[True], got[False])))
        res = {"huge": [], "small": []}
        load0 = os.getloadavg()[0]
        for turn in range(args.turns):
            for huge in ((True, False) if turn % 2 == 0 else (False, True)):
                fn = ((lambda h=huge: gemm_pass(h, m, got[h])) if m is not None else
                      (lambda h=huge: attention_pass(h, got[h])))
                res["huge" if huge else "small"].append(round(_median_ms(fn, args.reps), 2))
        med = {k: sorted(v)[len(v) // 2] for k, v in res.items()}
        print(json.dumps({"workload": name, "rows": m, "batch": args.batch if m is None else None,
                          "same_values": same, "cpu_ms_huge": res["huge"], "cpu_ms_small": res["small"],
                          "median_huge": med["huge"], "median_small": med["small"],
                          "ratio_of_medians": round(med["huge"] / med["small"], 3),
                          "load_before_after": [round(load0, 2), round(os.getloadavg()[0], 2)]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
