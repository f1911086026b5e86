"""The engine's own work per decode step on a tiny random model: offline ``LLM.generate``, or
(``--async``) the server's ``AsyncEngine`` with every request non-streamed (RL rollouts).

The model (2 layers, hidden 64) makes the forward pass negligible, so what is timed is
scheduling, input building, sampling, token bookkeeping, detokenizing and outputs -- the part
of a step that does not shrink on a faster GPU. ``--num-seqs`` sequences of ``--prompt-len``
random tokens generate ``--max-tokens`` tokens each (``ignore_eos``, temperature 0.6, one seed
per row); the best of ``--repeats`` runs is reported as seconds and milliseconds per step.

Usage::

    python benchmarks/engine_overhead.py                       # 256 seqs x 200 tokens, CPU
    python benchmarks/engine_overhead.py --num-seqs 64 --max-tokens 100
    python benchmarks/engine_overhead.py --async              # through AsyncEngine, stream=False
    python benchmarks/engine_overhead.py --async --engine-mode thread process   # A/B, interleaved

``--engine-mode`` (with ``--async``): where the AsyncEngine runs its replica -- ``process`` (the
engine-core process, the server's default) or ``thread`` (on a thread of this process, as before
the engine core had its own process); several modes are run interleaved, repeat by repeat.

What crosses from the engine each step (with ``--async``): ``--stream`` consumes every
request's outputs as they come (every step of every request crosses the engine boundary);
``--detokenize`` loads the tokenizer so outputs carry text (default: token ids only,
``skip_tokenizer_init``); ``--stop S`` gives every request a stop string (one that does not
occur) to match in the text at every step.

``--trees DIR [DIR ...]``: A/B of checkouts in one run: each repeat runs the same workload once
per tree, each in a fresh child process that imports rlserve from that tree (the engine-core
process too), interleaved::

    python benchmarks/engine_overhead.py --async --stream --detokenize --trees /work/main .
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time

# RLSERVE_BENCH_TREE: the checkout a --trees child imports rlserve from
sys.path.insert(0, os.environ.get("RLSERVE_BENCH_TREE") or os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlserve import LLM, SamplingParams  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--async", dest="use_async", action="store_true", help="through AsyncEngine (stream=False)")
    ap.add_argument("--engine-mode", nargs="+", default=["process"], choices=["process", "thread"],
                    help="with --async: AsyncEngine engine_mode(s), run interleaved")
    ap.add_argument("--stream", action="store_true", help="with --async: consume every step's outputs")
    ap.add_argument("--detokenize", action="store_true", help="load the tokenizer: outputs carry text")
    ap.add_argument("--stop", default=None, help="a stop string for every request (needs --detokenize)")
    ap.add_argument("--trees", nargs="+", default=None, metavar="DIR",
                    help="A/B: run each repeat once per checkout, rlserve imported from DIR (child processes)")
    ap.add_argument("--json-out", default=None, help=argparse.SUPPRESS)  # a --trees child's result
    args = ap.parse_args(argv)
    if args.trees:
        return _trees_main(args, list(sys.argv[1:] if argv is None else argv))
    path = make_tiny_model("llama", os.path.join(tempfile.gettempdir(), "rlserve_bench_overhead_llama"))
    blocks = args.num_seqs * (-(-(args.prompt_len + args.max_tokens) // 16) + 1)
    kw = dict(dtype="float32", device="cpu", max_num_seqs=args.num_seqs, num_kv_blocks=blocks,
              max_model_len=args.prompt_len + args.max_tokens, skip_tokenizer_init=not args.detokenize)
    rng = random.Random(0)
    prompts = [[rng.randrange(100) for _ in range(args.prompt_len)] for _ in range(args.num_seqs)]
    stop = [args.stop] if args.stop else []
    params = [SamplingParams(temperature=0.6, max_tokens=args.max_tokens, ignore_eos=True, seed=i, stop=stop)
              for i in range(args.num_seqs)]
    if args.use_async:
        runs = {f"AsyncEngine ({m})": _async_runner(path, kw, m, args.stream) for m in args.engine_mode}
    else:
        runs = {"LLM.generate": LLM(path, **kw).generate}
    for run in runs.values():
        run(prompts[:2], params[:2])  # warm-up
    best = {name: float("inf") for name in runs}
    for _ in range(args.repeats):
        for name, run in runs.items():
            t0 = time.perf_counter()
            outs = run(prompts, params)
            best[name] = min(best[name], time.perf_counter() - t0)
            assert all(len(o.outputs[0].token_ids) == args.max_tokens for o in outs)
    for name, b in best.items():
        print(f"{name}: {args.num_seqs} seqs x {args.max_tokens} tokens: {b:.3f} s, "
              f"{b / args.max_tokens * 1e3:.2f} ms per decode step (prefill included)")
    for run in runs.values():
        getattr(run, "close", lambda: None)()
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(best, f)


def _trees_main(args, argv: list[str]) -> None:
    """``--trees``: every repeat runs this script once per tree (``--repeats 1``), interleaved;
    prints the best per tree and the load average before and after."""
    child = []
    skip = False
    for a in argv:  # the same flags without --trees / --repeats
        if skip and not a.startswith("--"):
            continue
        skip = a in ("--trees", "--repeats")
        if not skip:
            child.append(a)
    best: dict[str, float] = {}
    print(f"load average before: {os.getloadavg()}", flush=True)
    for rep in range(args.repeats):
        for tree in args.trees:
            tree = os.path.abspath(tree)
            with tempfile.TemporaryDirectory() as d:
                out = os.path.join(d, "r.json")
                env = dict(os.environ, PYTHONPATH=tree, RLSERVE_BENCH_TREE=tree)
                # cwd = the tree: ``python -m rlserve.engine.core.core_proc`` puts the cwd first on sys.path
                subprocess.run([sys.executable, os.path.abspath(__file__), *child, "--repeats", "1",
                                "--json-out", out], env=env, check=True, stdout=subprocess.DEVNULL, cwd=tree)
                with open(out) as f:
                    for name, b in json.load(f).items():
                        key = f"{tree} {name}"
                        best[key] = min(best.get(key, float("inf")), b)
                        print(f"repeat {rep + 1}: {key}: {b / args.max_tokens * 1e3:.2f} ms per step", flush=True)
    print(f"load average after: {os.getloadavg()}")
    for key, b in best.items():
        print(f"best {key}: {args.num_seqs} seqs x {args.max_tokens} tokens: {b:.3f} s, "
              f"{b / args.max_tokens * 1e3:.2f} ms per decode step (prefill included)")


def _async_runner(path: str, kw: dict, mode: str = "process", stream: bool = False):
    """``run(prompts, params) -> outputs`` through an :class:`AsyncEngine` (``engine_mode``
    ``mode``), every request submitted at once (``stream``: every output consumed, else only
    the final one); ``run.close()`` stops it."""
    from rlserve.config import EngineConfig
    from rlserve.engine.front.async_engine import AsyncEngine

    engine = AsyncEngine(EngineConfig(model=path, **kw), engine_mode=mode)

    async def one(prompt, sp):
        out = None
        async for o in engine.generate(prompt, sp, stream=stream):
            out = o
        return out

    async def all_of(prompts, params):
        return await asyncio.gather(*[one(p, sp) for p, sp in zip(prompts, params)])

    def run(prompts, params):
        return asyncio.run(all_of(prompts, params))

    run.close = engine.shutdown
    return run


if __name__ == "__main__":
    main()
