"""Multi-server weight sync: seconds per ``send_weights()`` into 1, 2, 4 CPU servers (gloo), each
against a raw gloo broadcast of the same bytes to the same number of ranks.

For each server count N: N ``rlserve serve --load-format dummy`` processes (CPU, float32, in
place unless ``--staging``) and a trainer (this process) holding random tensors with the model's
Hugging Face names; one transfer group of N + 1 ranks (``MultiServerTrainer``: trainer rank 0,
server i at rank_offset i + 1). Rows:

  - ``multi-server sdk``  ``MultiServerTrainer.send_weights()``: a /health probe of every server,
                          /weight_info (the common next version), start / update / finish fanned out
                          to all servers, buckets of ``--bucket-mb`` (2 in flight), checksums on
  - ``single-server sdk`` (N = 1 only) the plain SDK engine (``WeightTransferTrainerFactory``) on
                          the same server: what the fan-out layer costs
  - ``raw``               ceiling: a bare gloo broadcast of the same buckets from this process to N
                          child processes (no HTTP, packing, checksum or load)

One untimed warm-up, then the median of ``--repeats``. GB = 1e9 bytes, counted once (each server
receives all of them).

Usage::

    python benchmarks/multi_server_sync.py                       # smollm2-135m fp32, N = 1, 2, 4
    python benchmarks/multi_server_sync.py --servers 1,2 --shape qwen3-0.6b --repeats 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.model_shapes import save_shape  # noqa: E402
from benchmarks.sync import bucket_sizes, model_tensors, nbytes, timed_syncs, tokenizer_dir  # noqa: E402
from rlserve.scaleout.local import LocalServers  # noqa: E402
from rlserve.transfer import (  # noqa: E402
    GlooTrainerInitInfo,
    HTTPWeightSyncClient,
    TensorListSource,
    WeightTransferTrainerFactory,
)
from rlserve.transfer.sdk.multi_server import MultiServerTrainer  # noqa: E402

RAW_RECEIVER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {root!r})
    from rlserve.transfer.backends.group import TransferGroup
    sizes = {sizes!r}
    g = TransferGroup.create("gloo", "127.0.0.1", {port}, {rank}, {world}, {timeout_s})
    bufs = [torch.empty(max(sizes), dtype=torch.uint8) for _ in range({nbuf})]
    for _ in range({repeats} + 1):
        works = {{}}
        for i, n in enumerate(sizes):
            if i - {nbuf} in works:
                g.wait(works.pop(i - {nbuf}))
            works[i] = g.broadcast(bufs[i % {nbuf}][:n], 0)
        for i in sorted(works):
            g.wait(works.pop(i))
        g.barrier()  # every receiver has every byte: the sender's clock stops here
    g.destroy(wait_s=5)
""")

TIMEOUT_S = 600.0


def raw_broadcast(sizes: list[int], receivers: int, nbuf: int, repeats: int) -> float:
    """Median seconds to broadcast buckets of ``sizes`` bytes (``nbuf`` in flight) from this process
    (rank 0) to ``receivers`` child processes over a bare gloo ``TransferGroup``, until every
    receiver has them (a barrier closes each round)."""
    from rlserve.transfer.backends.group import TransferGroup, bind_master_store

    store = bind_master_store("127.0.0.1", TIMEOUT_S)  # listening before the receivers are told
    port = store.port
    world = receivers + 1
    procs = [subprocess.Popen([sys.executable, "-c", RAW_RECEIVER.format(
        root=ROOT, sizes=sizes, port=port, rank=r, world=world, nbuf=nbuf, repeats=repeats, timeout_s=TIMEOUT_S)])
        for r in range(1, world)]
    g = None
    try:
        g = TransferGroup.create("gloo", "127.0.0.1", port, 0, world, TIMEOUT_S, store=store)
        bufs = [torch.randint(0, 255, (max(sizes),), dtype=torch.uint8) for _ in range(nbuf)]
        times = []
        for r in range(repeats + 1):  # one warm-up round
            t0 = time.perf_counter()
            works = {}
            for i, n in enumerate(sizes):
                if i - nbuf in works:
                    g.wait(works.pop(i - nbuf))
                works[i] = g.broadcast(bufs[i % nbuf][:n], 0)
            for i in sorted(works):
                g.wait(works.pop(i))
            g.barrier()
            if r:
                times.append(time.perf_counter() - t0)
    finally:
        if g is not None:
            g.destroy(wait_s=5)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
    return statistics.median(times)


def multi_sync(urls: list[str], named, bucket: int, repeats: int) -> dict:
    trainer = MultiServerTrainer.create(urls, TensorListSource(named), packed_buffer_size_bytes=bucket,
                                        timeout_s=TIMEOUT_S)
    try:
        trainer.send_weights()  # warm-up (and the servers' first, recorded load)
        total = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            trainer.send_weights()
            total.append(time.perf_counter() - t0)
        versions = set(trainer.weight_versions().values())
        assert len(versions) == 1, versions
        return {"sync_s": statistics.median(total), "all_sync_s": total}
    finally:
        trainer.shutdown()


def single_sync(url: str, named, bucket: int, repeats: int) -> dict:
    eng = WeightTransferTrainerFactory.trainer_init(
        GlooTrainerInitInfo(world_size=2, packed_buffer_size_bytes=bucket,
                            timeout_s=TIMEOUT_S),
        client=HTTPWeightSyncClient(url, timeout_s=TIMEOUT_S), source=TensorListSource(named))
    try:
        eng.send_weights()
        r = timed_syncs(eng, repeats)
        return {"sync_s": r["sync_s"], "all_sync_s": r["all_sync_s"]}
    finally:
        eng.shutdown()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="smollm2-135m", help="model shape (benchmarks/model_shapes.py)")
    p.add_argument("--servers", default="1,2,4", help="server counts, comma-separated")
    p.add_argument("--bucket-mb", type=int, default=256, help="packed bucket size in MiB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--staging", default="none", choices=["none", "host"], help="the servers' --weight-staging")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    counts = [int(x) for x in args.servers.split(",") if x.strip()]
    named = model_tensors(args.shape, torch.float32, "cpu")
    total = nbytes(named)
    bucket = args.bucket_mb << 20
    sizes = bucket_sizes(named, bucket)
    print(f"{args.shape}: {len(named)} tensors, {total / 1e9:.3f} GB float32, {len(sizes)} bucket(s) of "
          f"<= {args.bucket_mb} MiB; servers {counts}; staging {args.staging}; {os.cpu_count()} CPUs", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlserve-multi-sync-") as work:
        model_dir = save_shape(args.shape, work)
        tok = tokenizer_dir(work)
        extra = ("--tokenizer", tok, "--max-model-len", "256", "--num-kv-blocks", "64", "--max-num-seqs", "4",
                 "--enforce-eager", "--disable-access-log")
        for n in counts:
            with LocalServers(model_dir, n, staging=args.staging, extra_args=extra, startup_timeout_s=1800) as fleet:
                r = multi_sync(fleet.urls, named, bucket, args.repeats)
                rows.append({"servers": n, "mode": "multi-server sdk", **r})
                print(f"[{n} server(s)] multi-server sdk: {r['sync_s']:.3f} s/sync {r['all_sync_s']}", flush=True)
                if n == 1:
                    r = single_sync(fleet.urls[0], named, bucket, args.repeats)
                    rows.append({"servers": n, "mode": "single-server sdk", **r})
                    print(f"[1 server] single-server sdk: {r['sync_s']:.3f} s/sync {r['all_sync_s']}", flush=True)
            raw = raw_broadcast(sizes, n, 2, args.repeats)
            rows.append({"servers": n, "mode": "raw", "sync_s": raw})
            print(f"[{n} receiver(s)] raw gloo broadcast: {raw:.3f} s", flush=True)
    print("\n| servers | mode | s/sync | GB/s | vs raw |\n|---|---|---|---|---|")
    for row in rows:
        raw = next(r["sync_s"] for r in rows if r["servers"] == row["servers"] and r["mode"] == "raw")
        print(f"| {row['servers']} | {row['mode']} | {row['sync_s']:.3f} | {total / row['sync_s'] / 1e9:.2f} | "
              f"{raw / row['sync_s']:.0%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "bytes": total, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
