"""Bandwidth of the one-launch copy + ``s64sum`` + non-finite pass (:class:`rlserve.transfer.multi_tensor.
MultiTensorSum`) against the device-copy floor, over MoE-shaped tensors (issue 35: the in-place CUDA IPC
load of Qwen3-30B-A3B is this pass over 61 GB).

Sources: ``--layers`` layers of Qwen3-30B-A3B's fused experts (``gate_up_proj [128, 1536, 2048]``,
``down_proj [128, 2048, 768]``, bf16: 1.21 GB a layer), or with ``--per-expert`` the same bytes as
their 3 x 128 per-expert views a layer (the trainer's names); destinations: a fresh tensor of each.
Rows (CUDA events, median of ``--repeats`` after one warm-up; GB counted once, 1 GB = 1e9 bytes):

- ``copy_ (floor)``: one flat ``copy_`` of all the bytes (uint8 views of one buffer pair);
- ``mts copy+sum+check CHUNK/BLOCK/WARPS``: the pass as the server runs it, for the chunk sizes
  (int64 words a program), ``BLOCK_WORDS`` and ``NUM_WARPS`` given (the module's defaults first);
- ``mts copy+sum`` (no non-finite test) with the defaults.

DRY_RUN (no CUDA): ``TRITON_INTERPRET=1 python benchmarks/multi_tensor_bw.py --cpu`` runs every row
once on a tiny shape through Triton's interpreter (checks the script, times nothing useful).

Usage::

    python benchmarks/multi_tensor_bw.py --layers 8 --repeats 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

from benchmarks.decode_step import cuda_time  # noqa: E402

from rlserve.transfer import multi_tensor as mt  # noqa: E402
from rlserve.transfer.wire.packing import tensor_checksum  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--per-expert", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--variants", default="1048576/2048/8,131072/2048/8,1048576/4096/8,1048576/2048/16",
                   help="CHUNK_WORDS/BLOCK_WORDS/NUM_WARPS,... (the first: the module's defaults)")
    p.add_argument("--cpu", action="store_true", help="tiny shape on the CPU (TRITON_INTERPRET=1)")
    p.add_argument("--json")
    args = p.parse_args()
    dev = torch.device("cpu" if args.cpu else "cuda")
    E, I, H = (4, 8, 16) if args.cpu else (128, 768, 2048)
    shapes = [(E, 2 * I, H), (E, H, I)] * args.layers
    numel = [a * b * c for a, b, c in shapes]
    total = sum(numel)
    flat_src = torch.randn(total, dtype=torch.bfloat16, device=dev)  # one buffer pair: the floor copies it whole
    flat_dst = torch.empty_like(flat_src)
    srcs, dsts, off = [], [], 0
    for shp, n in zip(shapes, numel):
        srcs.append(flat_src[off:off + n].view(shp))
        dsts.append(flat_dst[off:off + n].view(shp))
        off += n
    if args.per_expert:
        srcs = [v for t in srcs for e in range(E) for v in (t[e, :I], t[e, I:]) if t.shape[1] == 2 * I] + \
            [t[e] for t in srcs if t.shape[1] == H for e in range(E)]
        dsts = [v for t in dsts for e in range(E) for v in (t[e, :I], t[e, I:]) if t.shape[1] == 2 * I] + \
            [t[e] for t in dsts if t.shape[1] == H for e in range(E)]
    nbytes = total * 2
    card = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (TRITON_INTERPRET)"
    rows = []

    def row(label, fn, **kw):
        s = cuda_time(fn, warmup=1, iters=args.repeats)  # median (CUDA events; wall clock on the CPU)
        r = {"label": label, "bytes": nbytes, "tensors": len(srcs), "s": s, "gbps": nbytes / s / 1e9,
             "card": card, **kw}
        rows.append(r)
        floor = rows[0]["s"]
        print(f"{label:44s} {len(srcs):6d} tensors {nbytes / 1e9:7.3f} GB {s * 1e3:9.3f} ms {r['gbps']:8.1f} GB/s "
              f"{s / floor:5.2f}x floor", flush=True)

    row("copy_ (floor)", lambda: flat_dst.copy_(flat_src))
    allow = dev.type == "cpu"
    expect = [tensor_checksum(t) for t in srcs[:4]]
    defaults = (mt.BLOCK_WORDS, mt.NUM_WARPS)
    for k, v in enumerate(args.variants.split(",")):
        chunk, block, warps = (int(x) for x in v.split("/"))
        mt.BLOCK_WORDS, mt.NUM_WARPS = block, warps
        op = None
        try:
            op = mt.MultiTensorSum.build(srcs, dsts, chunk_words=chunk, _allow_cpu=allow, check_finite=True)
            sums = op.run()
            ok = sums[:4].tolist() == expect and not op.bad.any().item()
            row(f"mts copy+sum+check {chunk}/{block}/{warps}", op.run, exact=ok)
            if k == 0:
                mt.BLOCK_WORDS, mt.NUM_WARPS = defaults
                op = mt.MultiTensorSum.build(srcs, dsts, chunk_words=chunk, _allow_cpu=allow)
                row("mts copy+sum (defaults)", op.run)
        except Exception as e:  # noqa: BLE001 - a variant that does not compile: a row that says so
            print(f"mts {v}: failed: {type(e).__name__}: {e}", flush=True)
            rows.append({"label": f"mts {v}", "error": f"{type(e).__name__}: {e}"})
        finally:
            mt.BLOCK_WORDS, mt.NUM_WARPS = defaults
            op = None
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
