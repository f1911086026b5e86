"""Single-stream TTFT and ITL of running servers with their threads at real-time priority: an
idle 2-core machine emulated on a shared one.

For each measurement every thread of the server's process tree and of this client is switched
to ``SCHED_FIFO`` priority 1 (root; the kernel's RT throttling still leaves the rest of the
machine 5% of each second) and back to ``SCHED_OTHER`` right after, so the server's threads
preempt whatever else runs, as if the machine were idle. Servers are measured in turn, order
alternating per round; per run ``--requests`` streamed ``/v1/completions`` one after the other,
each ``--prompt-len`` random token ids (new ids per round, the same for every server in it) and
``--max-tokens`` greedy tokens with ``ignore_eos``; prints TTFT median and ITL median / mean (ms).

Usage (servers started beforehand, e.g. ``rlserve serve ... --port 8001``):

    python benchmarks/cpu_rt_stream.py --server old=8001=PID1 --server new=8002=PID2 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time

import httpx

VOCAB = 49152  # SmolLM2's vocabulary (the default model)


def process_tree(pid: int) -> list[int]:
    """``pid`` and its live descendants (``/proc/<pid>/task/<tid>/children``)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(k) for k in f.read().split()]
        except OSError:
            pass
    return out


def set_realtime(pids: list[int], on: bool) -> None:
    """Every thread of ``pids`` to SCHED_FIFO 1 (``on``) or back to SCHED_OTHER; threads that
    exited in between are skipped."""
    policy, prio = (os.SCHED_FIFO, 1) if on else (os.SCHED_OTHER, 0)
    for p in pids:
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tids:
            try:
                os.sched_setscheduler(int(t), policy, os.sched_param(prio))
            except OSError:
                pass


async def stream_run(url: str, n: int, prompt_len: int, max_tokens: int, seed: int) -> dict:
    """``n`` streamed requests in turn: TTFT median and ITL median / mean, ms."""
    rng = random.Random(seed)
    gaps, ttfts = [], []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        for _ in range(n):
            body = {"model": model, "prompt": [rng.randrange(3, VOCAB) for _ in range(prompt_len)],
                    "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
            t0, times = time.perf_counter(), []
            async with client.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:]).get("choices"):
                        times.append(time.perf_counter())
            ttfts.append(times[0] - t0)
            gaps += [b - a for a, b in zip(times, times[1:])]
    return {"ttft_median_ms": round(1e3 * statistics.median(ttfts), 1),
            "itl_median_ms": round(1e3 * statistics.median(gaps), 1), "itl_mean_ms": round(1e3 * statistics.mean(gaps), 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--server", action="append", required=True, metavar="NAME=PORT=PID")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    servers = [s.split("=") for s in args.server]
    runs = []
    for rnd in range(args.rounds):
        for name, port, pid in (servers if rnd % 2 == 0 else servers[::-1]):
            pids = process_tree(int(pid)) + [os.getpid()]
            set_realtime(pids, True)
            try:
                res = asyncio.run(stream_run(f"http://127.0.0.1:{port}", args.requests, args.prompt_len,
                                             args.max_tokens, args.seed + 1000 * rnd))
            finally:
                set_realtime(pids, False)
            res.update(server=name, round=rnd, load=round(os.getloadavg()[0], 1))
            runs.append(res)
            print(json.dumps(res), flush=True)
            time.sleep(2)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
