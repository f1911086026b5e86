"""HTTP load test: N concurrent clients for a fixed time against an rlserve server.

Each client sends ``/v1/completions`` requests back to back (random token-id prompts of
``--prompt-len`` tokens, exactly ``--max-tokens`` output tokens via ``ignore_eos``) until
the time is up; requests still running at the deadline are awaited and counted. Reports
requests/s, output tokens/s, and latency percentiles (end-to-end; with ``--stream`` also
time to first token and inter-token latency).

Usage:
    python benchmarks/serve_load.py --url http://127.0.0.1:8000            # a running server
    python benchmarks/serve_load.py --model /path/to/model -- --dtype bfloat16   # start one (loopback)
    python benchmarks/serve_load.py --tiny                                 # tiny random model (smoke test)
    python benchmarks/serve_load.py --shape smollm2-135m -- --max-model-len 2048   # real shape, random weights
    python benchmarks/serve_load.py --tiny --concurrency 1 4 16 --duration 10 --json out.json

Everything after ``--`` is passed to ``rlserve serve`` when this script starts the server.
Units: seconds for times (printed in ms), tokens/s for throughput.

``--workload throughput`` runs ``benchmarks/throughput.py``'s offline workload through HTTP
instead (``--num-seqs`` requests with random prompt and output lengths in ``[--min-len,
--max-len]``, random token ids, temperature 0.6, ``ignore_eos``; all sent at once as
``/v1/completions`` with token-id prompts) and reports output tokens/s. ``--offline`` also runs
``throughput.py --engine rlserve`` on the same workload first (its own process, so the GPU is
free again), and each row gives HTTP / offline. ``--configs NAME=FLAGS ...`` starts one server
per entry, one after the other, with ``FLAGS`` added to the ``--`` ones: DP=2 against DP=1 on
one GPU, or the engine-core process against ``--engine-mode thread``, in one command::

    python benchmarks/serve_load.py --shape smollm2-135m --workload throughput --offline \
        --configs "dp1=" "dp2=--data-parallel-size 2 --device-ids 0,0" "dp1-thread=--engine-mode thread" \
        -- --dtype bfloat16 --num-kv-blocks 34000

A config whose flags start with the word ``vllm`` starts ``vllm serve`` instead, on the same
model directory (dummy weights, the same tokenizer), with the same ``--max-model-len``,
``--max-num-seqs`` and ``--seed`` and the rest of its flags (the ones after ``--`` are
rlserve's and are not passed); vLLM runs with ``PYTHONPATH=--vllm-pythonpath`` only
(``benchmarks/vllm_serve.py``)::

    ... --configs "dp1=" "vllm=vllm --dtype bfloat16 --attention-backend FLASH_ATTN" -- --dtype bfloat16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def percentile(xs: list[float], p: float) -> float | None:
    """Nearest-rank-interpolated percentile (p in [0, 100]); None for no data."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100.0
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def _one_request(client: httpx.AsyncClient, body: dict, stream: bool) -> dict:
    t0 = time.perf_counter()
    if not stream:
        r = await client.post("/v1/completions", json=body)
        if r.status_code != 200:
            return {"ok": False, "status": r.status_code, "error": r.text[:200]}
        d = r.json()
        return {"ok": True, "latency": time.perf_counter() - t0, "tokens": d["usage"]["completion_tokens"]}
    ttft = None
    times = []
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=dict(body, stream=True, return_token_ids=True,
                                                                   stream_options={"include_usage": True})) as r:
        if r.status_code != 200:
            return {"ok": False, "status": r.status_code, "error": (await r.aread())[:200].decode(errors="replace")}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                return {"ok": False, "status": 200, "error": str(obj["error"])[:200]}
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
            new = sum(len(c.get("token_ids") or []) for c in obj.get("choices", []))
            if new:
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - t0
                times.append(now)
    lat = time.perf_counter() - t0
    itl = [(b - a) for a, b in zip(times, times[1:])]
    return {"ok": True, "latency": lat, "tokens": tokens, "ttft": ttft, "itl": itl}


async def _drive(url: str, worker_ids: list[int], start_at: float, duration_s: float, prompt_len: int,
                 max_tokens: int, vocab: int, stream: bool, api_key: str | None, seed: int,
                 model: str | None) -> list[dict]:
    """Run clients ``worker_ids`` (one request at a time each) from wall-clock ``start_at``
    for ``duration_s`` seconds; returns one result dict per request (``end``: wall time)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    n = len(worker_ids)
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    results: list[dict] = []
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as client:
        while time.time() < start_at:
            await asyncio.sleep(0.001)
        deadline = start_at + duration_s

        async def worker(i: int):
            wrng = random.Random(seed * 100_003 + i)
            while time.time() < deadline:
                body = {"prompt": [wrng.randrange(3, vocab) for _ in range(prompt_len)], "max_tokens": max_tokens,
                        "temperature": 1.0, "ignore_eos": True}
                if model:
                    body["model"] = model
                r = await _one_request(client, body, stream)
                r["end"] = time.time()
                results.append(r)

        await asyncio.gather(*(worker(i) for i in worker_ids))
    return results


def _client_process(args: tuple, queue) -> None:
    try:
        queue.put(asyncio.run(_drive(*args)))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        queue.put([{"ok": False, "status": None, "error": f"client process failed: {e!r}", "end": time.time()}])


def run_load(url: str, concurrency: int, duration_s: float, prompt_len: int, max_tokens: int,
             vocab: int, stream: bool, api_key: str | None, seed: int = 0, model: str | None = None,
             procs: int = 1) -> dict:
    """Run ``concurrency`` clients for ``duration_s`` seconds, spread over ``procs`` client
    processes (one Python process tops out at a few thousand HTTP responses or SSE chunks
    per second: use several for high concurrency). Returns the summary dict.

    Raises:
        RuntimeError: a client process did not report within ``duration_s + 600`` seconds.
    """
    rng = random.Random(seed)
    warm = {"prompt": [rng.randrange(3, vocab) for _ in range(prompt_len)], "max_tokens": 2, "temperature": 0,
            "ignore_eos": True}
    if model:
        warm["model"] = model
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    httpx.post(url + "/v1/completions", json=warm, headers=headers, timeout=600)  # first-call overheads
    procs = max(1, min(procs, concurrency))
    groups = [list(range(p, concurrency, procs)) for p in range(procs)]
    start_at = time.time() + (0.05 if procs == 1 else 3.0)  # let spawned processes import first
    common = (start_at, duration_s, prompt_len, max_tokens, vocab, stream, api_key, seed, model)
    if procs == 1:
        results = asyncio.run(_drive(url, groups[0], *common))
    else:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        ps = [ctx.Process(target=_client_process, args=((url, g, *common), queue), daemon=True) for g in groups]
        for p in ps:
            p.start()
        results = []
        try:
            for _ in ps:
                results += queue.get(timeout=duration_s + 600)
        except Exception as e:  # queue.Empty
            raise RuntimeError(f"a client process did not report: {e!r}") from None
        finally:
            for p in ps:
                p.join(10)
                if p.is_alive():
                    p.kill()
    elapsed = max([r["end"] for r in results] + [start_at + 1e-9]) - start_at
    ok = [r for r in results if r["ok"]]
    lat = [r["latency"] for r in ok]
    out = {
        "concurrency": concurrency, "client_procs": procs, "duration_s": round(elapsed, 3), "prompt_len": prompt_len,
        "max_tokens": max_tokens, "stream": stream, "requests": len(ok), "errors": len(results) - len(ok),
        "requests_per_s": len(ok) / elapsed, "output_tokens_per_s": sum(r["tokens"] for r in ok) / elapsed,
        "latency_p50_s": percentile(lat, 50), "latency_p99_s": percentile(lat, 99), "latency_mean_s":
            (sum(lat) / len(lat)) if lat else None,
    }
    if stream:
        ttft = [r["ttft"] for r in ok if r.get("ttft") is not None]
        itl = [x for r in ok for x in r.get("itl", [])]
        out.update(ttft_mean_s=sum(ttft) / len(ttft) if ttft else None,
                   ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
                   itl_p50_s=percentile(itl, 50), itl_p99_s=percentile(itl, 99))
    if out["errors"]:
        out["first_error"] = next(r for r in results if not r["ok"])
    return out


def run_burst(url: str, prompts: list[list[int]], out_lens: list[int], api_key: str | None = None,
              model: str | None = None) -> dict:
    """Send every prompt at once (one ``/v1/completions`` each: token ids, ``max_tokens`` its
    output length, temperature 0.6, ``ignore_eos``) and time until the last answer.

    Returns:
        ``{"seconds", "output_tokens", "tokens_per_s", "requests"}``.
    Raises:
        RuntimeError: a request failed or returned another token count.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def body(p, n):
        b = {"prompt": p, "max_tokens": n, "temperature": 0.6, "ignore_eos": True}
        return dict(b, model=model) if model else b

    async def main():
        limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
        async with httpx.AsyncClient(base_url=url, timeout=7200, limits=limits, headers=headers) as client:
            await asyncio.gather(*[client.post("/v1/completions", json=body(p, 4)) for p in prompts[:2]])  # warm-up
            t0 = time.perf_counter()
            rs = await asyncio.gather(*[client.post("/v1/completions", json=body(p, n))
                                        for p, n in zip(prompts, out_lens)])
            return rs, time.perf_counter() - t0

    rs, dt = asyncio.run(main())
    total = 0
    for r, n in zip(rs, out_lens):
        if r.status_code != 200:
            raise RuntimeError(f"a request failed: {r.status_code} {r.text[:300]}")
        got = r.json()["usage"]["completion_tokens"]
        if got != n:
            raise RuntimeError(f"asked for {n} tokens, got {got}")
        total += got
    return {"seconds": dt, "output_tokens": total, "tokens_per_s": total / dt, "requests": len(rs)}


def _offline(args) -> dict:
    """``throughput.py --engine rlserve`` on the same workload, in its own process."""
    here = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "offline.json")
        cmd = [sys.executable, os.path.join(here, "throughput.py"), "--shape", args.shape, "--engine", "rlserve",
               "--no-hf", "--num-seqs", str(args.num_seqs), "--min-len", str(args.min_len), "--max-len",
               str(args.max_len), "--max-num-seqs", str(args.num_seqs), "--seed", str(args.seed), "--json", out]
        if args.offline_args:
            cmd += args.offline_args.split()
        subprocess.run(cmd, check=True)
        with open(out) as f:
            return json.load(f)["results"][0]


def throughput_main(args, serve_args: list[str]) -> int:
    """``--workload throughput``: see the module docstring."""
    from benchmarks.model_shapes import save_shape, shape_config
    from benchmarks.throughput import make_workload
    from rlserve.server.testing import ServerProcess
    from tests.tiny_models import build_tokenizer

    if not args.shape:
        print("--workload throughput needs --shape (the offline run builds the same random-weight model)",
              file=sys.stderr)
        return 2
    model = save_shape(args.shape, os.path.join(tempfile.gettempdir(), "rlserve_bench_shapes"))
    build_tokenizer().save_pretrained(model)  # prompts are token ids; text is not looked at
    vocab = int(shape_config(args.shape).vocab_size)
    prompts, out_lens = make_workload(args.num_seqs, args.min_len, args.max_len, vocab, args.seed)
    rows = []
    offline = _offline(args) if args.offline else None
    if offline is not None:
        print(f"offline LLM.generate: {offline['tokens_per_s']:.0f} out tok/s ({offline['seconds']:.2f} s)", flush=True)
    common = ["--load-format", "dummy", "--max-model-len", str(2 * args.max_len + 8), "--max-num-seqs",
              str(args.num_seqs), "--seed", str(args.seed)]  # flags both servers take
    for cfg in args.configs or ["default="]:
        name, _, flags = cfg.partition("=")
        words = flags.split()
        if words[:1] == ["vllm"]:
            from benchmarks.vllm_serve import VLLMServer

            srv = VLLMServer(model, common + words[1:], args.vllm_pythonpath).start()
        else:
            srv = ServerProcess(model, *common, "--disable-access-log", *serve_args, *words,
                                startup_timeout_s=1800).start()
        try:
            if words[:1] == ["vllm"]:
                info = {"engine_mode": "vllm serve", "data_parallel_size": _flag(words, "--data-parallel-size", 1)}
            else:
                info = httpx.get(srv.url + "/server_info", timeout=30).json()
            served = httpx.get(srv.url + "/v1/models", timeout=30,
                               headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}).json()
            r = run_burst(srv.url, prompts, out_lens, args.api_key, model=served["data"][0]["id"])
        finally:
            srv.stop()
        r.update(config=name, flags=flags, data_parallel_size=info.get("data_parallel_size"),
                 engine_mode=info.get("engine_mode", "thread"), device=info.get("device"), dtype=info.get("dtype"))
        if offline is not None:
            r["vs_offline"] = r["tokens_per_s"] / offline["tokens_per_s"]
        rows.append(r)
        ratio = f", {r['vs_offline']:.1%} of offline" if offline is not None else ""
        print(f"{name} [{flags}]: {r['tokens_per_s']:.0f} out tok/s ({r['seconds']:.2f} s, DP={r['data_parallel_size']}, "
              f"engine {r['engine_mode']}){ratio}", flush=True)
    print(f"\nworkload: {args.num_seqs} requests, prompt and output lengths in [{args.min_len}, {args.max_len}], "
          f"shape {args.shape}, seed {args.seed}; host {platform.node()} ({os.cpu_count()} CPUs)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"offline": offline, "rows": rows}, f, indent=2)
    return 0


def _flag(words: list[str], name: str, default):
    """The value after ``name`` in ``words`` (``--name v`` or ``--name=v``), else ``default``."""
    for i, w in enumerate(words):
        if w == name and i + 1 < len(words):
            return words[i + 1]
        if w.startswith(name + "="):
            return w.split("=", 1)[1]
    return default


def _ms(x):
    return "-" if x is None else f"{x * 1000:.1f}"


def print_table(rows: list[dict]) -> None:
    stream = any(r["stream"] for r in rows)
    head = ["clients", "reqs", "errors", "req/s", "out tok/s", "p50 ms", "p99 ms"]
    if stream:
        head += ["TTFT p50", "TTFT p99", "ITL p50", "ITL p99"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---:" for _ in head) + "|")
    for r in rows:
        cells = [r["concurrency"], r["requests"], r["errors"], f"{r['requests_per_s']:.2f}",
                 f"{r['output_tokens_per_s']:.1f}", _ms(r["latency_p50_s"]), _ms(r["latency_p99_s"])]
        if stream:
            cells += [_ms(r.get("ttft_p50_s")), _ms(r.get("ttft_p99_s")), _ms(r.get("itl_p50_s")),
                      _ms(r.get("itl_p99_s"))]
        print("| " + " | ".join(str(c) for c in cells) + " |")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, serve_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    src.add_argument("--model", help="start `rlserve serve MODEL` on loopback for the run")
    src.add_argument("--tiny", action="store_true", help="start a server on a tiny random Llama (smoke test)")
    src.add_argument("--shape", help="start a server on a real model's shape with random weights "
                                     "(--load-format dummy; names in benchmarks/model_shapes.py, e.g. smollm2-135m)")
    p.add_argument("--concurrency", "-c", type=int, nargs="+", default=[1, 8, 32], help="client counts to run")
    p.add_argument("--duration", "-t", type=float, default=20.0, help="seconds per client count")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--stream", action="store_true", help="stream (adds TTFT and inter-token latency)")
    p.add_argument("--client-procs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                   help="client processes the clients are spread over (one process is a bottleneck at high "
                        "concurrency; measured on an H200 host: 8 processes doubled the rate at 256 clients)")
    p.add_argument("--api-key", default=os.environ.get("RLSERVE_API_KEY"))
    p.add_argument("--vocab", type=int, default=None, help="prompt token ids are drawn below this "
                                                          "(default: from /server_info)")
    p.add_argument("--json", help="also write the results here")
    t = p.add_argument_group("--workload throughput (benchmarks/throughput.py's workload through HTTP)")
    p.add_argument("--workload", choices=["load", "throughput"], default="load",
                   help="load: clients for a fixed time; throughput: a fixed batch of requests all at once")
    t.add_argument("--num-seqs", type=int, default=256)
    t.add_argument("--min-len", type=int, default=100)
    t.add_argument("--max-len", type=int, default=1024)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--offline", action="store_true", help="also run the offline LLM.generate figure first")
    t.add_argument("--offline-args", default="", help="extra flags for throughput.py (e.g. '--dtype bfloat16')")
    t.add_argument("--configs", nargs="+", default=None, metavar="NAME=FLAGS",
                   help="one server per entry, FLAGS added to the ones after --; FLAGS starting with the "
                        "word vllm: `vllm serve` with the rest of FLAGS instead")
    t.add_argument("--vllm-pythonpath", default=os.environ.get("VLLM_PYTHONPATH", "/tmp/vsite"),
                   help="vLLM's site directory (../shared/tools/device-vllm installs it there)")
    args = p.parse_args(argv)
    if args.workload == "throughput":
        return throughput_main(args, serve_args)

    srv = None
    url = args.url
    if url is None:
        from rlserve.server.testing import ServerProcess

        model = args.model
        if args.tiny:
            from tests.tiny_models import make_tiny_model

            model = make_tiny_model("llama", os.path.join(tempfile.gettempdir(), "rlserve_bench_tiny_llama"))
        if args.shape:
            from benchmarks.model_shapes import save_shape
            from tests.tiny_models import build_tokenizer

            model = save_shape(args.shape, os.path.join(tempfile.gettempdir(), "rlserve_bench_shapes"))
            build_tokenizer().save_pretrained(model)  # prompts are token ids; text is not looked at
            serve_args = ["--load-format", "dummy", *serve_args]
        srv = ServerProcess(model, "--disable-access-log", *serve_args).start()
        url = srv.url
    try:
        info = httpx.get(url + "/server_info", timeout=30).json()
        vocab = args.vocab or info.get("vocab_size", 1000)
        need = args.prompt_len + args.max_tokens
        if info.get("max_model_len") and need > info["max_model_len"]:
            print(f"prompt-len + max-tokens = {need} exceeds the server's max_model_len {info['max_model_len']}",
                  file=sys.stderr)
            return 2
        rows = []
        for c in args.concurrency:
            r = run_load(url, c, args.duration, args.prompt_len, args.max_tokens, vocab, args.stream, args.api_key,
                         model=info.get("served_model_name"), procs=args.client_procs)
            rows.append(r)
            print(f"clients={c}: {r['requests']} requests ({r['errors']} errors), {r['requests_per_s']:.2f} req/s, "
                  f"{r['output_tokens_per_s']:.1f} out tok/s, p50 {_ms(r['latency_p50_s'])} ms, "
                  f"p99 {_ms(r['latency_p99_s'])} ms", flush=True)
            if r["errors"]:
                print(f"  first error: {r['first_error']}", file=sys.stderr)
        print()
        print(f"server: {info.get('model')} ({info.get('dtype')}, {info.get('device')}, TP={info.get('tensor_parallel_size')}"
              f", DP={info.get('data_parallel_size')}); prompt {args.prompt_len} tok, output {args.max_tokens} tok, "
              f"{args.duration:.0f}s per row, clients spread over {args.client_procs} process(es); host {platform.node()} "
              f"({os.cpu_count()} CPUs)")
        print_table(rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"server": info, "rows": rows}, f, indent=2)
        return 0 if all(r["errors"] == 0 for r in rows) else 1
    finally:
        if srv is not None:
            srv.stop()


if __name__ == "__main__":
    sys.exit(main())
