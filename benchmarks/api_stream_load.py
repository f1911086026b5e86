"""How many streamed events the API process carries: a real ``rlserve serve`` (FastAPI routes, SSE
chunks, the front's output processor and detokenizer, uvicorn) over a FAKE engine core that makes
a token for every running request each ``--step-ms`` (``benchmarks/api_stream_fake.py``: the
GPU's pace without a GPU), driven by ``--clients`` streaming HTTP clients in a closed loop
(``vllm bench serve --max-concurrency``'s shape: ``--num-prompts`` requests in all, each client
sends the next one when its stream ends).

The clients are raw asyncio sockets in a process of their own (no HTTP library: per event they
only timestamp a read and count its ``data:`` lines), so nearly all the CPU they take is the
kernel's. Per request: time to the first event (TTFT), the gaps between events (ITL, as ``vllm
bench serve`` computes it: an event that arrives in the same read as the one before has a gap of
0), events per request (``--max-tokens`` means one event per token: no merging). With
``ignore_eos`` every request makes exactly ``--max-tokens`` tokens, so output tok/s needs no
parsing.

Usage (CPU, from the repository root)::

    python benchmarks/api_stream_load.py --clients 256 --num-prompts 768 --step-ms 10 \\
        --configs "main=@tree=.base" "new=" --json out.json [--profile DIR]

``--configs NAME=FLAGS``: one server per entry, one after the other, ``FLAGS`` added to
``rlserve serve``'s (everything after ``--`` goes to every server); a flag ``@K=V`` sets the
environment variable ``K`` for that server instead, ``@tree=DIR`` runs the rlserve of checkout
``DIR`` (a baseline's ``git archive``; ``benchmarks/vllm_bench.py``'s ``tree_launcher``).
``--probe``: every full GC collection and every event-loop callback over ``--probe-slow-ms`` in
the server's processes during the run, summed per process (``benchmarks/api_stream_probe.py``).
``--profile DIR``: ``py-spy record`` (if on ``PATH`` or beside this Python) samples the server's
processes during the run and writes collapsed stacks (``DIR/<name>.txt``) and the top self-time
frames into the JSON. ``--strace DIR``: ``strace -c -f`` counts the API process's system calls (all its
threads, not the engine core's) during the run (``DIR/<name>.txt``), per event into the JSON (issue
37: one ``write`` / ``sendto`` per stream and event is the floor). Each run also reports the API process's CPU seconds per token and per event
(``/proc``), which the machine's load moves least (with ``--api-server-count N`` in a config's flags: the N
API processes' summed, and ``api_cpu_s_by_process``; the run starts once processes 1..N-1 serve); ``api_cpu_system_s`` is the kernel's part of it and
``window_unix_s`` the measured run's start and end (for per-process logs such as ``benchmarks/gc_time_site``'s;
``benchmarks/api_profile_layers.py`` sorts a ``--profile`` run's samples by layer).

Every number is wall-clock seconds (printed as ms) or events/tokens per second; on the shared
2-core machine they move with the load, so compare configs of one run only.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.serve_load import percentile  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FAKE = "benchmarks.api_stream_fake"  # imported by the engine-core process (PYTHONPATH: the repository)


class _Stream(asyncio.Protocol):
    """One streamed request on its own connection (``Connection: close``): read timestamps and
    how many ``data:`` events each read held."""

    def __init__(self, request: bytes, done: asyncio.Future):
        self.request, self.done = request, done
        self.reads: list[tuple[float, int]] = []
        self.t0 = 0.0
        self.status = None
        self.tail = b""
        self.head = b""
        self.errors = 0  # 'data: {"error": ...}' events (a stream that failed after its 200)

    def connection_made(self, transport):
        self.t0 = time.perf_counter()
        transport.write(self.request)

    def data_received(self, data: bytes):
        now = time.perf_counter()
        if self.status is None:
            self.head += data
            if b"\r\n" not in self.head:
                return
            self.status = int(self.head.split(b" ", 2)[1])
            data = self.head
        buf = self.tail + data
        n = buf.count(b"\ndata: ") + (1 if buf.startswith(b"data: ") else 0)
        n -= buf.count(b"data: [DONE]")
        self.errors += buf.count(b'data: {"error"')
        self.tail = buf[-8:]
        if n:
            self.reads.append((now, n))

    def connection_lost(self, exc):
        if not self.done.done():
            self.done.set_result(exc)


def _request_bytes(host: str, port: int, path: str, body: dict) -> bytes:
    raw = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nConnection: close\r\nContent-Length: {len(raw)}\r\n\r\n").encode() + raw


async def _drive(host: str, port: int, endpoint: str, model: str, clients: int, num_prompts: int, prompt_len: int,
                 max_tokens: int, vocab: tuple[int, int], seed: int) -> dict:
    import random

    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    todo = collections.deque(range(num_prompts))
    results = []

    def body(i: int) -> tuple[str, dict]:
        ids = [rng.randint(*vocab) for _ in range(prompt_len)]
        common = {"model": model, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0, "stream": True}
        if endpoint == "chat":
            return "/v1/chat/completions", dict(common, messages=[{"role": "user", "content": " ".join(
                str(t) for t in ids[: prompt_len // 2])}])
        return "/v1/completions", dict(common, prompt=ids)

    async def client():
        while todo:
            i = todo.popleft()
            path, b = body(i)
            done = loop.create_future()
            proto = _Stream(_request_bytes(host, port, path, b), done)
            await loop.create_connection(lambda: proto, host, port)
            await done
            results.append({"status": proto.status, "t0": proto.t0, "reads": proto.reads, "errors": proto.errors})

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return {"t0": t0, "t1": time.perf_counter(), "results": results}


def _client_main(args: tuple, queue) -> None:
    queue.put(asyncio.run(_drive(*args)))


def read_gaps(reads: list[tuple[float, int]]) -> list[float]:
    """The inter-event gaps (s) of one stream's reads ``(time, events)``, as ``vllm bench serve`` times them: an
    event that arrived in the read of the one before has a gap of 0."""
    gaps = [0.0] * (reads[0][1] - 1)
    prev = reads[0][0]
    for t, n in reads[1:]:
        gaps.append(t - prev)
        gaps.extend([0.0] * (n - 1))
        prev = t
    return gaps


def summarize(run: dict, max_tokens: int) -> dict:
    """Throughput and latency of one run (ms for times)."""
    res = run["results"]
    ok = [r for r in res if r["status"] == 200 and r["reads"] and not r.get("errors")]
    ttft, itl, events, worst = [], [], [], []
    for r in ok:
        reads = r["reads"]
        ttft.append(reads[0][0] - r["t0"])
        n_ev = sum(n for _, n in reads)
        events.append(n_ev)
        gaps = read_gaps(reads)
        itl.extend(gaps)
        worst.append(max(gaps) if gaps else 0.0)
    dur = run["t1"] - run["t0"]
    # per-second event counts over the run (vllm bench serve's "peak output tokens/s" counts events)
    buckets: collections.Counter = collections.Counter()
    for r in ok:
        for t, n in r["reads"]:
            buckets[int(t - run["t0"])] += n
    ms = lambda x: None if x is None else round(1e3 * x, 2)  # noqa: E731
    total_events = sum(events)
    return {
        "completed": len(ok), "failed": len(res) - len(ok), "duration_s": round(dur, 3),
        "output_tok_s": round(len(ok) * max_tokens / dur, 1), "events_s": round(total_events / dur, 1),
        "peak_events_per_s": max(buckets.values()) if buckets else 0,
        "tokens_per_event": round(len(ok) * max_tokens / total_events, 2) if total_events else None,
        "mean_ttft_ms": ms(sum(ttft) / len(ttft)) if ttft else None, "median_ttft_ms": ms(percentile(ttft, 50)),
        "p99_ttft_ms": ms(percentile(ttft, 99)), "median_itl_ms": ms(percentile(itl, 50)),
        "mean_itl_ms": ms(sum(itl) / len(itl)) if itl else None, "p99_itl_ms": ms(percentile(itl, 99)),
        "max_gap_ms_p50": ms(percentile(worst, 50)), "max_gap_ms_p99": ms(percentile(worst, 99)),
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, all its threads (``/proc``; 0 elsewhere)."""
    return sum(cpu_user_system(pid))


def cpu_user_system(pid: int) -> tuple[float, float]:
    """User and system (kernel: system calls, the loopback TCP path of a ``send``) CPU seconds of
    process ``pid`` so far, all its threads (``/proc/PID/stat``; zeros elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def api_pids(pid: int) -> list[int]:
    """The API processes of the server whose process 0 is ``pid``: ``pid`` and its children that run
    ``rlserve serve`` (``--api-server-count N``: processes 1..N-1; not the engine cores, not the
    chat-template workers), from ``/proc``."""
    from rlserve.proc_state import child_processes

    return [pid] + [p for p, argv in child_processes(pid)
                    if b"serve" in argv and b"rlserve.engine.core.core_proc" not in argv]


def _wait_api_servers(srv, flags: list[str], timeout_s: float = 600.0) -> None:
    """With ``--api-server-count N``: until processes 1..N-1 say they serve (their log lines)."""
    n = int(flags[flags.index("--api-server-count") + 1]) if "--api-server-count" in flags else 1
    end = time.monotonic() + timeout_s
    while sum(f"API server {i} of {n}: serving" in srv.log_tail(10_000_000) for i in range(1, n)) < n - 1:
        if time.monotonic() > end or srv.proc.poll() is not None:
            raise RuntimeError(f"API servers 1..{n - 1} did not start: {srv.log_tail(3000)}")
        time.sleep(0.2)


def _py_spy() -> str | None:
    exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    return exe if os.path.exists(exe) else None


def top_self(collapsed: str, n: int = 25) -> list[tuple[str, float]]:
    """Top ``n`` frames by self samples (share of all samples) from py-spy's collapsed stacks."""
    counts: collections.Counter = collections.Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, k = line.rpartition(" ")
        if not stack or not k.isdigit():
            continue
        total += int(k)
        counts[stack.split(";")[-1]] += int(k)
    return [(f, round(c / total, 4)) for f, c in counts.most_common(n)] if total else []


def strace_counts(summary: str) -> dict[str, int]:
    """Calls per system call from ``strace -c``'s table (``% time  seconds  usecs/call  calls  [errors]
    syscall`` rows; the ``total`` row left out)."""
    counts = {}
    for line in summary.splitlines():
        cols = line.split()
        if len(cols) in (5, 6) and cols[-1] != "total" and cols[3].isdigit():
            counts[cols[-1]] = int(cols[3])
    return counts


def run_config(name: str, flags: list[str], args, model: str) -> dict:
    from benchmarks.vllm_bench import tree_launcher
    from rlserve.server.testing import ServerProcess

    env = {"RLSERVE_ENGINE_CORE_INIT": f"{FAKE}:install", "API_STREAM_FAKE_STEP_MS": str(args.step_ms),
           "API_STREAM_FAKE_PREFILL_TOKENS": str(args.prefill_tokens), "API_STREAM_FAKE_MAX_SEQS": str(args.clients),
           "API_STREAM_FAKE_TOKEN_LO": str(args.output_tokens[0] if args.output_tokens else 3),
           "API_STREAM_FAKE_TOKEN_HI": str(args.output_tokens[1] if args.output_tokens else args.token_hi),
           "PYTHONPATH": os.pathsep.join(p for p in (os.path.dirname(HERE), os.environ.get("PYTHONPATH")) if p)}
    env.update(kv.split("=", 1) for kv in args.env)
    env.update(f[1:].split("=", 1) for f in flags if f.startswith("@"))  # a config's own environment
    flags = [f for f in flags if not f.startswith("@")]
    probe_dir = None
    if args.probe:  # stall probe (benchmarks/api_stream_probe.py) in the server's processes
        from benchmarks import api_stream_probe

        probe_dir = tempfile.mkdtemp(prefix=f"api-stream-probe-{name}-")
        env["PYTHONPATH"] = os.pathsep.join((api_stream_probe.site_dir(probe_dir), env["PYTHONPATH"]))
        env[api_stream_probe.ENV_DIR] = probe_dir
        env[api_stream_probe.ENV_SLOW_MS] = str(args.probe_slow_ms)
        env.setdefault("RLSERVE_HTTP_IMPL", "h11")  # the probe times the stdlib loop's callbacks (not uvloop's)
    tree = env.pop("tree", None)  # another checkout's rlserve; its engine core imports the fake from here
    srv = ServerProcess(model, "--max-num-seqs", str(args.clients), "--max-model-len", str(args.max_model_len),
                        "--disable-access-log", *flags, env=env, launcher=tree_launcher(tree))
    srv.start()
    spy = trace = None
    try:
        _wait_api_servers(srv, flags)
        api = api_pids(srv.pid)
        host, port = srv.url.removeprefix("http://").rsplit(":", 1)
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        # warm-up: a few requests so the first real ones do not pay imports
        wp = ctx.Process(target=_client_main, args=((host, int(port), args.endpoint, model, 4, 8, 32, 8,
                                                      (3, args.token_hi), 1), queue))
        wp.start()
        queue.get(timeout=120)
        wp.join()
        if args.profile:
            exe = _py_spy()
            os.makedirs(args.profile, exist_ok=True)
            if exe is None:
                print("api_stream_load: py-spy not found; no profile", file=sys.stderr)
            else:
                spy = subprocess.Popen([exe, "record", "--pid", str(srv.pid), "--subprocesses", "--threads",
                                        "--rate", "200", "--format", "raw", "--nonblocking",
                                        "-o", os.path.join(args.profile, f"{name}.txt")],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if args.strace:
            os.makedirs(args.strace, exist_ok=True)
            trace = subprocess.Popen(["strace", "-c", "-f", "-p", str(srv.pid), "-o",
                                      os.path.join(args.strace, f"{name}.txt")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # attached to every thread before the clients start
        cp = ctx.Process(target=_client_main, args=((host, int(port), args.endpoint, model, args.clients,
                                                      args.num_prompts, args.prompt_len, args.max_tokens,
                                                      (3, args.token_hi), args.seed), queue))
        before, wall0 = [cpu_user_system(p) for p in api], time.time()
        cp.start()
        run = queue.get(timeout=args.timeout)
        after, wall1 = [cpu_user_system(p) for p in api], time.time()
        per = [(u1 - u0, s1 - s0) for (u0, s0), (u1, s1) in zip(before, after)]
        cpu, cpu_sys = sum(u + k for u, k in per), sum(k for _, k in per)
        cp.join()
    finally:
        for tool in (spy, trace):
            if tool is None:
                continue
            tool.send_signal(2)
            try:
                tool.wait(30)
            except subprocess.TimeoutExpired:
                tool.kill()
        srv.stop()
        print(f"{name}: server log {srv.log_path}", file=sys.stderr)
    out = {"config": name, "flags": flags, **summarize(run, args.max_tokens)}
    # the API process's CPU per event and per token: what the load on the machine moves least
    out["api_cpu_s"] = round(cpu, 2)  # every API process (--api-server-count), summed
    out["api_cpu_s_by_process"] = [round(u + k, 2) for u, k in per]  # process 0, 1, ...
    out["api_cpu_system_s"] = round(cpu_sys, 2)  # of api_cpu_s: in the kernel (clock ticks: +-0.01 s)
    out["window_unix_s"] = [round(wall0, 3), round(wall1, 3)]  # the measured run (for per-process logs' lines)
    out["api_cpu_us_per_token"] = round(1e6 * cpu / (out["completed"] * args.max_tokens), 1) if out["completed"] else None
    out["api_cpu_us_per_event"] = round(1e6 * cpu / (out["events_s"] * out["duration_s"]), 1) if out["events_s"] else None
    if probe_dir is not None:
        from benchmarks.api_stream_probe import summarize as probe_summary

        out["probe"] = probe_summary(probe_dir, wall0, wall1)
        shutil.rmtree(probe_dir, ignore_errors=True)
    events = out["events_s"] * out["duration_s"]
    if trace is not None and os.path.exists(os.path.join(args.strace, f"{name}.txt")) and events:
        with open(os.path.join(args.strace, f"{name}.txt")) as f:
            counts = strace_counts(f.read())
        out["syscalls_per_event"] = round(sum(counts.values()) / events, 2)
        out["syscalls_per_event_by_name"] = {k: round(v / events, 3) for k, v in
                                             sorted(counts.items(), key=lambda kv: -kv[1])[:12]}
    if spy is not None and os.path.exists(os.path.join(args.profile, f"{name}.txt")):
        with open(os.path.join(args.profile, f"{name}.txt")) as f:
            out["top_self"] = top_self(f.read())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=768)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--step-ms", type=float, default=10.0, help="the fake engine's step period")
    ap.add_argument("--prefill-tokens", type=int, default=16384, help="prompt tokens the fake admits per step")
    ap.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--token-hi", type=int, default=300, help="largest token id drawn (prompts and outputs)")
    ap.add_argument("--output-tokens", type=int, nargs=2, metavar=("LO", "HI"),
                    help="the fake engine's output ids (default 3 .. --token-hi); e.g. 1000 151000: ids the tiny "
                         "tokenizer does not know, as a dummy-weight Qwen3 makes them (no text)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--model", help="a model directory (default: the tests' tiny Qwen3)")
    ap.add_argument("--configs", nargs="+", default=["default="], help="NAME=FLAGS, one server each")
    ap.add_argument("--profile", help="directory for py-spy's collapsed stacks")
    ap.add_argument("--strace", help="directory for strace -c's counts of the API process's system calls")
    ap.add_argument("--probe", action="store_true",
                    help="record full GC collections and event-loop callbacks over --probe-slow-ms in the "
                         "server's processes during the run (benchmarks/api_stream_probe.py)")
    ap.add_argument("--probe-slow-ms", type=float, default=20.0)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--env", nargs="*", default=[], help="K=V set for the server (and its engine core)")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    args = ap.parse_args(argv)
    model = args.model
    if model is None:
        from tests.tiny_models import make_tiny_model

        model = make_tiny_model("qwen3", os.path.join(tempfile.gettempdir(), "rlserve_api_stream_tiny"),
                                max_position_embeddings=4096)
    rows = []
    for spec in args.configs:
        name, _, flags = spec.partition("=")
        rows.append(run_config(name, flags.split() + extra, args, model))
        r = rows[-1]
        print(f"{name}: {r['completed']} ok / {r['failed']} failed, {r['output_tok_s']} tok/s, "
              f"{r['events_s']} events/s (peak {r['peak_events_per_s']}/s, {r['tokens_per_event']} tok/event), "
              f"TTFT mean/p99 {r['mean_ttft_ms']}/{r['p99_ttft_ms']} ms, ITL median/p99 "
              f"{r['median_itl_ms']}/{r['p99_itl_ms']} ms, worst gap per request p50/p99 "
              f"{r['max_gap_ms_p50']}/{r['max_gap_ms_p99']} ms; API process CPU {r['api_cpu_s']} s "
              f"(by process {r['api_cpu_s_by_process']}) = "
              f"{r['api_cpu_us_per_token']} us/token, {r['api_cpu_us_per_event']} us/event", flush=True)
        if "syscalls_per_event" in r:
            print(f"    system calls per event {r['syscalls_per_event']}: {r['syscalls_per_event_by_name']}", flush=True)
        for label, p in sorted(r.get("probe", {}).items()):
            g, sl = p["gc2"], p["slow"]
            print(f"    probe {label}: {g['n']} full GCs ({g['total_ms']} ms, max {g['max_ms']}); {sl['n']} callbacks "
                  f"over {args.probe_slow_ms} ms ({sl['total_ms']} ms, max {sl['max_ms']}): "
                  + ", ".join(f"{n} x{k} {t} ms" for n, k, t, _ in sl.get("top", [])))
        for f, share in r.get("top_self", [])[:15]:
            print(f"    {share:7.2%}  {f}")
    if args.json:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "host": platform.node(),
                "loadavg": os.getloadavg(), "argv": sys.argv[1:], "cpus": os.cpu_count()}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "runs": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
