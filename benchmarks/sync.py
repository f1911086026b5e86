"""Weight-sync benchmark: seconds per sync and GB/s, against the transport's ceiling.

One run measures, for a model shape served with ``--load-format dummy`` by a real ``rlserve
serve`` process and a trainer (this process) holding random tensors with the model's Hugging Face
names and shapes:

CPU, gloo (always):
  - ``packed``     SDK ``send_weights()``: buckets of ``--bucket-mb``, 2 in flight, checksums on
  - ``unpacked``   SDK, one broadcast per tensor
  - ``trl-http``   TRL legacy style: ``POST /update_named_param/`` + one broadcast per tensor
  - ``raw``        ceiling: a bare gloo broadcast of the same bytes in the same buckets between
                   two processes (no HTTP, no packing, no checksum, no load)
GPU, one device (when CUDA is present and ``--gpu`` is not ``off``):
  - ``ipc-packed``   SDK over CUDA IPC, packed buckets (a pack copy + the server's load copy)
  - ``ipc-unpacked`` SDK over CUDA IPC, per-tensor handles (the server's load copy only)
  - ``d2d-copy``     ceiling: one device-to-device ``copy_`` of the same number of bytes

GB/s = model bytes / seconds (bytes counted once, 1 GB = 1e9 bytes). "sync" is the whole
``send_weights()``: start, checksum pass, transfer + load, finish (prefix-cache reset, version).
"transfer" is the ``update_weights`` part only. Targets (issue 4): packed gloo >= 80% of raw;
ipc >= 50% of the copy bandwidth for a >= 1B-parameter model.

Usage::

    python benchmarks/sync.py                         # CPU: smollm2-135m fp32; GPU: qwen3-1.7b bf16
    python benchmarks/sync.py --cpu-shape qwen3-0.6b --gpu-shape qwen3-8b --repeats 5 --json out.json
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

from benchmarks.model_shapes import save_shape, shape_config  # noqa: E402
from rlserve.server.testing import ServerProcess  # noqa: E402
from rlserve.transfer import (  # noqa: E402
    GlooTrainerInitInfo,
    HTTPWeightSyncClient,
    IPCTrainerInitInfo,
    TensorListSource,
    WeightTransferTrainerFactory,
)
from rlserve.transfer.trl import TRLWeightSyncClient  # noqa: E402


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_tensors(shape: str, dtype: torch.dtype, device: str) -> list[tuple[str, torch.Tensor]]:
    """Random tensors with the HF names / shapes of ``shape`` (tied head skipped)."""
    from transformers import AutoModelForCausalLM

    from rlserve.transfer import ModuleSource

    cfg = shape_config(shape)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    out = []
    g = torch.Generator(device=device).manual_seed(0)
    for name, _dt, shp in ModuleSource(meta).metadata():
        t = torch.empty(shp, dtype=dtype, device=device)
        t.normal_(0.0, 0.02, generator=g)
        out.append((name, t))
    return out


def nbytes(named) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def tokenizer_dir(root: str) -> str:
    from tests.tiny_models import build_tokenizer

    path = os.path.join(root, "tokenizer")
    build_tokenizer().save_pretrained(path)
    return path


def serve(model_dir: str, tok: str, backend: str, device: str, dtype: str) -> ServerProcess:
    return ServerProcess(model_dir, "--tokenizer", tok, "--load-format", "dummy", "--device", device,
                         "--dtype", dtype, "--max-model-len", "256", "--num-kv-blocks", "64",
                         "--max-num-seqs", "4", "--enforce-eager",
                         "--weight-transfer-config", json.dumps({"backend": backend}), startup_timeout_s=900)


def timed_syncs(engine, repeats: int) -> dict:
    total, transfer = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fin = engine.send_weights()
        total.append(time.perf_counter() - t0)
        transfer.append(engine.last_stats.get("seconds") or fin.get("transfer_seconds") or total[-1])
    return {"sync_s": statistics.median(total), "transfer_s": statistics.median(transfer), "all_sync_s": total}


RAW_RECEIVER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {root!r})
    from rlserve.transfer.group import TransferGroup
    sizes = {sizes!r}
    g = TransferGroup.create("gloo", "127.0.0.1", {port}, 1, 2, 600.0)
    bufs = [torch.empty(max(sizes), dtype=torch.uint8) for _ in range({nbuf})]
    for _ in range({repeats} + 1):
        works = {{}}
        for i, n in enumerate(sizes):
            if i - {nbuf} in works:
                g.wait(works.pop(i - {nbuf}))
            works[i] = g.broadcast(bufs[i % {nbuf}][:n], 0)
        for i in sorted(works):
            g.wait(works.pop(i))
    g.destroy(wait_s=5)
""")


def raw_broadcast(sizes: list[int], nbuf: int, repeats: int) -> float:
    """Median seconds to broadcast buckets of ``sizes`` bytes to another process (gloo)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", RAW_RECEIVER.format(root=ROOT, sizes=sizes, port=port, nbuf=nbuf,
                                                                       repeats=repeats)])
    from rlserve.transfer.group import TransferGroup

    g = TransferGroup.create("gloo", "127.0.0.1", port, 0, 2, 600.0)
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
        if r:
            times.append(time.perf_counter() - t0)
    g.destroy(wait_s=5)
    proc.wait(60)
    return statistics.median(times)


def bench_cpu(args, work: str, tok: str) -> list[dict]:
    from rlserve.transfer.packing import plan_buckets

    named = model_tensors(args.cpu_shape, torch.float32, "cpu")
    total = nbytes(named)
    bucket = args.bucket_mb << 20
    print(f"[cpu] {args.cpu_shape}: {len(named)} tensors, {total / 1e9:.3f} GB float32; buckets of {args.bucket_mb} MiB")
    model_dir = save_shape(args.cpu_shape, work)
    rows = []
    with serve(model_dir, tok, "gloo", "cpu", "float32") as srv:
        for mode in ("packed", "unpacked"):
            eng = WeightTransferTrainerFactory.trainer_init(
                init_info=GlooTrainerInitInfo(master_port=free_port(), world_size=2, packed=mode == "packed",
                                              packed_buffer_size_bytes=bucket, timeout_s=600),
                client=HTTPWeightSyncClient(srv.url, timeout_s=600), source=TensorListSource(named))
            eng.send_weights()  # warm-up
            r = timed_syncs(eng, args.repeats)
            eng.shutdown()
            rows.append({"backend": "gloo", "mode": mode, "bytes": total, **r})
            print(f"[cpu] {mode}: {r['sync_s']:.3f} s/sync")
        # TRL legacy: one HTTP call + one broadcast per tensor
        trl = TRLWeightSyncClient(srv.url, group_port=free_port(), timeout_s=600)
        trl.init_communicator()
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for name, t in named:
                trl.update_named_param(name, t)
            trl.reset_prefix_cache()  # the server lands every queued tensor before it answers
            times.append(time.perf_counter() - t0)
        trl.close_communicator()
        rows.append({"backend": "gloo", "mode": "trl-http", "bytes": total, "sync_s": statistics.median(times),
                     "transfer_s": statistics.median(times), "all_sync_s": times})
        print(f"[cpu] trl-http: {rows[-1]['sync_s']:.3f} s/sync")
    plan = plan_buckets([n for n, _ in named], [t.dtype for _, t in named], [list(t.shape) for _, t in named], bucket)
    raw = raw_broadcast([b.nbytes for b in plan], 2, args.repeats)
    rows.append({"backend": "gloo", "mode": "raw", "bytes": total, "sync_s": raw, "transfer_s": raw, "all_sync_s": [raw]})
    print(f"[cpu] raw broadcast: {raw:.3f} s")
    return rows


def bench_gpu(args, work: str, tok: str) -> list[dict]:
    dev = "cuda:0"
    named = model_tensors(args.gpu_shape, torch.bfloat16, dev)
    total = nbytes(named)
    n_params = sum(t.numel() for _, t in named)
    print(f"[gpu] {args.gpu_shape}: {n_params / 1e9:.2f} B parameters, {total / 1e9:.3f} GB bfloat16")
    model_dir = save_shape(args.gpu_shape, work)
    rows = []
    with serve(model_dir, tok, "ipc", "cuda:0", "bfloat16") as srv:
        for mode, checksums in (("ipc-packed", True), ("ipc-unpacked", True), ("ipc-unpacked", False)):
            eng = WeightTransferTrainerFactory.trainer_init(
                init_info=IPCTrainerInitInfo(packed=mode == "ipc-packed", packed_buffer_size_bytes=args.bucket_mb << 20,
                                             checksums=checksums, timeout_s=600, device=dev),
                client=HTTPWeightSyncClient(srv.url, timeout_s=600), source=TensorListSource(named))
            eng.send_weights()
            r = timed_syncs(eng, args.repeats)
            eng.shutdown()
            label = mode + ("" if checksums else " (no checksums)")
            rows.append({"backend": "ipc", "mode": label, "bytes": total, **r})
            print(f"[gpu] {label}: {r['sync_s']:.4f} s/sync")
    src = torch.empty(total, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    times = []
    for i in range(args.repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    c = statistics.median(times)
    rows.append({"backend": "cuda", "mode": "d2d-copy", "bytes": total, "sync_s": c, "transfer_s": c, "all_sync_s": times})
    print(f"[gpu] d2d copy: {c:.4f} s")
    return rows


def table(rows: list[dict]) -> str:
    ceil = {r["backend"]: r for r in rows if r["mode"] in ("raw", "d2d-copy")}
    lines = ["| backend | mode | GB | s/sync | GB/s (sync) | GB/s (transfer) | vs ceiling |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        gbps = r["bytes"] / r["sync_s"] / 1e9
        tgbps = r["bytes"] / r["transfer_s"] / 1e9
        ref = ceil.get("gloo" if r["backend"] == "gloo" else "cuda")
        vs = f"{ref['sync_s'] / r['sync_s']:.0%}" if ref is not None and ref is not r else "-"
        lines.append(f"| {r['backend']} | {r['mode']} | {r['bytes'] / 1e9:.3f} | {r['sync_s']:.4f} | {gbps:.2f} | "
                     f"{tgbps:.2f} | {vs} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-shape", default="smollm2-135m")
    p.add_argument("--gpu-shape", default="qwen3-1.7b")
    p.add_argument("--bucket-mb", type=int, default=256, help="packed_buffer_size_bytes in MiB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cpu", choices=["on", "off"], default="on")
    p.add_argument("--gpu", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as work:
        tok = tokenizer_dir(work)
        if args.cpu == "on":
            rows += bench_cpu(args, work, tok)
        if args.gpu == "on" or (args.gpu == "auto" and torch.cuda.is_available()):
            rows += bench_gpu(args, work, tok)
    print()
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows,
                       "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}, f, indent=2)


if __name__ == "__main__":
    main()
