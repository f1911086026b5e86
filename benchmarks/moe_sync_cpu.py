"""Where a packed weight update's server time goes per tensor, on the CPU (issue 35).

The CUDA IPC packed sync of the Qwen3-30B-A3B shape cost ~0.12 ms per tensor on an H100
(BENCHMARKS.md, MoE: 11,007 per-expert names 1,546 ms for 36.1 GB vs a 23.9 ms copy floor).
A packed IPC update maps a fresh trainer buffer per bucket, so the bucket's tensors are new
views at new addresses every sync. This benchmark runs the server's per-bucket work of that
path in one process, on the CPU, with a fresh buffer per bucket and per sync (what a new
mapping looks like): the bucket's checksum + NaN scan (:func:`rlserve.transfer.server.finite_scan.scan`),
:func:`rlserve.transfer.wire.packing.unpack` and the worker's load
(:func:`rlserve.transfer.server.worker_load.load_bucket`, as the receive thread calls it),
over a MoE of many small experts so that the per-tensor Python dominates the bytes.

Prints ms per sync and us per tensor, with ``--profile`` the top cProfile entries.

    python benchmarks/moe_sync_cpu.py --layers 8 --experts 128 --syncs 3 [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from types import SimpleNamespace

import torch


def build(args):
    from transformers import Qwen3MoeConfig

    from rlserve.loader.model_loader import build_model, initialize_dummy_weights

    cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=args.layers, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         num_experts=args.experts, num_experts_per_tok=4, norm_topk_prob=True,
                         max_position_embeddings=256, architectures=["Qwen3MoeForCausalLM"])
    model = build_model(cfg, "cpu", torch.float32)
    initialize_dummy_weights(model)
    return model


def trainer_tensors(model, per_expert: bool) -> list[tuple[str, torch.Tensor]]:
    """The model's Hugging Face tensors (what a trainer sends): fused expert tensors, or split
    into per-expert names."""
    from rlserve.loader.weight_utils import split_fused_experts
    from rlserve.transfer.server.checksums import export_plan

    items, _ = export_plan(model)
    named = [(n, f().clone()) for n, f in items if ".experts." not in n or n.endswith(("gate_up_proj", "down_proj"))]
    return split_fused_experts(named) if per_expert else named


def run(args) -> dict:
    from rlserve.transfer.server.finite_scan import bucket_units, scan
    from rlserve.transfer.server.bucket_plan import BucketPairs
    from rlserve.transfer.server.worker_load import _load_replayable, _params_signature
    from rlserve.transfer.server.worker_state import WorkerTransferState
    from rlserve.transfer.wire.packing import pack, plan_buckets, unpack

    model = build(args)
    named = trainer_tensors(model, args.per_expert)
    names = [n for n, _ in named]
    plan = plan_buckets(names, [t.dtype for _, t in named], [t.shape for _, t in named], args.bucket_kb << 10)
    worker = SimpleNamespace(model=model, device=torch.device("cpu"))
    st = WorkerTransferState()
    sig = _params_signature(worker)
    # the trainer's packed buckets (packed once: only the server's side is timed)
    packed = []
    for b in plan:
        buf = torch.empty(b.nbytes, dtype=torch.uint8)
        pack(buf, b, [named[s.index][1] for s in b.slots])
        packed.append(buf)

    def one_sync(bufs) -> float:
        """Seconds in the loads (the scans are the same either way)."""
        t_load = 0.0
        for b, buf in zip(plan, bufs):  # as the ipc receive (receiver_ipc), one call per bucket
            scan(buf, bucket_units(b), True, True)
            t0 = time.perf_counter()
            pairs = BucketPairs(buf, b) if args.bucket_pairs else list(unpack(buf, b))
            _load_replayable(worker, st, pairs, sig)
            st.drop_unused_plans()
            t_load += time.perf_counter() - t0
        return t_load

    times, loads, bufs = [], [], []
    prof = cProfile.Profile() if args.profile else None
    for i in range(args.syncs):
        for m in model.parameters():  # the server's weights change between syncs
            m.data.zero_()
        # a fresh mapping: new addresses every bucket, every sync (the last sync's buffers are
        # still held while these are allocated, so the allocator cannot hand their addresses back)
        bufs = [src.clone() for src in packed]
        t0 = time.perf_counter()
        if prof is not None and i == args.syncs - 1:
            prof.enable()
        loads.append(one_sync(bufs))
        if prof is not None and i == args.syncs - 1:
            prof.disable()
        times.append(time.perf_counter() - t0)
    exported = dict(trainer_tensors(model, args.per_expert))
    ok = all(torch.equal(exported[n], t) for n, t in named)
    res = {"mode": "bucket-keyed" if args.bucket_pairs else "address-keyed", "tensors": len(named),
           "buckets": len(plan), "sync_ms": [round(t * 1e3, 2) for t in times],
           "load_ms": [round(t * 1e3, 2) for t in loads],
           "load_us_per_tensor_best_later": round(min(loads[1:] or loads) * 1e6 / len(named), 1),
           "model_equals_trainer": ok}
    print(json.dumps(res))
    if prof is not None:
        pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(25)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--bucket-kb", type=int, default=256, help="packed_buffer_size_bytes in KiB")
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--fused-names", dest="per_expert", action="store_false",
                    help="send transformers 5's fused expert tensors (default: per-expert names)")
    ap.add_argument("--address-keyed", dest="bucket_pairs", action="store_false",
                    help="the old receive: unpacked views, plans keyed on the sources' addresses")
    ap.add_argument("--profile", action="store_true", help="cProfile the last sync")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    res = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if res["model_equals_trainer"] else 1


if __name__ == "__main__":
    sys.exit(main())
