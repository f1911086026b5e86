"""What admitting one request costs the API process (issue 37, s23): ``rlserve serve`` over the fake
engine core (``benchmarks/api_stream_fake.py``: no model runs) answers ``--requests`` requests of
``max_tokens: 1`` per batch, and the API process's CPU over the batch (``/proc/PID/stat``, user +
system, all its threads) is divided by the requests. With one output token a request is almost all
admission: the HTTP request and its body, JSON, validation, the tokenization call, the engine
request, plus the answer's two or three SSE events.

Request kinds (``--kinds``), the bodies ``vllm bench serve`` sends (``stream``, ``stream_options:
{include_usage}``, ``ignore_eos``, ``repetition_penalty``):

* ``ids``: ``/v1/completions`` with ``--prompt-len`` random token ids (TRL's and ``vllm bench serve
  --tokenize``'s form);
* ``text``: ``/v1/completions`` with the text of ``--prompt-len`` random ordinary ids of the tiny
  tokenizer, decoded (``vllm bench serve``'s random dataset), tokenized by the server;
* ``chat``: ``/v1/chat/completions`` with that text as one user message (a ``text`` content part,
  as ``vllm bench serve``'s ``openai-chat`` sends it). The template renders in a worker process,
  which the API process's figure does not count;
* ``trl`` (not in the default ``--kinds``): ``/v1/completions`` with ``--trl-batch`` prompts of
  ``--prompt-len`` ids in one request, not streamed, with the fields TRL's ``VLLMClient.generate``
  sends (``return_token_ids``, ``return_tokens_as_token_ids``, its sampling defaults): per request
  means per batch.

The clients are ``--connections`` keep-alive HTTP/1.1 connections (raw asyncio streams, one request
at a time each), as aiohttp's pool in ``vllm bench serve``. Servers of ``--configs NAME=FLAGS``
(``@tree=DIR``: the rlserve of checkout ``DIR``, e.g. main's ``git worktree``) all run for the whole
benchmark, and their batches alternate: round by round, kind by kind, config by config, so the
machine's load moves each config alike.

``--callgrind``: each server's API process runs under ``valgrind --tool=callgrind
--instr-atstart=no --separate-threads=yes`` and is instrumented only during its batches
(``callgrind_control -i on|off``, then a dump): instructions per request, which the load of a shared
machine does not move, of all the process's threads (the tokenizer threads' encoding of a text prompt
included; the engine core and the template workers are other processes) and of its main thread, the
event loop (what a wave of new requests holds up the streams with). Under valgrind a request takes
~100x longer, so more of them share each fake engine step than without it. ``--profile
DIR``: ``py-spy record`` of each server's API process over each batch (collapsed stacks, a file
per batch); ``--cprofile DIR``: cProfile of the event loop's thread over each batch
(``benchmarks/admission_cprofile_site``: ``DIR/NAME.<batch>.pstats``, batches numbered per config in
the order they ran; the rows of the JSON say which).

Usage (from the repository root; main's tree for the baseline)::

    git worktree add /tmp/main-tree main
    python benchmarks/api_admission.py --requests 200 --rounds 3 --configs main=@tree=/tmp/main-tree new= \\
        --json benchmarks/results/api-admission-cpu-DATE.json [--callgrind]
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.api_stream_load import FAKE, HERE, cpu_user_system  # noqa: E402

KINDS = ("ids", "text", "chat", "trl")
CPROFILE_SITE = os.path.join(HERE, "admission_cprofile_site")


def request_bodies(kind: str, n: int, prompt_len: int, tokenizer, seed: int, model: str,
                   trl_batch: int = 64) -> list[tuple[str, bytes]]:
    """``n`` requests of ``kind`` as ``(path, JSON body)``: ``vllm bench serve``'s fields (TRL's for
    ``trl``), ``max_tokens`` 1, each prompt ``prompt_len`` random ids in 3 .. 299 (the tiny
    tokenizer's ordinary tokens) or their text."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randrange(3, 300) for _ in range(prompt_len)]
        if kind == "trl":
            batch = [ids] + [[rng.randrange(3, 300) for _ in range(prompt_len)] for _ in range(trl_batch - 1)]
            body = {"model": model, "prompt": batch, "return_token_ids": True, "return_tokens_as_token_ids": True,
                    "n": 1, "repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                    "max_tokens": 1, "logprobs": 0}
            out.append(("/v1/completions", json.dumps(body).encode()))
            continue
        common = {"model": model, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
        if kind == "chat":
            body = dict(common, messages=[{"role": "user", "content": [{"type": "text", "text": tokenizer.decode(ids)}]}],
                        max_completion_tokens=1)
            out.append(("/v1/chat/completions", json.dumps(body).encode()))
            continue
        prompt = ids if kind == "ids" else tokenizer.decode(ids)
        body = dict(common, prompt=prompt, repetition_penalty=1.0, max_tokens=1, logprobs=None)
        out.append(("/v1/completions", json.dumps(body).encode()))
    return out


async def _read_answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One HTTP/1.1 answer: ``(status, body)`` (a chunked body is returned with its framing)."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    low = head.lower()
    if b"transfer-encoding: chunked" in low:
        body = await reader.readuntil(b"\r\n0\r\n\r\n")
    else:
        length = int(low.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        body = await reader.readexactly(length)
    return status, body


async def drive(host: str, port: int, bodies: list[tuple[str, bytes]], connections: int) -> dict:
    """Send ``bodies`` over ``connections`` keep-alive connections (each one request at a time);
    returns ``{"ok", "failed", "wall_s", "first_error"}`` (an answer is ok when it is a 200 that
    carries no in-band error event)."""
    todo = list(reversed(bodies))
    tally = {"ok": 0, "failed": 0, "first_error": None}

    async def conn():
        reader, writer = await asyncio.open_connection(host, port)
        try:
            while todo:
                path, raw = todo.pop()
                writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
                status, body = await _read_answer(reader)
                if status == 200 and b'data: {"error"' not in body:
                    tally["ok"] += 1
                else:
                    tally["failed"] += 1
                    tally["first_error"] = tally["first_error"] or f"{status}: {body[:300]!r}"
        finally:
            writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(conn() for _ in range(connections)))
    return dict(tally, wall_s=time.perf_counter() - t0)


#: ``label: (file, function)`` (regular expressions: the end of the file's path, the whole function
#: name, ``:LINE`` to pick one): cProfile's cumulative CPU time of the function (the largest entry) per request; the layers nest (the handler holds the body, the dependencies and
#: the endpoint), so they do not add up
LAYERS = {
    "event loop, all (profiled)": None,
    "uvicorn: parse the request": ("httptools_impl.py", "data_received"),
    "route matching": ("fastapi/routing.py", "_match"),
    # FastAPI 0.165's get_request_handler.<locals>.app (line 438 of fastapi/routing.py)
    "request handler (FastAPI: body, dependencies, endpoint)": ("fastapi/routing.py", "app:438"),
    "  body JSON": ("starlette/requests.py|server/request_body.py", "json"),
    "  dependencies (body validation included)": ("dependencies/utils.py", "solve_dependencies"),
    "    body validation": ("dependencies/utils.py", "request_body_to_args"),
    "  endpoint": ("server/openai_routes.py", "completions|chat_completions"),
    "streamed answer (Starlette StreamingResponse)": ("starlette/responses.py", "wrap"),
    "  ServerState.generate (engine request, metrics)": ("server/state.py", "generate"),
    "    metrics": ("server/metrics.py", "record_request"),
    "engine outputs (core client, output processor)": ("core_client.py", "_handle_pending"),
}


def cprofile_layers(path: str, requests: int) -> dict:
    """Profiled microseconds per request of each of :data:`LAYERS` in one batch's stats."""
    import pstats
    import re

    stats = pstats.Stats(path).stats  # {(file, line, func): (cc, nc, tt, ct, callers)}
    out = {}
    for label, rule in LAYERS.items():
        if rule is None:
            out[label] = round(1e6 * sum(v[2] for v in stats.values()) / requests, 1)
            continue
        where, func = rule
        name, _, line = func.partition(":")
        cts = [v[3] for (f, ln, fn), v in stats.items()
               if re.search(f"({where})$", f) and re.fullmatch(name, fn) and (not line or ln == int(line))]
        out[label] = round(1e6 * max(cts, default=0.0) / requests, 1)
    return out


class _Server:
    """One config's ``rlserve serve`` over the fake core (optionally under callgrind / py-spy)."""

    def __init__(self, name: str, flags: list[str], args, model: str, outdir: str):
        from benchmarks.vllm_bench import tree_launcher
        from rlserve.server.testing import ServerProcess

        env = {"RLSERVE_ENGINE_CORE_INIT": f"{FAKE}:install", "API_STREAM_FAKE_STEP_MS": str(args.step_ms),
               "API_STREAM_FAKE_MAX_SEQS": "256",
               "PYTHONPATH": os.pathsep.join(p for p in (os.path.dirname(HERE), os.environ.get("PYTHONPATH")) if p)}
        env.update(f[1:].split("=", 1) for f in flags if f.startswith("@"))
        flags = [f for f in flags if not f.startswith("@")]
        tree = env.pop("tree", None)
        if args.cprofile:
            env["PYTHONPATH"] = os.pathsep.join((CPROFILE_SITE, env["PYTHONPATH"]))
            env["ADMISSION_CPROFILE_OUT"] = os.path.join(args.cprofile, name)  # NAME.<batch>.pstats
        self.name, self.outdir, self.cg_files, self.batches = name, outdir, 0, 0
        valgrind = (["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes",
                     f"--callgrind-out-file={outdir}/cg-{name}.%p"] if args.callgrind else [])

        class Proc(ServerProcess):
            def start(self):
                self._spawn_and_wait([*valgrind, sys.executable, *self.launcher, "serve", self.model, "--port", "0",
                                      *self.args], self._ready_url, "rlserve serve")
                return self

        self.srv = Proc(model, "--max-num-seqs", "256", "--max-model-len", str(args.max_model_len),
                        "--disable-access-log", *flags, env=env, launcher=tree_launcher(tree),
                        startup_timeout_s=900 if args.callgrind else 180)
        self.callgrind = args.callgrind
        self.spy = None
        self.profile = args.profile

    def start(self) -> "_Server":
        self.srv.start()
        self.host, port = self.srv.url.removeprefix("http://").rsplit(":", 1)
        self.port = int(port)
        return self

    def _cg(self, *cmd: str) -> None:
        subprocess.run(["callgrind_control", *cmd, str(self.srv.pid)], check=True, capture_output=True, timeout=120)

    def measure(self, bodies, connections: int) -> dict:
        """One batch: its answers' tally, the API process's CPU seconds (and instructions under callgrind)."""
        if self.callgrind:
            self._cg("-i", "on")
        if self.profile:
            from benchmarks.api_stream_load import _py_spy

            self.spy = subprocess.Popen([_py_spy(), "record", "--pid", str(self.srv.pid), "--threads", "--rate", "250",
                                         "--format", "raw", "--nonblocking",
                                         "-o", os.path.join(self.profile, f"{self.name}-{time.monotonic_ns()}.txt")],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.5)
        if self.srv.env.get("ADMISSION_CPROFILE_OUT"):
            os.kill(self.srv.pid, 10)  # SIGUSR1: start profiling
        usr0, sys0 = cpu_user_system(self.srv.pid)
        run = asyncio.run(drive(self.host, self.port, bodies, connections))
        usr1, sys1 = cpu_user_system(self.srv.pid)
        if self.srv.env.get("ADMISSION_CPROFILE_OUT"):
            os.kill(self.srv.pid, 12)  # SIGUSR2: stop, write this batch's stats
            path = f"{self.srv.env['ADMISSION_CPROFILE_OUT']}.{self.batches}.pstats"
            self.batches += 1
            for _ in range(100):
                if os.path.exists(path):
                    break
                time.sleep(0.1)
            time.sleep(0.5)  # written whole
        if self.spy is not None:
            self.spy.send_signal(2)
            self.spy.wait(30)
            self.spy = None
        out = dict(run, cpu_s=usr1 + sys1 - usr0 - sys0, cpu_system_s=sys1 - sys0)
        if self.srv.env.get("ADMISSION_CPROFILE_OUT"):
            out["cprofile_us_per_request"] = cprofile_layers(path, len(bodies))
        if self.callgrind:
            self._cg("-i", "off")
            self._cg("-d")
            out["instructions"], out["instructions_event_loop"] = self._last_dump_instructions()
        return out

    def _last_dump_instructions(self) -> tuple[int, int]:
        """Ir of the newest dump, all threads and the main thread's (the event loop): with
        ``--separate-threads=yes`` callgrind writes ``<out-file>.<n>-<thread>`` per dump and thread."""
        prefix = os.path.join(self.outdir, f"cg-{self.name}.{self.srv.pid}.")
        for _ in range(300):
            dumps = {int(p[len(prefix):].split("-")[0]) for p in glob.glob(prefix + "*-*")}
            if dumps and max(dumps) > self.cg_files:
                break
            time.sleep(0.2)
        self.cg_files = n = max(dumps)
        time.sleep(1.0)  # every thread's file of the dump written
        total = main = 0
        for path in glob.glob(f"{prefix}{n}-*"):
            with open(path) as f:
                ir = next(int(line.split()[1]) for line in f if line.startswith("totals:"))
            total += ir
            main += ir if path.endswith("-01") else 0
        return total, main

    def stop(self) -> None:
        self.srv.stop()
        print(f"{self.name}: server log {self.srv.log_path}", file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200, help="requests per batch (one kind, one config)")
    ap.add_argument("--warmup", type=int, default=20, help="requests of each kind before the first batch")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=["ids", "text", "chat"])
    ap.add_argument("--trl-batch", type=int, default=64, help="prompts per request of the trl kind")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--step-ms", type=float, default=10.0, help="the fake engine's step period")
    ap.add_argument("--configs", nargs="+", default=["default="], help="NAME=FLAGS, one server each")
    ap.add_argument("--callgrind", action="store_true", help="instructions per request (API process under valgrind)")
    ap.add_argument("--profile", help="directory for py-spy's collapsed stacks of each batch")
    ap.add_argument("--cprofile", help="directory for cProfile stats of each batch (NAME.<batch>.pstats)")
    ap.add_argument("--model", help="a model directory (default: the tests' tiny Qwen3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    for d in (args.profile, args.cprofile):
        if d:
            os.makedirs(d, exist_ok=True)
    model = args.model
    if model is None:
        from tests.tiny_models import make_tiny_model

        model = make_tiny_model("qwen3", os.path.join(tempfile.gettempdir(), "rlserve_api_stream_tiny"),
                                max_position_embeddings=4096)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    outdir = tempfile.mkdtemp(prefix="api-admission-")
    servers = []
    rows = []
    try:
        for spec in args.configs:
            name, _, flags = spec.partition("=")
            servers.append(_Server(name, flags.split(), args, model, outdir).start())
        served = model  # the served name: the path given
        warm = {k: request_bodies(k, args.warmup, args.prompt_len, tokenizer, args.seed + 1, served, args.trl_batch)
                for k in args.kinds}
        for s in servers:
            for k in args.kinds:
                asyncio.run(drive(s.host, s.port, warm[k], min(args.connections, args.warmup)))
        for r in range(args.rounds):
            for k in args.kinds:
                bodies = request_bodies(k, args.requests, args.prompt_len, tokenizer, args.seed + 100 * r, served,
                                        args.trl_batch)
                for s in servers:
                    m = s.measure(bodies, args.connections)
                    row = {"round": r, "kind": k, "config": s.name, "requests": args.requests, **m,
                           "cpu_us_per_request": round(1e6 * m["cpu_s"] / args.requests, 1),
                           "loadavg": os.getloadavg()[0]}
                    if "instructions" in m:
                        row["instructions_per_request"] = round(m["instructions"] / args.requests)
                        row["event_loop_instructions_per_request"] = round(m["instructions_event_loop"] / args.requests)
                    rows.append(row)
                    print(f"round {r} {k:5s} {s.name:8s}: {m['ok']} ok / {m['failed']} failed, API CPU "
                          f"{row['cpu_us_per_request']} us/request (system {1e6 * m['cpu_system_s'] / args.requests:.0f})"
                          + (f", {row['instructions_per_request']:,} instructions/request (event loop "
                             f"{row['event_loop_instructions_per_request']:,})" if "instructions" in m else "")
                          + f", {args.requests / m['wall_s']:.0f} requests/s, load {row['loadavg']:.2f}"
                          + (f"; first error {m['first_error']}" if m["first_error"] else ""), flush=True)
                    for label, us in m.get("cprofile_us_per_request", {}).items():
                        print(f"    {us:9.1f} us  {label}")
    finally:
        for s in servers:
            s.stop()
    if args.json:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "host": platform.node(),
                "cpu": platform.processor(), "loadavg": os.getloadavg(), "argv": sys.argv[1:] if argv is None else argv,
                "cpus": os.cpu_count()}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
