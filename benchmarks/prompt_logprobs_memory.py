"""Peak memory and time of the prompt-logprob scoring (:func:`rlserve.engine.core.prompt_logprobs.ranked_logprob_dicts`)
of one step's prompt rows: scored in :data:`~rlserve.engine.core.prompt_logprobs.ROWS_BYTES` blocks (the default)
against one block of every row (the code before session 21), interleaved, median of ``--repeats``. Prints one JSON line
per arm: ``{"arm", "rows", "vocab", "dtype", "peak_mib" (CUDA: max_memory_allocated above the logits; CPU: null),
"ms"}``.

    python benchmarks/prompt_logprobs_memory.py --rows 8192 --vocab 151936 --top 5      # CUDA when there is one
    python benchmarks/prompt_logprobs_memory.py --device cpu --rows 512 --vocab 32000    # a tiny CPU run
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from rlserve.engine.core import prompt_logprobs as pl  # noqa: E402


def one(logits, target, top: int, rows_bytes: int, cuda: bool) -> tuple[float, float | None]:
    pl.ROWS_BYTES = rows_bytes
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t = time.perf_counter()
    pl.ranked_logprob_dicts(logits, target, top)
    if cuda:
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t) * 1e3
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None
    return ms, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    cuda = a.device.startswith("cuda")
    g = torch.Generator(device=a.device).manual_seed(0)
    logits = torch.randn(a.rows, a.vocab, generator=g, device=a.device).to(getattr(torch, a.dtype))
    target = torch.randint(a.vocab, (a.rows,), device="cpu").tolist()
    default = pl.ROWS_BYTES
    arms = {"blocks": default, "one_block": 1 << 62}
    res: dict = {k: [] for k in arms}
    for _ in range(a.repeats + 1):  # the first round warms up
        for name, rb in arms.items():
            res[name].append(one(logits, target, a.top, rb, cuda))
    pl.ROWS_BYTES = default
    for name, runs in res.items():
        runs = runs[1:]
        print(json.dumps({"arm": name, "rows": a.rows, "vocab": a.vocab, "dtype": a.dtype, "device": a.device,
                          "peak_mib": None if not cuda else round(max(p for _, p in runs), 1),
                          "ms": round(statistics.median(m for m, _ in runs), 2)}))


if __name__ == "__main__":
    main()
