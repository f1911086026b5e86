"""Generation stall seen by a client during a weight update.

A real ``rlserve serve --load-format dummy --weight-staging {device,host,none}`` process streams
one long completion (``ignore_eos``) to an HTTP client that timestamps every token, while the
trainer (this process) pushes the model's weights with ``send_weights()``. The stall is the
longest gap between two streamed tokens while the sync ran, minus the median gap outside it.
In staged mode generation continues during the transfer and should only pause for the commit's
local copy; in place (``none``) it pauses for the whole transfer.

Usage::

    python benchmarks/stall.py --device cpu --shape smollm2-135m --staging device      # gloo
    python benchmarks/stall.py --device cuda --shape qwen3-1.7b --staging device       # ipc

Issue 7's target: stall <= 10 ms for the 1.7B shape on one H200 with ``--weight-staging device``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

import httpx
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.model_shapes import save_shape  # noqa: E402
from benchmarks.sync import model_tensors, tokenizer_dir  # noqa: E402
from rlserve.server.testing import ServerProcess  # noqa: E402
from rlserve.transfer import (  # noqa: E402
    GlooTrainerInitInfo,
    HTTPWeightSyncClient,
    IPCTrainerInitInfo,
    TensorListSource,
    WeightTransferTrainerFactory,
)


def stream_tokens(url: str, max_tokens: int, stamps: list[float], versions: list[str], stop: threading.Event) -> None:
    """Stream one completion; append each chunk's arrival time (s, perf_counter) to ``stamps``."""
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": [5, 6, 7, 8], "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if stop.is_set():
                return
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            stamps.append(time.perf_counter())
            chunk = json.loads(line[6:])
            v = chunk.get("weight_version") or next(
                (c.get("weight_version") for c in chunk.get("choices", []) if c.get("weight_version")), None)
            if v is not None and (not versions or versions[-1] != v):
                versions.append(v)


def measure(args) -> dict:
    gpu = args.device.startswith("cuda")
    dtype = torch.bfloat16 if gpu else torch.float32
    named = model_tensors(args.shape, dtype, args.device)
    with tempfile.TemporaryDirectory() as work:
        model_dir = save_shape(args.shape, work)
        backend = "ipc" if gpu else "gloo"
        srv_args = ["--tokenizer", tokenizer_dir(work), "--load-format", "dummy", "--device", args.device,
                    "--dtype", "bfloat16" if gpu else "float32", "--max-model-len", str(args.max_tokens + 16),
                    "--max-num-seqs", "4", "--weight-staging", args.staging,
                    "--weight-transfer-config", json.dumps({"backend": backend})]
        with ServerProcess(model_dir, *srv_args, startup_timeout_s=900) as srv:
            info = (IPCTrainerInitInfo(device=args.device) if gpu else
                    GlooTrainerInitInfo(world_size=2))
            eng = WeightTransferTrainerFactory.trainer_init(
                init_info=info, client=HTTPWeightSyncClient(srv.url, timeout_s=600), source=TensorListSource(named))
            eng.send_weights()  # warm-up: first sync allocates staging buffers, maps handles
            stamps: list[float] = []
            versions: list[str] = []
            stop = threading.Event()
            errors: list[BaseException] = []

            def client() -> None:
                try:
                    stream_tokens(srv.url, args.max_tokens, stamps, versions, stop)
                except BaseException as e:  # noqa: BLE001 - reported after the run
                    errors.append(e)

            th = threading.Thread(target=client, daemon=True)
            th.start()
            deadline = time.monotonic() + 120
            while len(stamps) < args.warmup_tokens and time.monotonic() < deadline:
                time.sleep(0.005)
            t0 = time.perf_counter()
            fin = eng.send_weights()
            t1 = time.perf_counter()
            n_before = len(stamps)
            while len(stamps) < n_before + args.warmup_tokens and th.is_alive():
                time.sleep(0.005)
            stop.set()
            eng.shutdown()
    gaps = [(b - a, a, b) for a, b in zip(stamps, stamps[1:])]
    during = [g for g, a, b in gaps if b >= t0 and a <= t1]
    outside = [g for g, a, b in gaps if b < t0 or a > t1]
    if errors:
        raise RuntimeError(f"the streaming client failed: {errors[0]!r}")
    if not during or not outside:
        raise RuntimeError(f"too few tokens around the sync ({len(stamps)} streamed); raise --max-tokens")
    base = statistics.median(outside)
    return {"shape": args.shape, "device": args.device, "staging": args.staging, "sync_s": t1 - t0,
            "max_gap_during_sync_ms": max(during) * 1e3, "median_gap_ms": base * 1e3,
            "stall_ms": (max(during) - base) * 1e3, "tokens_during_sync": len(during) - 1,
            "versions_seen": versions,
            "server_commit_phases_ms": {k: round(v * 1e3, 2) for k, v in fin.get("commit_phases_s", {}).items()},
            "commit_replayed": fin.get("commit_replayed")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--staging", choices=["device", "host", "none"], default="device")
    ap.add_argument("--max-tokens", type=int, default=2000)
    ap.add_argument("--warmup-tokens", type=int, default=20, help="tokens streamed before and after the sync")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    r = measure(args)
    print(f"{r['shape']} on {r['device']}, staging={r['staging']}: sync {r['sync_s'] * 1e3:.1f} ms, "
          f"stall {r['stall_ms']:.1f} ms (max gap {r['max_gap_during_sync_ms']:.1f} ms during the sync, "
          f"median gap {r['median_gap_ms']:.1f} ms), {r['tokens_during_sync']} tokens streamed during the sync, "
          f"versions {r['versions_seen']}; server commit phases (ms): {r['server_commit_phases_ms']}, "
          f"replayed copy plan: {r['commit_replayed']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
