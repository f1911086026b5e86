"""The engine's own work per decode step: offline ``LLM.generate`` on a tiny random model.

The model (2 layers, hidden 64) makes the forward pass negligible, so what is timed is
scheduling, input building, sampling, token bookkeeping, detokenizing and outputs -- the part
of a step that does not shrink on a faster GPU. ``--num-seqs`` sequences of ``--prompt-len``
random tokens generate ``--max-tokens`` tokens each (``ignore_eos``, temperature 0.6, one seed
per row); the best of ``--repeats`` runs is reported as seconds and milliseconds per step.

Usage::

    python benchmarks/engine_overhead.py                       # 256 seqs x 200 tokens, CPU
    python benchmarks/engine_overhead.py --num-seqs 64 --max-tokens 100
"""

from __future__ import annotations

import argparse
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
    args = ap.parse_args(argv)
    path = make_tiny_model("llama", tempfile.mkdtemp())
    blocks = args.num_seqs * (-(-(args.prompt_len + args.max_tokens) // 16) + 1)
    llm = LLM(path, dtype="float32", device="cpu", max_num_seqs=args.num_seqs, num_kv_blocks=blocks,
              max_model_len=args.prompt_len + args.max_tokens, skip_tokenizer_init=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(100) for _ in range(args.prompt_len)] for _ in range(args.num_seqs)]
    params = [SamplingParams(temperature=0.6, max_tokens=args.max_tokens, ignore_eos=True, seed=i)
              for i in range(args.num_seqs)]
    llm.generate(prompts[:2], params[:2])  # warm-up
    best = float("inf")
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        best = min(best, time.perf_counter() - t0)
    assert all(len(o.outputs[0].token_ids) == args.max_tokens for o in outs)
    print(f"{args.num_seqs} seqs x {args.max_tokens} tokens: {best:.3f} s, "
          f"{best / args.max_tokens * 1e3:.2f} ms per decode step (prefill included)")


if __name__ == "__main__":
    main()
