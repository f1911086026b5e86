"""The HTTP stack alone (issue 37, s18): CPU per streamed chunk of uvicorn + FastAPI's
``StreamingResponse`` on each ``RLSERVE_HTTP_IMPL`` (asyncio + h11, uvloop + h11, uvloop +
httptools), with rlserve's bounded protocol classes and no engine, tokenizer or output
processor: what choosing the loop and the parser changes, apart from the rest of the chunk's path
(``benchmarks/api_stream_load.py`` measures the whole API process over a fake engine core).

A server process per round (``--serve``): one FastAPI route ``POST /v1/completions`` that streams
``--max-tokens`` SSE chunks of ~``--chunk-bytes`` bytes, one per tick of a shared clock of
``--step-ms`` (every open stream wakes on each tick, as every stream wakes on each engine step),
then ``data: [DONE]``. The client is api_stream_load's: ``--clients`` raw-socket streams in a
closed loop, ``--num-prompts`` requests in all. Reported per round: the server's CPU seconds (user
+ system, /proc) per chunk delivered, chunks per read, ITL (ms). Rounds run interleaved
(``--rounds``); the machine's load moves CPU seconds per chunk least, so compare those.

    python benchmarks/http_stack_bench.py --impls h11 uvloop-h11 auto --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def _serve(impl: str, step_ms: float, tokens: int, chunk_bytes: int, port_file: str) -> None:
    """The server process: the stack of ``impl`` serving the ticking stream route."""
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from rlserve.server.http_protocol import http_stack

    stack = http_stack(impl)
    app = FastAPI()
    tick: dict = {}
    chunk = b"data: " + json.dumps({"id": "cmpl-0", "object": "text_completion", "choices": [
        {"index": 0, "text": "x" * max(0, chunk_bytes - 120), "finish_reason": None}]}).encode() + b"\n\n"

    async def clock():
        loop = asyncio.get_running_loop()
        while True:
            tick["next"] = loop.create_future()
            await asyncio.sleep(step_ms / 1e3)
            tick["next"].set_result(None)

    async def events():
        for _ in range(tokens):
            await tick["next"]
            yield chunk
        yield b"data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions():
        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def main():
        asyncio.get_running_loop().create_task(clock())
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=30,
                                http=stack.protocol(30.0))
        server = uvicorn.Server(config)
        with open(port_file + ".tmp", "w") as f:
            f.write(f"{sock.getsockname()[1]} {stack.name}")
        os.replace(port_file + ".tmp", port_file)
        await server.serve(sockets=[sock])

    stack.run(main())


def run_round(impl: str, args, tmp: str) -> dict:
    from benchmarks.api_stream_load import _client_main, cpu_seconds, summarize

    port_file = os.path.join(tmp, f"port-{impl}-{time.monotonic_ns()}")
    srv = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", impl, str(args.step_ms),
                            str(args.max_tokens), str(args.chunk_bytes), port_file])
    try:
        t0 = time.monotonic()
        while not os.path.exists(port_file):
            if srv.poll() is not None or time.monotonic() - t0 > 120:
                raise RuntimeError(f"{impl}: the server did not start (exit {srv.poll()})")
            time.sleep(0.05)
        port, stack = open(port_file).read().split()
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        for clients, prompts in ((4, 8), (args.clients, args.num_prompts)):  # warm-up, then the run
            cp = ctx.Process(target=_client_main, args=(("127.0.0.1", int(port), "completions", "m", clients,
                                                          prompts, 1, args.max_tokens, (3, 9), 0), queue))
            cpu0 = cpu_seconds(srv.pid)
            cp.start()
            run = queue.get(timeout=args.timeout)
            cpu = cpu_seconds(srv.pid) - cpu0
            cp.join()
    finally:
        srv.terminate()
        srv.wait(30)
    out = {"impl": impl, "stack": stack, **summarize(run, args.max_tokens)}
    chunks = out["events_s"] * out["duration_s"]
    out["server_cpu_s"] = round(cpu, 3)
    out["server_cpu_us_per_chunk"] = round(1e6 * cpu / chunks, 2) if chunks else None
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        _serve(argv[1], float(argv[2]), int(argv[3]), int(argv[4]), argv[5])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impls", nargs="+", default=["h11", "uvloop-h11", "auto"], help="RLSERVE_HTTP_IMPL values")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=50.0)
    ap.add_argument("--chunk-bytes", type=int, default=260, help="bytes of one SSE chunk (rlserve's completions "
                                                                 "chunk of one token: ~250)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory(prefix="http-stack-bench-") as tmp:
        for rnd in range(args.rounds):
            for impl in args.impls:
                r = run_round(impl, args, tmp)
                r["round"] = rnd
                rows.append(r)
                print(f"round {rnd} {r['stack']}: {r['completed']} ok, server CPU {r['server_cpu_s']} s = "
                      f"{r['server_cpu_us_per_chunk']} us/chunk, ITL median/p99 "
                      f"{r['median_itl_ms']}/{r['p99_itl_ms']} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "argv": sys.argv[1:], "loadavg": os.getloadavg(), "cpus": os.cpu_count()},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
