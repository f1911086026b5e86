"""What the non-finite test costs a weight sync (``--weight-check-finite``, rlserve.transfer.finite).

One in-process server per shape (``tests.transfer_harness.InProcessServer``: the real app, the
engine core in its own process, ``--load-format dummy``) and a trainer in this process holding
random tensors with the shape's Hugging Face names (``benchmarks/sync.py``'s
``model_tensors``). The check is a per-update argument of the server's workers, so the same
server and trainer alternate syncs with the check on and off (the order flips every round),
after one warm-up sync of each: the two columns share the machine's state and drift. Last, one
sync with a NaN in one tensor must be refused (printed), and a good one follows.

- CPU, gloo: the SDK's default packed sync (buckets of ``--bucket-mb``, checksums after the
  data; from the second sync on received straight into the parameters).
- GPU, CUDA IPC (when CUDA is present and ``--gpu`` is not off): the SDK's default per-tensor
  handles with device checksums: the server's load copy, checksum and NaN / inf test are one
  Triton launch (``rlserve.transfer.multi_tensor``).

"sync" is the trainer's whole ``send_weights()``; "server" the workers' receive op
(``update_weights``' ``worker_op_seconds``). Medians of ``--repeats`` per mode.

Usage::

    python benchmarks/sync_finite.py --cpu-shape tiny-llama,qwen3-0.6b --gpu off
    python benchmarks/sync_finite.py --cpu off --gpu-shape qwen3-8b --repeats 10 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.model_shapes import save_shape  # noqa: E402
from benchmarks.sync import model_tensors, nbytes, tokenizer_dir  # noqa: E402
from rlserve.transfer import (  # noqa: E402
    GlooTrainerInitInfo,
    HTTPWeightSyncClient,
    IPCTrainerInitInfo,
    TensorListSource,
    WeightsRefusedNonFiniteError,
    WeightTransferTrainerFactory,
)
from tests.transfer_harness import InProcessServer  # noqa: E402


def ab(srv, named, init_info, repeats: int) -> dict:
    """Alternate syncs with the check on / off on one server and trainer; medians per mode."""
    eng = WeightTransferTrainerFactory.trainer_init(
        init_info=init_info, client=HTTPWeightSyncClient(srv.url, timeout_s=600), source=TensorListSource(named))
    runs: dict = {True: {"sync_s": [], "server_s": []}, False: {"sync_s": [], "server_s": []}}
    try:
        for r in range(repeats + 1):
            for check in ((True, False) if r % 2 else (False, True)):
                srv.manager.check_finite = check
                t0 = time.perf_counter()
                eng.send_weights()
                dt = time.perf_counter() - t0
                if r:  # round 0: one warm-up sync of each mode
                    runs[check]["sync_s"].append(dt)
                    server = eng.last_stats.get("server") or {}
                    runs[check]["server_s"].append(float(server.get("worker_op_seconds", "nan")))
        # then one sync with a NaN in one element: refused naming the tensor, the next good one serves
        srv.manager.check_finite = True
        name, t = named[len(named) // 2]
        poisoned = t.clone()
        poisoned.view(-1)[5] = float("nan")
        eng.source = TensorListSource([(n, poisoned if n == name else x) for n, x in named])
        try:
            eng.send_weights()
            print(f"NOT REFUSED: a sync with a NaN in {name!r} committed", flush=True)
        except WeightsRefusedNonFiniteError as e:
            print(f"refused as expected ({e.status_code} {e.code}): {e.message[:160]}", flush=True)
        eng.source = TensorListSource(named)
        eng.send_weights()
    finally:
        srv.manager.check_finite = True
        eng.shutdown()
    out = {}
    for check, m in runs.items():
        key = "on" if check else "off"
        out[key] = {"sync_s": statistics.median(m["sync_s"]), "server_s": statistics.median(m["server_s"]),
                    "all_sync_s": m["sync_s"]}
    out["overhead"] = out["on"]["sync_s"] / out["off"]["sync_s"] - 1
    return out


def server(model_dir: str, tok: str, backend: str, device: str, dtype: str) -> InProcessServer:
    kw = dict(device=device, dtype=dtype, tokenizer=tok, max_model_len=256, max_num_seqs=4)
    if device != "cpu":
        kw.update(num_kv_blocks=64, enforce_eager=True, kv_cache_bytes=None)
    return InProcessServer(model_dir, transfer_config={"backend": backend}, **kw)


def bench(section: str, shape: str, dtype: torch.dtype, args, work: str, tok: str, rows: list) -> None:
    cpu = section == "cpu"
    dev = "cpu" if cpu else "cuda:0"
    named = model_tensors(shape, dtype, dev)
    total = nbytes(named)
    model_dir = save_shape(shape, work)
    dt_name = str(dtype).removeprefix("torch.")
    with server(model_dir, tok, "gloo" if cpu else "ipc", dev, dt_name) as srv:
        info = GlooTrainerInitInfo(world_size=2, packed_buffer_size_bytes=args.bucket_mb << 20,
                                   timeout_s=600) if cpu else IPCTrainerInitInfo(timeout_s=600, device=dev)
        r = ab(srv, named, info, args.repeats)
    row = {"section": section, "shape": shape, "dtype": dt_name, "bytes": total, **r}
    rows.append(row)
    print(f"[{section}] {shape} {dt_name} {total / 1e9:.3f} GB: check off {r['off']['sync_s']:.4f} s, "
          f"on {r['on']['sync_s']:.4f} s ({r['overhead']:+.1%}); server {r['off']['server_s']:.4f} / "
          f"{r['on']['server_s']:.4f} s", flush=True)
    del named
    if not cpu:
        torch.cuda.empty_cache()


def table(rows: list[dict]) -> str:
    lines = ["| section | shape | dtype | GB | s/sync check off | s/sync check on | cost | server s off / on |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['section']} | {r['shape']} | {r['dtype']} | {r['bytes'] / 1e9:.3f} | "
                     f"{r['off']['sync_s']:.4f} | {r['on']['sync_s']:.4f} | {r['overhead']:+.1%} | "
                     f"{r['off']['server_s']:.4f} / {r['on']['server_s']:.4f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-shape", default="tiny-llama,qwen3-0.6b", help="comma-separated; 'off': no CPU section")
    p.add_argument("--cpu-dtype", default="bfloat16")
    p.add_argument("--gpu-shape", default="qwen3-8b")
    p.add_argument("--gpu", choices=["auto", "off"], default="auto")
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows: list = []
    with tempfile.TemporaryDirectory() as work:
        tok = tokenizer_dir(work)
        if args.cpu_shape != "off":
            for shape in args.cpu_shape.split(","):
                bench("cpu", shape.strip(), getattr(torch, args.cpu_dtype), args, work, tok, rows)
        if args.gpu == "auto" and torch.cuda.is_available():
            bench("gpu", args.gpu_shape, torch.bfloat16, args, work, tok, rows)
    print()
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows,
                       "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
