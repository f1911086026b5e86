"""The API process's work per streamed event with and without the direct writes (issue 37,
``rlserve/server/direct_write.py``), as an instruction count: one process runs the real app on
uvicorn (uvloop + httptools, rlserve's protocol class) over a fake engine on the engine thread
(``engine_mode="thread"``), and ``--streams`` raw-socket clients on the same event loop; the engine
makes a step (a token of text ``"ab"`` for every stream) only when every client has read the
previous one, so each step is one event per stream on both paths (no merging, no timing). The
protocol's ``direct_write`` picks the path: the middle chunks from the step's callback (``on``) or
through each request's coroutine and the ASGI stack (``off``, as before). The counted part is
``--steps`` middle steps (the first and last chunks, the requests' admission and the start-up are
not counted): the engine thread's step, the hand-off to the loop, the chunk's encoding and framing,
the socket write, and the clients' reads (the same on both paths).

Under ``valgrind --tool=callgrind --instr-atstart=no`` with ``API_STREAM_STEP_CALLGRIND=1`` only the
counted part is instrumented (``callgrind_control -i on|off``)::

    API_STREAM_STEP_CALLGRIND=1 valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=cg.out \\
        python benchmarks/api_stream_step.py --direct on --streams 64 --steps 16   # then: grep totals cg.out

Without valgrind it prints the process's CPU time of the counted part (``time.process_time``:
both threads; the machine's load moves it, the instruction count it does not)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _instrument(state: str) -> None:
    if os.environ.get("API_STREAM_STEP_CALLGRIND") == "1":
        subprocess.run(["callgrind_control", "-i", state, str(os.getpid())], check=True, capture_output=True)


class GatedEngine:
    """A fake engine: each :meth:`release` lets one step run, which adds token ``7`` (text ``"ab"``)
    to every request; a request ends at ``max_tokens`` (``length``)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.vocab_size, self.max_model_len, self.eos_token_ids = tokenizer, len(tokenizer), 4096, [2]
        self.reqs: dict = {}
        self.gate = threading.Semaphore(0)

    def add_request(self, rid, prompt, params):
        self.reqs[rid] = (list(prompt), params, [])

    def step(self):
        from rlserve.engine.outputs import CompletionOutput, RequestOutput

        if not self.gate.acquire(timeout=0.05):
            return []
        outs = []
        for rid, (prompt, params, toks) in list(self.reqs.items()):
            toks.append(7)
            done = len(toks) >= params.max_tokens
            outs.append(RequestOutput(rid, None, prompt, None, [CompletionOutput(
                0, "ab" * len(toks), list(toks), finish_reason="length" if done else None)], done))
            if done:
                del self.reqs[rid]
        return outs

    def abort_request(self, ids):
        for r in [ids] if isinstance(ids, str) else ids:
            self.reqs.pop(r, None)
        return []

    def has_unfinished_requests(self):
        return bool(self.reqs)


class _Barrier:
    """The driver waits here until every client read event ``target`` (one count per client)."""

    def __init__(self):
        self.target, self.remaining, self.fut = 0, 0, None

    def reached(self) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            self.fut.set_result(None)


class _Client(asyncio.Protocol):
    """One streamed request; counts the ``data:`` events it reads (``[DONE]`` or a closed connection:
    every target reached)."""

    def __init__(self, request: bytes, barrier: _Barrier):
        self.request, self.barrier, self.events, self.at = request, barrier, 0, 0

    def connection_made(self, transport):
        transport.write(self.request)

    def data_received(self, data: bytes):
        self.events += data.count(b"data: ")
        if b"data: [DONE]" in data:
            self.events = 1 << 30
        self._check()

    def connection_lost(self, exc):
        self.events = 1 << 30
        self._check()

    def _check(self) -> None:
        b = self.barrier
        if self.at < b.target <= self.events:
            self.at = b.target
            b.reached()


async def run(direct: bool, streams: int, steps: int) -> dict:
    import uvicorn

    from rlserve.config import EngineConfig
    from rlserve.engine.front.async_engine import AsyncEngine
    from rlserve.server.app import build_app
    from rlserve.server.http_protocol import http_stack
    from rlserve.server.launch import free_port
    from rlserve.server.state import ServerSettings
    from tests.tiny_models import build_tokenizer, make_tiny_model

    import tempfile

    stack = http_stack("auto")
    if stack.name != "uvloop+httptools":
        raise SystemExit(f"needs uvloop and httptools (the direct writes' stack), got {stack.name}")
    model = make_tiny_model("llama", os.path.join(tempfile.gettempdir(), "rlserve_api_stream_step_tiny"))
    engine = GatedEngine(build_tokenizer())
    aengine = AsyncEngine(EngineConfig(model=model, device="cpu", dtype="float32", max_model_len=4096),
                          engine_factory=lambda cfg, i: engine)
    port = free_port()
    app = build_app(aengine, ServerSettings(model=model, served_model_names=["m"], host="127.0.0.1", port=port))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           http=stack.protocol(30.0, direct_write=direct)))
    serving = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    loop = asyncio.get_running_loop()
    barrier = _Barrier()
    body = json.dumps({"model": "m", "prompt": [5, 6, 7], "max_tokens": steps + 2, "stream": True,
                       "ignore_eos": True, "temperature": 0}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    clients = []
    for _ in range(streams):
        c = _Client(request, barrier)
        await loop.create_connection(lambda c=c: c, "127.0.0.1", port)
        clients.append(c)

    async def step(k: int) -> None:  # one step; back once every client read its event k
        engine.gate.release()
        barrier.target, barrier.remaining, barrier.fut = k, 0, loop.create_future()
        for c in clients:
            if c.events >= k:
                c.at = k
            else:
                barrier.remaining += 1
        if barrier.remaining:
            await barrier.fut

    while len(engine.reqs) < streams:  # every request reached the engine
        await asyncio.sleep(0.01)
    await step(1)  # the first chunk (the coroutine's on both paths)
    _instrument("on")
    t0 = time.process_time()
    for k in range(2, steps + 2):
        await step(k)
    cpu = time.process_time() - t0
    _instrument("off")
    events = sum(c.events for c in clients) - streams  # read in the counted steps
    await step(steps + 3)  # the last chunk and [DONE]
    server.should_exit = True
    await serving
    aengine.shutdown()
    return {"direct": direct, "streams": streams, "steps": steps, "events": events, "cpu_s": round(cpu, 4),
            "cpu_us_per_event": round(cpu / events * 1e6, 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--direct", choices=("on", "off"), default="on")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--steps", type=int, default=16)
    args = p.parse_args(argv)
    import uvloop

    print(json.dumps(uvloop.run(run(args.direct == "on", args.streams, args.steps))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
