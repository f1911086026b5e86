"""Kill matrix: how long a server takes to notice a trainer SIGKILLed mid-sync (gloo, CPU).

A real ``rlserve serve`` process (tiny llama, float32, ``--load-format dummy``) per staging mode;
for every kill point a trainer subprocess (the SDK, packed gloo, 16 KiB buckets,
``timeout_s`` = ``--timeout-s``, default 300) starts a sync and SIGKILLs itself at that point
(``tests/transfer_harness.py``: ``after_start``, ``first_bucket``, ``between_buckets``,
``after_update``). It prints ``time.time()`` just before the kill; the server's
``/weight_info`` ``last_update.time`` is when it recorded the failure. Right after the kill a
greedy request is sent: its status and latency show what a client meets meanwhile. Between
cells a full sync from this process restores a known, available model.

Usage::

    python benchmarks/kill_matrix.py                              # liveness on (default)
    python benchmarks/kill_matrix.py --no-liveness --timeout-s 20  # the baseline: timeout_s only

Prints one markdown table (kill -> failure seconds, outcome) and writes it with the raw rows
as JSON under ``--out`` when given.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rlserve.server.testing import ServerProcess  # noqa: E402
from rlserve.transfer import (  # noqa: E402
    GlooTrainerInitInfo,
    HTTPWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
)
from tests.tiny_models import make_tiny_model  # noqa: E402
from tests.transfer_harness import KILL_POINTS, free_port, kill_trainer_script, killed_at  # noqa: E402

SERVER_ARGS = ("--device", "cpu", "--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "16",
               "--kv-cache-bytes", str(16 << 20), "--load-format", "dummy")


def generate(url: str, timeout: float) -> tuple[int | str, float]:
    t0 = time.monotonic()
    try:
        r = httpx.post(url + "/generate/", json={"prompt_ids": [[5, 17, 42]], "max_tokens": 4, "temperature": 0,
                                                 "generation_kwargs": {"ignore_eos": True}}, timeout=timeout)
        status: int | str = r.status_code
    except httpx.TimeoutException:
        status = "no answer"
    return status, time.monotonic() - t0


def full_sync(url: str, path: str, bucket_bytes: int) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    eng = WeightTransferTrainerFactory.trainer_init(
        init_info=GlooTrainerInitInfo(master_port=free_port(), world_size=2, timeout_s=60,
                                      packed_buffer_size_bytes=bucket_bytes),
        client=HTTPWeightSyncClient(url, timeout_s=60), source=ModuleSource(hf))
    eng.send_weights()
    eng.shutdown()


def wait_failure(url: str, t_kill: float, limit_s: float) -> dict:
    deadline = time.monotonic() + limit_s
    info: dict = {}
    while time.monotonic() < deadline:
        info = httpx.get(url + "/weight_info", timeout=10).json()
        last = info.get("last_update") or {}
        if last.get("ok") is False and last.get("time", 0) >= t_kill - 1 and info["state"] == "uninitialized":
            return info
        time.sleep(0.05)
    raise RuntimeError(f"no failure recorded within {limit_s:.0f} s of the kill: {info}")


def run_cell(srv: ServerProcess, path: str, point: str, timeout_s: float, bucket_bytes: int) -> dict:
    script = kill_trainer_script(ROOT, path, srv.url, free_port(), timeout_s=timeout_s, scale=0.5, kill_at=point,
                                 bucket_bytes=bucket_bytes)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    t_kill = killed_at(proc.stdout)
    status, gen_s = generate(srv.url, timeout=timeout_s + 60)  # a client arriving after the kill
    info = wait_failure(srv.url, t_kill, timeout_s + 90)
    last = info["last_update"]
    after, _ = generate(srv.url, timeout=60)
    return {"kill_at": point, "kill_to_failure_s": round(last["time"] - t_kill, 3),
            "request_at_kill": status, "request_at_kill_s": round(gen_s, 3), "after": after,
            "paused": httpx.get(srv.url + "/is_paused", timeout=10).json().get("is_paused"),
            "error": last["error"][:300]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout-s", type=float, default=300.0, help="the trainer's init_info.timeout_s")
    ap.add_argument("--no-liveness", action="store_true", help='"trainer_liveness": false (the baseline)')
    ap.add_argument("--staging", nargs="+", default=["none", "device"])
    ap.add_argument("--points", nargs="+", default=list(KILL_POINTS), choices=KILL_POINTS)
    ap.add_argument("--bucket-bytes", type=int, default=16 << 10, help="packed_buffer_size_bytes (16 KiB)")
    ap.add_argument("--hidden-size", type=int, default=64,
                    help="the tiny llama's hidden size (64: 0.2 MB of weights; 512 with --layers 4: 63 MB)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    path = make_tiny_model("llama", tempfile.mkdtemp(prefix="kill-matrix-"), hidden_size=args.hidden_size,
                           intermediate_size=2 * args.hidden_size, num_hidden_layers=args.layers)
    cfg = {"backend": "gloo", "trainer_liveness": not args.no_liveness}
    rows = []
    for staging in args.staging:
        with ServerProcess(path, *SERVER_ARGS, "--weight-transfer-config", json.dumps(cfg),
                           "--weight-staging", staging) as srv:
            for point in args.points:
                full_sync(srv.url, path, args.bucket_bytes)  # known, available weights before every kill
                row = {"staging": staging, **run_cell(srv, path, point, args.timeout_s, args.bucket_bytes)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\ngloo, CPU, timeout_s={args.timeout_s:.0f}, trainer_liveness={not args.no_liveness}, "
          f"buckets {args.bucket_bytes} B, hidden {args.hidden_size} x {args.layers} layers, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    print("| staging | kill point | kill -> failure (s) | request sent at the kill | after | paused after |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['staging']} | {r['kill_at']} | {r['kill_to_failure_s']:.2f} | {r['request_at_kill']} in "
              f"{r['request_at_kill_s']:.2f} s | {r['after']} | {r['paused']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
