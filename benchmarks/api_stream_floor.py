"""The floor of a streamed event's cost in one Python process (issue 37): ``benchmarks/sse_pace_server.py``
(one timer callback writes every open stream's pre-encoded chunk, one ``transport.write`` each: no
per-stream coroutine, ASGI layer, JSON or output processing) on uvloop, as rlserve serves, driven by
``benchmarks/api_stream_load.py``'s raw-socket clients with the same arguments; the server process's CPU
(``/proc``, user and kernel) per event. What a "write the SSE bytes straight to the transport from one
per-step callback" path could cost at best, before its own output processing.

Usage (CPU, from the repository root)::

    python benchmarks/api_stream_floor.py --clients 256 --num-prompts 256 --max-tokens 128 --step-ms 100 \\
        [--rounds 2] [--json out.json]

Each round starts a fresh server. Wall-clock and CPU figures move with the machine's load; compare with an
``api_stream_load.py`` run of the same arguments taken beside it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.api_stream_load import _client_main, cpu_user_system, summarize  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVE = ("import sys, uvloop; uvloop.install(); from benchmarks.sse_pace_server import main; "
         "sys.exit(main(sys.argv[1:]))")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, timeout: float = 30.0) -> None:
    t_end = time.time() + timeout
    while time.time() < t_end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"sse_pace_server did not listen on {port} within {timeout} s")


def one_round(args) -> dict:
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    srv = subprocess.Popen([sys.executable, "-c", SERVE, "--port", str(port), "--tick-ms", str(args.step_ms)],
                           cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_listening(port)
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        cp = ctx.Process(target=_client_main, args=(("127.0.0.1", port, "completions", "pace", args.clients,
                                                      args.num_prompts, args.prompt_len, args.max_tokens,
                                                      (3, 300), 0), queue))
        (u0, s0), wall0 = cpu_user_system(srv.pid), time.time()
        cp.start()
        run = queue.get(timeout=args.timeout)
        (u1, s1), wall1 = cpu_user_system(srv.pid), time.time()
        cp.join()
    finally:
        srv.terminate()
        srv.wait(30)
    out = summarize(run, args.max_tokens)
    events = out["events_s"] * out["duration_s"]
    cpu = u1 + s1 - u0 - s0
    out.update(server_cpu_s=round(cpu, 2), server_cpu_system_s=round(s1 - s0, 2),
               server_cpu_us_per_event=round(1e6 * cpu / events, 1) if events else None,
               server_cpu_system_us_per_event=round(1e6 * (s1 - s0) / events, 1) if events else None,
               window_unix_s=[round(wall0, 3), round(wall1, 3)])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--step-ms", type=float, default=100.0, help="the server's tick (one chunk per stream)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    rows = []
    for i in range(args.rounds):
        r = one_round(args)
        rows.append(r)
        print(f"round {i}: {r['completed']} ok / {r['failed']} failed, {r['events_s']} events/s, ITL median/p99 "
              f"{r['median_itl_ms']}/{r['p99_itl_ms']} ms; server CPU {r['server_cpu_s']} s = "
              f"{r['server_cpu_us_per_event']} us/event (kernel {r['server_cpu_system_us_per_event']})", flush=True)
    if args.json:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "host": platform.node(),
                "loadavg": os.getloadavg(), "argv": sys.argv[1:], "cpus": os.cpu_count()}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rounds": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
