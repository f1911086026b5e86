"""The streamed closed-loop workload of ``vllm bench serve`` with a client that costs almost nothing (issue 37): is a
long inter-token gap the server's, or ``vllm bench serve``'s own Python client falling behind?

One ``rlserve serve`` (``benchmarks/vllm_bench.py``'s server words: flags, ``@K=V`` environment, ``@tree=DIR``),
then ``benchmarks/api_stream_load.py``'s client in a process of its own: raw asyncio sockets, one connection per
request, per read only a timestamp and a count of its ``data:`` events (no HTTP library, no JSON), ``--clients``
streams in a closed loop over ``--num-prompts`` requests of ``--prompt-len`` random token ids (id prompts: no
tokenization in the server) and ``--max-tokens`` tokens with ``ignore_eos``. The result is written as
``vllm_bench.py --json`` writes vLLM's (``rows[].result`` with ``start_times``, ``ttfts``, ``itls``: an event that
arrived in the read of the one before has a gap of 0, as ``vllm bench serve`` times them), so
``benchmarks/stream_gaps.py`` reads either; ``output_throughput``, ``mean_ttft_ms``, ``p99_itl_ms`` and the like
are filled in as vLLM names them.

Usage::

    python benchmarks/raw_stream_bench.py --shape qwen3-0.6b --name raw --clients 256 --num-prompts 768 \\
        --json out.json -- --dtype bfloat16 --disable-access-log
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.api_stream_load import read_gaps  # noqa: E402
from benchmarks.serve_load import percentile  # noqa: E402


def to_vllm_result(run: dict, max_tokens: int) -> dict:
    """``api_stream_load``'s run (per request: send time ``t0``, reads ``(time, events)``) as vLLM's result."""
    starts, ttfts, itls = [], [], []
    for r in run["results"]:
        if r["status"] != 200 or not r["reads"] or r.get("errors"):
            continue
        reads = r["reads"]
        starts.append(r["t0"])
        ttfts.append(reads[0][0] - r["t0"])
        itls.append(read_gaps(reads))
    dur = run["t1"] - run["t0"]
    flat = [g for x in itls for g in x]
    ms = lambda x: None if x is None else 1e3 * x  # noqa: E731
    return {
        "completed": len(starts), "failed": len(run["results"]) - len(starts), "duration": dur,
        "output_throughput": len(starts) * max_tokens / dur if dur else 0.0,
        "mean_ttft_ms": ms(sum(ttfts) / len(ttfts)) if ttfts else None, "p99_ttft_ms": ms(percentile(ttfts, 99)),
        "median_itl_ms": ms(percentile(flat, 50)), "p99_itl_ms": ms(percentile(flat, 99)),
        "mean_itl_ms": ms(sum(flat) / len(flat)) if flat else None,
        "max_output_tokens_per_s": None, "start_times": starts, "ttfts": ttfts, "itls": itls,
    }


def main(argv=None) -> int:
    from benchmarks.api_stream_load import _client_main
    from benchmarks.vllm_bench import prepare_model, start_server

    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model")
    src.add_argument("--shape")
    ap.add_argument("--tokenizer-dir")
    ap.add_argument("--name", default="raw")
    ap.add_argument("--words", default="", help="server words of benchmarks/vllm_bench.py (@K=V, @tree=DIR, flags)")
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=768)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--token-hi", type=int, default=300, help="largest prompt token id")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    model = prepare_model(argparse.Namespace(model=args.model, shape=args.shape, tokenizer_dir=args.tokenizer_dir))
    common = ["--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
              "--seed", str(args.seed)] + (["--load-format", "dummy"] if args.shape else [])
    srv = start_server(argparse.Namespace(vllm_pythonpath=None, vllm_python=None), model, args.words.split() + extra,
                       common)
    try:
        host, port = srv.url.removeprefix("http://").rsplit(":", 1)
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        warm = ctx.Process(target=_client_main, args=((host, int(port), "completions", model, 4, 8, 32, 8,
                                                        (3, args.token_hi), 1), queue))
        warm.start()
        queue.get(timeout=args.timeout)
        warm.join()
        proc = ctx.Process(target=_client_main, args=((host, int(port), "completions", model, args.clients,
                                                        args.num_prompts, args.prompt_len, args.max_tokens,
                                                        (3, args.token_hi), args.seed), queue))
        proc.start()
        run = queue.get(timeout=args.timeout)
        proc.join()
    finally:
        srv.stop()
    result = to_vllm_result(run, args.max_tokens)
    label = f"{args.name}@c{args.clients}"
    r = result
    print(f"{label}: {r['completed']} ok, {r['output_throughput']:,.0f} tok/s, TTFT mean/p99 {r['mean_ttft_ms']:.0f}/"
          f"{r['p99_ttft_ms']:.0f} ms, ITL median/p99 {r['median_itl_ms']:.1f}/{r['p99_itl_ms']:.1f} ms (raw client)",
          flush=True)
    with open(args.json, "w") as f:
        json.dump({"rows": [{"config": label, "flags": args.words, "max_concurrency": args.clients, "result": result}]}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
