"""Weight-sync benchmark: seconds per sync and GB/s, against the transport's ceiling.

One run measures, for a model shape served with ``--load-format dummy`` by a real ``rlserve
serve`` process and a trainer (this process) holding random tensors with the model's Hugging Face
names and shapes:

CPU, gloo (unless ``--cpu off``):
  - ``packed``     SDK ``send_weights()``: buckets of ``--bucket-mb``, 2 in flight, checksums on
                   (and once with checksums off, to show what they cost)
                   (from the second sync on, received straight into the server's parameters:
                   ``rlserve.transfer.server.direct``; once more with ``direct_receive`` off)
  - ``unpacked``   SDK, one broadcast per tensor
  - ``trl-http``   TRL legacy style: ``POST /update_named_param/`` + one broadcast per tensor
  - ``raw``        ceiling: a bare gloo broadcast of the same bytes in the same buckets between
                   two processes (no HTTP, no packing, no checksum, no load)
GPU, one device (when CUDA is present and ``--gpu`` is not ``off``):
  - ``ipc-packed``   SDK over CUDA IPC, packed buckets (a pack copy + the server's load copy)
  - ``ipc-unpacked`` SDK over CUDA IPC, per-tensor handles (the server's load copy only)
  - MoE shapes with ``--gpu-expert-names both``: ``ipc-packed`` and ``ipc-unpacked`` once more with
    the experts under their per-expert names (``experts.{e}.gate_proj.weight`` ...: E x 3 tensors
    per layer, views of the fused tensors)
  - ``d2d-copy``     ceiling: one device-to-device ``copy_`` of the same number of bytes
GPU, two devices, NCCL (``--nccl auto``: when there are >= 2 GPUs; once per ``--nccl-shape``):
server on ``cuda:0`` (bfloat16), trainer (this process) on ``cuda:1``, NVLink multicast off in
every process (``rlserve.demo.NCCL_SAFE_ENV``):
  - ``nccl-packed``   SDK ``send_weights()`` over NCCL: buckets of ``--bucket-mb``, 2 in flight
  - ``nccl-unpacked`` SDK over NCCL, one broadcast per tensor
  - ``trl-http``      TRL legacy style over NCCL (``TRLWeightSyncClient(backend="nccl")``):
                      ``POST /update_named_param/`` + one broadcast per tensor
  - ``raw-nccl``      ceiling: a bare NCCL broadcast of the same bytes in the same buckets from
                      this process (``cuda:1``, rank 0) to a child process (``cuda:0``)

GB/s = model bytes / seconds (bytes counted once, 1 GB = 1e9 bytes). "sync" is the whole
``send_weights()``: start, checksum pass, transfer + load, finish (prefix-cache reset, version);
for ``trl-http`` every ``update_named_param`` + the final ``/reset_prefix_cache/``. "transfer" is
the ``update_weights`` part only. "vs ceiling" = a row's GB/s / its section's ceiling GB/s (same
shape). Every mode gets one untimed warm-up sync, then the median of ``--repeats``. Targets
(issue 4): packed gloo >= 80% of raw; ipc >= 50% of the copy bandwidth for a >= 1B-parameter
model.

Usage::

    python benchmarks/sync.py       # CPU: smollm2-135m fp32; 1 GPU: + ipc qwen3-1.7b; 2 GPUs: + nccl qwen3-1.7b
    python benchmarks/sync.py --cpu-shape qwen3-0.6b --gpu-shape qwen3-8b --repeats 5 --json out.json
    python benchmarks/sync.py --cpu off --gpu off --nccl on --nccl-shape qwen3-1.7b,qwen3-8b   # 2 GPUs
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.model_shapes import save_shape, shape_config  # noqa: E402
from rlserve.demo import NCCL_SAFE_ENV  # noqa: E402
from rlserve.loader.weight_utils import parse_expert_name, split_fused_experts  # noqa: E402
from rlserve.server.testing import ServerProcess  # noqa: E402
from rlserve.transfer import (  # noqa: E402
    GlooTrainerInitInfo,
    HTTPWeightSyncClient,
    IPCTrainerInitInfo,
    NCCLTrainerInitInfo,
    TensorListSource,
    WeightTransferTrainerFactory,
)
from rlserve.transfer.sdk.trl import TRLWeightSyncClient  # noqa: E402


_LAYER = re.compile(r"\.layers\.\d+\.")


def model_tensors(shape: str, dtype: torch.dtype, device: str,
                  layer_pool: bool = False) -> list[tuple[str, torch.Tensor]]:
    """Random tensors with the HF names / shapes of ``shape`` (tied head skipped); on ``"meta"``
    shapes only.

    ``layer_pool``: every decoder layer's names map to ONE set of layer tensors (the first layer's,
    the same tensor objects), so the trainer holds one layer + embeddings instead of the whole model
    -- the way an FSDP trainer gathers one layer at a time into reused buffers. The server still
    receives (and copies) every layer's bytes: the sync moves the whole model. This is what lets the
    61 GB Qwen3-30B-A3B shape sync on an 80 GB card (server 61 GB + trainer ~2.5 GB)."""
    from transformers import AutoModelForCausalLM

    from rlserve.transfer import ModuleSource

    cfg = shape_config(shape)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    out = []
    pool: dict[str, torch.Tensor] = {}
    g = None if device == "meta" else torch.Generator(device=device).manual_seed(0)
    for name, _dt, shp in ModuleSource(meta).metadata():
        key = _LAYER.sub(".layers.*.", name) if layer_pool else name
        t = pool.get(key)
        if t is None:
            t = torch.empty(shp, dtype=dtype, device=device)
            if g is not None:  # "meta": shapes and byte counts only
                t.normal_(0.0, 0.02, generator=g)
            if layer_pool:
                pool[key] = t
        out.append((name, t))
    return out


def nbytes(named) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def nbytes_unique(named) -> int:
    """Bytes of the distinct tensors (``layer_pool`` reuses one layer's tensors for every layer)."""
    return sum(t.numel() * t.element_size() for t in {id(t): t for _, t in named}.values())


def tokenizer_dir(root: str) -> str:
    from tests.tiny_models import build_tokenizer

    path = os.path.join(root, "tokenizer")
    build_tokenizer().save_pretrained(path)
    return path


def serve(model_dir: str, tok: str, backend: str, device: str, dtype: str, **transfer_config) -> ServerProcess:
    return ServerProcess(model_dir, "--tokenizer", tok, "--load-format", "dummy", "--device", device,
                         "--dtype", dtype, "--max-model-len", "256", "--num-kv-blocks", "64",
                         "--max-num-seqs", "4", "--enforce-eager",
                         "--weight-transfer-config", json.dumps({"backend": backend, **transfer_config}),
                         startup_timeout_s=900)


def timed_syncs(engine, repeats: int) -> dict:
    total, transfer = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fin = engine.send_weights()
        total.append(time.perf_counter() - t0)
        transfer.append(engine.last_stats.get("seconds") or fin.get("transfer_seconds") or total[-1])
    return {"sync_s": statistics.median(total), "transfer_s": statistics.median(transfer), "all_sync_s": total}


def sdk_sync(url: str, named, init_info, repeats: int) -> dict:
    """A trainer engine of ``init_info``: one warm-up sync, then ``repeats`` timed ones; shut down."""
    client = HTTPWeightSyncClient(url, timeout_s=init_info.timeout_s)
    eng = WeightTransferTrainerFactory.trainer_init(init_info=init_info, client=client, source=TensorListSource(named))
    try:
        eng.send_weights()  # warm-up
        r = timed_syncs(eng, repeats)
        r["last_stats"] = eng.last_stats  # phases of the last sync (trainer and server side)
        print("[phases] " + json.dumps(eng.last_stats, default=str))
    except BaseException:
        with contextlib.suppress(Exception):  # keep the first error; the server goes next anyway
            eng._teardown()
        raise
    eng.shutdown()
    return r


def trl_sync(url: str, named, repeats: int, backend: str, device: str, timeout_s: float = 600) -> dict:
    """TRL legacy: per tensor one ``POST /update_named_param/`` + one broadcast, then
    ``/reset_prefix_cache/`` (the server lands every queued tensor before it answers).
    One warm-up pass, then ``repeats`` timed ones."""
    trl = TRLWeightSyncClient(url, group_port=0, backend=backend, device=device, timeout_s=timeout_s)
    trl.init_communicator()
    times = []
    try:
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            for name, t in named:
                trl.update_named_param(name, t)
            trl.reset_prefix_cache()
            if r:
                times.append(time.perf_counter() - t0)
    except BaseException:
        with contextlib.suppress(Exception):  # keep the first error
            trl.close_communicator()
        raise
    trl.close_communicator()
    s = statistics.median(times)
    return {"sync_s": s, "transfer_s": s, "all_sync_s": times}


RAW_RECEIVER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {root!r})
    from rlserve.transfer.backends.group import TransferGroup
    sizes = {sizes!r}
    dev = torch.device({device!r})
    g = TransferGroup.create({backend!r}, "127.0.0.1", {port}, 1, 2, {timeout_s}, device=dev)
    bufs = [torch.empty(max(sizes), dtype=torch.uint8, device=dev) for _ in range({nbuf})]
    for _ in range({repeats} + 1):
        works = {{}}
        for i, n in enumerate(sizes):
            if i - {nbuf} in works:
                g.wait(works.pop(i - {nbuf}))
            works[i] = g.broadcast(bufs[i % {nbuf}][:n], 0)
        for i in sorted(works):
            g.wait(works.pop(i))
    g.barrier()  # the sender tears down only once every byte has landed here
    g.destroy(wait_s=5)
""")

RAW_TIMEOUT_S = 120.0  # rendezvous + each broadcast; a receiver that died is noticed at once (see check)


def raw_broadcast(sizes: list[int], nbuf: int, repeats: int, backend: str = "gloo", device: str = "cpu",
                  peer_device: str = "cpu") -> float:
    """Median seconds to broadcast buckets of ``sizes`` bytes, ``nbuf`` in flight, from this process
    (rank 0, tensors on ``device``) to a child process (rank 1, on ``peer_device``) over a bare
    ``TransferGroup`` of ``backend`` (gloo: CPU; nccl: one GPU each). No HTTP, packing, checksum or
    load: the transport's ceiling."""
    from rlserve.transfer.backends.group import TransferGroup, bind_master_store

    store = bind_master_store("127.0.0.1", RAW_TIMEOUT_S)  # listening before the receiver is told
    code = RAW_RECEIVER.format(root=ROOT, sizes=sizes, port=store.port, nbuf=nbuf, repeats=repeats, backend=backend,
                               device=peer_device, timeout_s=RAW_TIMEOUT_S)
    proc = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ))

    def receiver_alive() -> None:
        if proc.poll() is not None:
            raise RuntimeError(f"the raw {backend} receiver exited with {proc.returncode} mid-broadcast")

    g = None
    try:
        g = TransferGroup.create(backend, "127.0.0.1", store.port, 0, 2, RAW_TIMEOUT_S, torch.device(device),
                                 store=store)
        bufs = [torch.randint(0, 255, (max(sizes),), dtype=torch.uint8, device=device) for _ in range(nbuf)]
        if g.device.type == "cuda":
            torch.cuda.synchronize(g.device)
        times = []
        for r in range(repeats + 1):  # one warm-up round
            t0 = time.perf_counter()
            works = {}
            for i, n in enumerate(sizes):
                if i - nbuf in works:
                    g.wait(works.pop(i - nbuf), check=receiver_alive)
                works[i] = g.broadcast(bufs[i % nbuf][:n], 0)
            for i in sorted(works):  # nccl: completed = the GPU finished the broadcast
                g.wait(works.pop(i), check=receiver_alive)
            if r:
                times.append(time.perf_counter() - t0)
        g.barrier()
    finally:
        if g is not None:
            g.destroy(wait_s=5)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    if proc.returncode:
        print(f"[raw-{backend}] note: the receiver exited with {proc.returncode} after the measurement")
    return statistics.median(times)


def add(rows: list[dict], section: str, shape: str, backend: str, mode: str, total: int, r: dict) -> dict:
    row = {"section": section, "shape": shape, "backend": backend, "mode": mode, "bytes": total, **r}
    rows.append(row)
    return row


def add_error(rows: list[dict], section: str, shape: str, backend: str, mode: str, e: BaseException) -> None:
    """A failed measurement: the traceback is printed, the row says why (one table cell)."""
    traceback.print_exc()
    msg = f"{type(e).__name__}: {e}".replace("|", "/").replace("\n", " ")[:200]
    rows.append({"section": section, "shape": shape, "backend": backend, "mode": mode, "error": msg})


def attempt(rows: list[dict], section: str, shape: str, backend: str, mode: str, total: int, fn, tag: str) -> None:
    """Run one measurement ``fn() -> {"sync_s", "transfer_s", "all_sync_s"}``; a failure becomes a
    failed row and the next measurement still runs."""
    try:
        r = fn()
    except Exception as e:  # noqa: BLE001 - reported in the table; the other rows still count
        add_error(rows, section, shape, backend, mode, e)
        return
    add(rows, section, shape, backend, mode, total, r)
    print(f"{tag} {mode}: {r['sync_s']:.4f} s")


def bucket_sizes(named, bucket: int) -> list[int]:
    """Bytes of each packed bucket of ``named`` (the SDK's plan: same rule as packed mode)."""
    from rlserve.transfer.wire.packing import plan_buckets

    plan = plan_buckets([n for n, _ in named], [t.dtype for _, t in named], [list(t.shape) for _, t in named], bucket)
    return [b.nbytes for b in plan]


def bench_cpu(args, work: str, tok: str, rows: list[dict]) -> None:
    shape = args.cpu_shape
    named = model_tensors(shape, torch.float32, "cpu")
    total = nbytes(named)
    bucket = args.bucket_mb << 20
    print(f"[cpu] {shape}: {len(named)} tensors, {total / 1e9:.3f} GB float32; buckets of {args.bucket_mb} MiB")
    model_dir = save_shape(shape, work)
    with serve(model_dir, tok, "gloo", "cpu", "float32") as srv:
        for mode, checksums in (("packed", True), ("packed", False), ("unpacked", True)):
            r = sdk_sync(srv.url, named, GlooTrainerInitInfo(world_size=2,
                                                             packed=mode == "packed", checksums=checksums,
                                                             packed_buffer_size_bytes=bucket, timeout_s=600),
                         args.repeats)
            label = mode + ("" if checksums else " (no checksums)")
            add(rows, "cpu", shape, "gloo", label, total, r)
            print(f"[cpu] {label}: {r['sync_s']:.3f} s/sync")
        r = trl_sync(srv.url, named, args.repeats, "gloo", "cpu")
        add(rows, "cpu", shape, "gloo", "trl-http", total, r)
        print(f"[cpu] trl-http: {r['sync_s']:.3f} s/sync")
    # the same packed sync when the server keeps its receive buffers and load copy (what every
    # packed update did before rlserve.transfer.server.direct)
    with serve(model_dir, tok, "gloo", "cpu", "float32", direct_receive=False) as srv:
        r = sdk_sync(srv.url, named, GlooTrainerInitInfo(world_size=2,
                                                         packed_buffer_size_bytes=bucket, timeout_s=600), args.repeats)
        add(rows, "cpu", shape, "gloo", "packed (direct_receive off)", total, r)
        print(f"[cpu] packed (direct_receive off): {r['sync_s']:.3f} s/sync")
    raw = raw_broadcast(bucket_sizes(named, bucket), 2, args.repeats)
    add(rows, "cpu", shape, "gloo", "raw", total, {"sync_s": raw, "transfer_s": raw, "all_sync_s": [raw]})
    print(f"[cpu] raw broadcast: {raw:.3f} s")


def d2d_copy(total: int, repeats: int, dev: str) -> dict:
    """The ceiling: median seconds of device-to-device ``copy_`` of ``total`` bytes (one warm-up
    first); both buffers are freed before it returns. When two copies of ``total`` do not fit in
    40% of the free memory each (the 61 GB MoE shape on an 80 GB card), the same bytes are copied
    as back-to-back copies of one smaller pair of buffers (>= 1 GB each: a copy that size already
    runs at the card's copy bandwidth)."""
    free = torch.cuda.mem_get_info(torch.device(dev))[0]
    chunk = min(total, max(1 << 30, int(free * 0.4)))
    src = torch.empty(chunk, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    sizes = [chunk] * (total // chunk) + ([total % chunk] if total % chunk else [])
    times = []
    for i in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for n in sizes:
            dst[:n].copy_(src[:n])
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    c = statistics.median(times)
    return {"sync_s": c, "transfer_s": c, "all_sync_s": times}


def gpu_modes(args, named) -> list[tuple[str, bool, list, int]]:
    """The CUDA IPC rows ``(mode, checksums, tensors, bucket MiB)`` of :func:`bench_gpu` (see the
    module docstring and ``--gpu-quick``)."""
    modes = [("ipc-packed", True, named)]
    if args.gpu_expert_names == "both" and any(parse_expert_name(n) for n, _ in named):
        # a trainer's per-expert names (views of the same bytes): the server scatters them
        # into its fused [E, ...] expert tensors
        modes.append(("ipc-packed", True, split_fused_experts(named)))
        modes.append(("ipc-unpacked", True, modes[-1][2]))
    modes += [("ipc-unpacked", True, named), ("ipc-unpacked", False, named)]
    unpacked = [m for m in modes if m[0] == "ipc-unpacked" and m[1]][::-1]  # fused names first
    if args.gpu_unpacked_only:
        modes = unpacked + ([("ipc-unpacked", False, named)] if args.gpu_unchecked else [])
    elif args.gpu_quick:  # unpacked (IPC's default) first (a time-bounded device window), no unchecked row
        modes = unpacked + [m for m in modes if m[0] == "ipc-packed"]
    modes = [(m, c, t, args.bucket_mb) for m, c, t in modes]
    if args.gpu_packed_bucket_mb and not args.gpu_unpacked_only:  # packed, fused names, other buckets
        modes.append(("ipc-packed", True, named, args.gpu_packed_bucket_mb))
    return modes


def bench_gpu(args, work: str, tok: str, rows: list[dict]) -> None:
    """The copy ceiling first (its two buffers are gone before the trainer's tensors exist), then
    the IPC syncs into a served copy of the shape: the GPU holds the trainer's and the server's."""
    dev = "cuda:0"
    shape = args.gpu_shape
    named = model_tensors(shape, torch.bfloat16, "meta")
    total = nbytes(named)
    n_params = sum(t.numel() for _, t in named)
    print(f"[gpu] {shape}: {n_params / 1e9:.2f} B parameters, {total / 1e9:.3f} GB bfloat16")
    attempt(rows, "gpu", shape, "cuda", "d2d-copy", total, lambda: d2d_copy(total, args.repeats, dev), "[gpu]")
    named = model_tensors(shape, torch.bfloat16, dev, layer_pool=args.gpu_trainer == "layer-pool")
    print(f"[gpu] trainer {args.gpu_trainer}: {nbytes_unique(named) / 1e9:.3f} GB of its own tensors")
    model_dir = save_shape(shape, work)
    with serve(model_dir, tok, "ipc", "cuda:0", "bfloat16") as srv:
        modes = gpu_modes(args, named)
        for mode, checksums, tensors, mb in modes:
            info = IPCTrainerInitInfo(packed=mode == "ipc-packed", packed_buffer_size_bytes=mb << 20,
                                      checksums=checksums, timeout_s=600, device=dev)
            label = mode + ("" if checksums else " (no checksums)")
            label += f" ({len(tensors)} per-expert tensors)" if tensors is not named else ""
            label += f" ({mb} MiB buckets)" if mode == "ipc-packed" and mb != args.bucket_mb else ""
            attempt(rows, "gpu", shape, "ipc", label, total,
                    lambda info=info, tensors=tensors: sdk_sync(srv.url, tensors, info, args.repeats), "[gpu]")
    del named, modes  # the split views hold the trainer's bytes too
    torch.cuda.empty_cache()


NCCL_SERVER_DEVICE = "cuda:0"
NCCL_TRAINER_DEVICE = "cuda:1"
NCCL_TIMEOUT_S = 120.0  # every rendezvous, wait and HTTP call; a sync of 16 GB takes seconds


def bench_nccl(args, work: str, tok: str, shape: str, rows: list[dict]) -> None:
    """Server on cuda:0, trainer (this process) on cuda:1; SDK packed / unpacked, TRL per tensor,
    and the bare NCCL broadcast ceiling. A failed measurement becomes a failed row; the next one
    still runs."""
    # NVLink multicast off in this process, the server and the raw receiver (they inherit
    # os.environ), before any NCCL communicator exists.
    os.environ.update(NCCL_SAFE_ENV)
    trainer, server = NCCL_TRAINER_DEVICE, NCCL_SERVER_DEVICE
    torch.cuda.set_device(trainer)
    named = model_tensors(shape, torch.bfloat16, trainer)
    total = nbytes(named)
    bucket = args.bucket_mb << 20
    n_params = sum(t.numel() for _, t in named)
    tag = f"[nccl {shape}]"
    print(f"{tag} {n_params / 1e9:.2f} B parameters, {total / 1e9:.3f} GB bfloat16; server {server}, "
          f"trainer {trainer}; buckets of {args.bucket_mb} MiB")
    model_dir = save_shape(shape, work)
    with serve(model_dir, tok, "nccl", server, "bfloat16") as srv:
        for mode in ("nccl-packed", "nccl-unpacked"):
            info = NCCLTrainerInitInfo(world_size=2, packed=mode == "nccl-packed",
                                       packed_buffer_size_bytes=bucket, timeout_s=NCCL_TIMEOUT_S, device=trainer)
            attempt(rows, "nccl", shape, "nccl", mode, total,
                    lambda info=info: sdk_sync(srv.url, named, info, args.repeats), tag)
        attempt(rows, "nccl", shape, "nccl", "trl-http", total,
                lambda: trl_sync(srv.url, named, args.repeats, "nccl", trainer, NCCL_TIMEOUT_S), tag)
    sizes = bucket_sizes(named, bucket)
    named.clear()  # free the trainer's tensors before the ceiling allocates its buffers
    torch.cuda.empty_cache()

    def raw() -> dict:
        t = raw_broadcast(sizes, 2, args.repeats, backend="nccl", device=trainer, peer_device=server)
        return {"sync_s": t, "transfer_s": t, "all_sync_s": [t]}

    attempt(rows, "nccl", shape, "nccl", "raw-nccl", total, raw, tag)


CEILING_MODES = ("raw", "d2d-copy", "raw-nccl")


def table(rows: list[dict]) -> str:
    """Markdown table; "vs ceiling" = ceiling s/sync / row s/sync (= row GB/s / ceiling GB/s), the
    ceiling being the raw / d2d-copy / raw-nccl row of the same section and shape."""
    ceil = {(r["section"], r["shape"]): r for r in rows if r["mode"] in CEILING_MODES and not r.get("error")}
    lines = ["| backend | mode | shape | GB | s/sync | GB/s (sync) | GB/s (transfer) | vs ceiling |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['backend']} | {r['mode']} | {r['shape']} | - | - | - | - | failed: {r['error']} |")
            continue
        gbps = r["bytes"] / r["sync_s"] / 1e9
        tgbps = r["bytes"] / r["transfer_s"] / 1e9
        ref = ceil.get((r["section"], r["shape"]))
        vs = f"{ref['sync_s'] / r['sync_s']:.0%}" if ref is not None and ref is not r else "-"
        lines.append(f"| {r['backend']} | {r['mode']} | {r['shape']} | {r['bytes'] / 1e9:.3f} | {r['sync_s']:.4f} | "
                     f"{gbps:.2f} | {tgbps:.2f} | {vs} |")
    return "\n".join(lines)


def shape_list(value: str) -> list[str]:
    names = [s.strip() for s in value.split(",") if s.strip()]
    if not names:
        raise argparse.ArgumentTypeError("give at least one shape")
    for n in names:
        try:
            shape_config(n)
        except KeyError as e:
            raise argparse.ArgumentTypeError(str(e.args[0])) from None
    return list(dict.fromkeys(names))  # each shape once (its rows share one ceiling)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-shape", default="smollm2-135m")
    p.add_argument("--gpu-shape", default="qwen3-1.7b")
    p.add_argument("--nccl-shape", type=shape_list, default=["qwen3-1.7b"],
                   help="shape(s) of the NCCL section, comma-separated (e.g. qwen3-1.7b,qwen3-8b); each runs "
                        "its own server (default qwen3-1.7b)")
    p.add_argument("--bucket-mb", type=int, default=256, help="packed_buffer_size_bytes in MiB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cpu", choices=["on", "off"], default="on", help="gloo on CPU")
    p.add_argument("--gpu", choices=["auto", "on", "off"], default="auto",
                   help="CUDA IPC on one GPU (auto: when CUDA is present)")
    p.add_argument("--nccl", choices=["auto", "on", "off"], default="auto",
                   help="NCCL, server on cuda:0 and trainer on cuda:1 (auto: when there are >= 2 GPUs)")
    p.add_argument("--gpu-expert-names", choices=["fused", "both"], default="fused",
                   help="MoE shapes, CUDA IPC: the trainer sends transformers 5's fused expert tensors; 'both': "
                        "also one packed sync of the same bytes under the per-expert names (experts.{e}.gate_proj"
                        ".weight ...)")
    p.add_argument("--gpu-quick", action="store_true",
                   help="CUDA IPC: unpacked first (fused names, then per-expert with --gpu-expert-names both), then "
                        "packed, all with checksums; no unchecked row")
    p.add_argument("--gpu-unpacked-only", action="store_true",
                   help="CUDA IPC: only the unpacked syncs with checksums (IPC's default; fused names, then "
                        "per-expert with --gpu-expert-names both): the full 61 GB MoE shape on one card")
    p.add_argument("--gpu-unchecked", action="store_true",
                   help="with --gpu-unpacked-only: then one unpacked row (fused names) with checksums off (the "
                        "trainer's checksum pass is a read of every byte: what the server's copy alone costs)")
    p.add_argument("--gpu-trainer", choices=["full", "layer-pool"], default="full",
                   help="CUDA IPC: 'full': the trainer holds the whole model; 'layer-pool': one layer's tensors "
                        "serve every layer's names (an FSDP-style trainer gathering a layer at a time), so a model "
                        "of more than half the card syncs on one card; the server receives every layer's bytes")
    p.add_argument("--gpu-packed-bucket-mb", type=int, default=0,
                   help="CUDA IPC: one more packed sync (fused names) with buckets of this many MiB (0: none)")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    run_nccl = args.nccl == "on" or (args.nccl == "auto" and n_gpus >= 2)
    if run_nccl and n_gpus < 2:
        p.error(f"--nccl on needs 2 GPUs (one NCCL rank per GPU); this machine has {n_gpus}")
    sections = []
    if args.cpu == "on":
        sections.append(("cpu", args.cpu_shape, "gloo", lambda w, t, rows: bench_cpu(args, w, t, rows)))
    if args.gpu == "on" or (args.gpu == "auto" and torch.cuda.is_available()):
        sections.append(("gpu", args.gpu_shape, "ipc", lambda w, t, rows: bench_gpu(args, w, t, rows)))
    if run_nccl:
        for shape in args.nccl_shape:
            sections.append(("nccl", shape, "nccl",
                             lambda w, t, rows, shape=shape: bench_nccl(args, w, t, shape, rows)))
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as work:
        tok = tokenizer_dir(work)
        for section, shape, backend, run in sections:
            try:
                run(work, tok, rows)
            except Exception as e:  # noqa: BLE001 - report it, keep the other sections' rows
                add_error(rows, section, shape, backend, f"{section} section", e)
    print()
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "num_gpus": n_gpus,
                       "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}, f, indent=2,
                      default=str)
    return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
