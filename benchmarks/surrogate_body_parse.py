"""Process CPU time per request of a body the lone-surrogate check parses (an escaped surrogate pair: what a
client's ``json.dumps`` sends for an emoji), through :class:`rlserve.server.text_check.LoneSurrogateCheck` and a
:class:`rlserve.server.request_body.FastJSONRoute` route validating the server's request model: the body parsed
once (the route takes the check's value: ``request_body.remember``) against twice (``remember`` switched off in
the same process: the code before session 24), alternating A/B turns. Direct ASGI calls, no sockets.

    python benchmarks/surrogate_body_parse.py --turns 6 --requests 400 --json OUT.json

``--single once|twice --body NAME``: one warm request, then ``--requests`` requests in that mode and nothing else,
for instruction counts (``valgrind --tool=callgrind``: run it with ``--requests 0`` too and subtract).

Bodies: ``ids``: a completion of 512 token ids with an emoji stop string; ``chat``: a chat of 8 messages of
~1 KB of text each, every message with emoji (each escaped as two \\\\uXXXX halves), as ``json.dumps`` writes it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fastapi import APIRouter, FastAPI  # noqa: E402

from rlserve.server import text_check  # noqa: E402
from rlserve.server.errors import install_error_handlers  # noqa: E402
from rlserve.server.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from rlserve.server.request_body import FastJSONRoute  # noqa: E402

BODIES = {
    "ids": json.dumps({"prompt": list(range(512)), "max_tokens": 16, "stop": ["\U0001F600"]}).encode(),
    "chat": json.dumps({"messages": [{"role": "user" if i % 2 == 0 else "assistant",
                                      "content": ("Hello \U0001F600 world, " * 50)[:1000]} for i in range(8)],
                        "max_tokens": 16}).encode(),
}


def build_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    router = APIRouter(route_class=FastJSONRoute)

    @router.post("/ids")
    async def ids(body: CompletionRequest):
        return {"n": len(body.prompt)}

    @router.post("/chat")
    async def chat(body: ChatCompletionRequest):
        return {"n": len(body.messages)}

    app.include_router(router)
    app.add_middleware(text_check.LoneSurrogateCheck)
    return app


async def post(app, path: str, body: bytes) -> int:
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    sent = [{"type": "http.request", "body": body, "more_body": False}]
    status = []

    async def receive():
        return sent.pop() if sent else {"type": "http.disconnect"}

    async def send(msg):
        if msg["type"] == "http.response.start":
            status.append(msg["status"])

    await app(scope, receive, send)
    return status[0]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--json")
    ap.add_argument("--single", choices=["once", "twice"])
    ap.add_argument("--body", choices=sorted(BODIES), default="ids")
    args = ap.parse_args()
    app = build_app()
    remember = text_check.remember
    if args.single:
        if args.single == "twice":
            text_check.remember = lambda scope, b, v: None

        async def single():
            for _ in range(1 + args.requests):
                assert await post(app, "/" + args.body, BODIES[args.body]) == 200

        asyncio.run(single())
        return 0
    res: dict = {name: {"once": [], "twice": []} for name in BODIES}

    async def turn(name: str, body: bytes) -> float:
        t = time.process_time()
        for _ in range(args.requests):
            assert await post(app, "/" + name, body) == 200
        return (time.process_time() - t) / args.requests * 1e6

    async def run():
        for name, body in BODIES.items():
            await turn(name, body)  # warm
            for i in range(args.turns):
                for mode in (("once", "twice") if i % 2 == 0 else ("twice", "once")):
                    text_check.remember = remember if mode == "once" else (lambda scope, b, v: None)
                    res[name][mode].append(await turn(name, body))
        text_check.remember = remember

    asyncio.run(run())
    for name, r in res.items():
        once, twice = statistics.median(r["once"]), statistics.median(r["twice"])
        print(f"{name} ({len(BODIES[name])} bytes): once {once:.1f} us CPU/request, twice {twice:.1f} "
              f"(median of {args.turns}; once/twice {once / twice:.3f}; once lower in "
              f"{sum(a < b for a, b in zip(r['once'], r['twice']))}/{args.turns} turns)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_avg": os.getloadavg(), "requests": args.requests, "results": res,
                       "bytes": {k: len(v) for k, v in BODIES.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
