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
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlserve import LLM, SamplingParams  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--async", dest="use_async", action="store_true", help="through AsyncEngine (stream=False)")
    args = ap.parse_args(argv)
    path = make_tiny_model("llama", tempfile.mkdtemp())
    blocks = args.num_seqs * (-(-(args.prompt_len + args.max_tokens) // 16) + 1)
    kw = dict(dtype="float32", device="cpu", max_num_seqs=args.num_seqs, num_kv_blocks=blocks,
              max_model_len=args.prompt_len + args.max_tokens, skip_tokenizer_init=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(100) for _ in range(args.prompt_len)] for _ in range(args.num_seqs)]
    params = [SamplingParams(temperature=0.6, max_tokens=args.max_tokens, ignore_eos=True, seed=i)
              for i in range(args.num_seqs)]
    run = _async_runner(path, kw) if args.use_async else LLM(path, **kw).generate
    run(prompts[:2], params[:2])  # warm-up
    best = float("inf")
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        outs = run(prompts, params)
        best = min(best, time.perf_counter() - t0)
    assert all(len(o.outputs[0].token_ids) == args.max_tokens for o in outs)
    print(f"{'AsyncEngine' if args.use_async else 'LLM.generate'}: {args.num_seqs} seqs x {args.max_tokens} "
          f"tokens: {best:.3f} s, {best / args.max_tokens * 1e3:.2f} ms per decode step (prefill included)")


def _async_runner(path: str, kw: dict):
    """``run(prompts, params) -> outputs`` through an :class:`AsyncEngine`, every request
    non-streamed and submitted at once."""
    from rlserve.config import EngineConfig
    from rlserve.engine.async_engine import AsyncEngine

    engine = AsyncEngine(EngineConfig(model=path, **kw))

    async def one(prompt, sp):
        out = None
        async for o in engine.generate(prompt, sp, stream=False):
            out = o
        return out

    async def all_of(prompts, params):
        return await asyncio.gather(*[one(p, sp) for p, sp in zip(prompts, params)])

    return lambda prompts, params: asyncio.run(all_of(prompts, params))


if __name__ == "__main__":
    main()
