"""A paced SSE server for measuring a streaming client alone (issue 37: does ``vllm bench serve``'s one client
process keep up with 256 streams at rlserve's event rates?).

It answers every ``POST /v1/completions`` (and ``/v1/chat/completions``) with an OpenAI-style SSE stream:
one chunk per tick for each open stream, ``max_tokens`` chunks, then a usage chunk and ``[DONE]``. One timer
writes every open stream's chunk in the same callback (a pre-encoded byte string per chunk, one
``transport.write`` per stream and tick: no per-stream coroutine, no JSON encoding), so the server's own cost
is a few microseconds a chunk and its write times are the tick's. Each stream's write times are kept
(``perf_counter``, ``CLOCK_MONOTONIC``: the client's clock too) and written, one line per stream in
``benchmarks/stream_trace.py``'s format (``<arrival> <start> <t1> 1 <t2> 1 ...``), to ``--trace DIR`` at the
end: ``benchmarks/stream_gaps.py RESULT --server DIR`` then says how much of each long client gap the client
added. HTTP/1.1 keep-alive (a request that says ``Connection: close``, as ``api_stream_load.py``'s raw clients do, is
closed after its stream: ``benchmarks/api_stream_floor.py``), chunked transfer encoding; the request body is read by Content-Length and only
``max_tokens`` is looked at.

Usage::

    python benchmarks/sse_pace_server.py --port 8123 --tick-ms 10 --trace DIR   # until SIGINT / SIGTERM

``--admit-per-tick K`` admits at most K new streams a tick (the rest wait, their response not started), as an
engine admits a few prompts per prefill step (rlserve's 2,048-token budget: 4 prompts of 512 a step): a wave of
requests then starts, and ends, spread over many ticks, and the client sends the next wave's requests while the
last one's streams are still running, as against a real server.

``GET /health`` and ``GET /v1/models`` answer 200 (the client's readiness check).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import time

CHUNK = (b'data: {"id":"cmpl-0","object":"text_completion","created":0,"model":"m","choices":[{"index":0,'
         b'"text":" tok","logprobs":null,"finish_reason":null}]}\n\n')
USAGE = (b'data: {"id":"cmpl-0","object":"text_completion","created":0,"model":"m","choices":[],'
         b'"usage":{"prompt_tokens":1,"completion_tokens":%d,"total_tokens":%d}}\n\ndata: [DONE]\n\n')
HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
        b"transfer-encoding: chunked\r\n\r\n")


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class _Conn(asyncio.Protocol):
    def __init__(self, server: "PaceServer"):
        self.server, self.buf, self.transport = server, b"", None
        self.close_after = False  # the request said ``Connection: close``: close once its stream ends

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes):
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1")
            m = re.search(r"(?im)^content-length:\s*(\d+)", head)
            n = int(m.group(1)) if m else 0
            if len(self.buf) < end + 4 + n:
                return
            body, self.buf = self.buf[end + 4:end + 4 + n], self.buf[end + 4 + n:]
            self.close_after = re.search(r"(?im)^connection:\s*close\s*$", head) is not None
            self.server.request(self, head.split(" ", 2)[:2], body)

    def connection_lost(self, exc):
        self.server.drop(self)


class PaceServer:
    """One tick timer for every open stream (see the module docstring)."""

    def __init__(self, tick_s: float, admit: int = 0):
        self.tick_s, self.admit = tick_s, admit
        self.waiting: list = []  # (conn, tokens, arrival) not admitted yet (admit > 0)
        self.streams: dict[_Conn, list] = {}  # conn -> [tokens left, total, record]
        self.done: list[list] = []
        self.loop = None

    def request(self, conn: _Conn, method_path: list[str], body: bytes) -> None:
        arrival = time.perf_counter()
        method, path = (method_path + ["", ""])[:2]
        if method == "GET":
            data = b'{"object":"list","data":[{"id":"m","object":"model"}]}'
            conn.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                                 % (len(data), data))
            return
        try:
            n = int(json.loads(body or b"{}").get("max_tokens") or 16)
        except (ValueError, AttributeError):
            n = 16
        if self.admit > 0:
            self.waiting.append((conn, n, arrival))
            return
        self.start(conn, n, arrival)

    def start(self, conn: _Conn, n: int, arrival: float) -> None:
        conn.transport.write(HEAD)
        self.streams[conn] = [n, n, [arrival, time.perf_counter()]]

    def drop(self, conn: _Conn) -> None:
        self.streams.pop(conn, None)
        self.waiting = [w for w in self.waiting if w[0] is not conn]

    def tick(self) -> None:
        if self.waiting:
            admitted, self.waiting = self.waiting[:self.admit], self.waiting[self.admit:]
            for conn, n, arrival in admitted:
                self.start(conn, n, arrival)
        t = time.perf_counter()
        finished = []
        for conn, st in self.streams.items():
            st[0] -= 1
            st[2] += [t, 1]
            if st[0] > 0:
                conn.transport.write(_chunked(CHUNK))
            else:
                conn.transport.write(_chunked(CHUNK + USAGE % (st[1], st[1] + 1)) + b"0\r\n\r\n")
                finished.append(conn)
        for conn in finished:
            self.done.append(self.streams.pop(conn)[2])
            if conn.close_after:  # api_stream_load's raw clients read a response to its end of file
                conn.transport.close()
        self.loop.call_at(self.next, self.tick)
        self.next += self.tick_s
        if self.next < self.loop.time():  # fell behind: skip, do not burst
            self.next = self.loop.time() + self.tick_s

    def write_trace(self, out_dir: str) -> None:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"{os.getpid()}.chunks"), "w") as f:
            for rec in self.done:
                f.write(" ".join(f"{x:.6f}" if isinstance(x, float) else str(x) for x in rec) + "\n")


async def serve(port: int, tick_ms: float, trace: str | None, admit: int = 0) -> None:
    srv = PaceServer(tick_ms / 1e3, admit)
    loop = srv.loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Conn(srv), "127.0.0.1", port)
    srv.next = loop.time() + srv.tick_s
    loop.call_at(srv.next, srv.tick)
    srv.next += srv.tick_s
    stop = loop.create_future()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
    print(f"sse_pace_server: http://127.0.0.1:{server.sockets[0].getsockname()[1]} tick {tick_ms} ms", flush=True)
    await stop
    server.close()
    if trace:
        srv.write_trace(trace)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--tick-ms", type=float, default=10.0)
    ap.add_argument("--trace", help="write the streams' write times here at exit (stream_trace.py's format)")
    ap.add_argument("--admit-per-tick", type=int, default=0, help="new streams admitted per tick at most (0: all)")
    args = ap.parse_args(argv)
    asyncio.run(serve(args.port, args.tick_ms, args.trace, args.admit_per_tick))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
