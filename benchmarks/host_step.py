"""The engine's host work per step, with the model's forward pass replaced by a stub.

What a GPU waits for between steps (when decode is not overlapped) is the host's own work:
scheduling, building the step's inputs, the sampler's bookkeeping, reading tokens back,
appending them, stop checks, outputs. This script measures that part alone on any machine:
the tiny random model's ``execute`` is replaced by a function that returns a slice of one
fixed ``[max_num_seqs, vocab]`` logits tensor, and the sampler by one that returns argmax-free
constant tokens, so what is timed is the engine's Python (``--real-sampler`` keeps the
sampler). The workload is nano-vllm's shape scaled down: ``--num-seqs`` sequences, prompt and
output lengths uniform in ``[--min-len, --max-len]``, ``ignore_eos``, temperature 0.6.

Reports the best wall and process-CPU seconds of ``--repeats`` runs (fresh prompt tokens each,
so no prefix-cache hits) and per step; on a shared machine the CPU time is the steadier
figure. ``--profile N`` prints cProfile's top N functions by own time.

Usage::

    python benchmarks/host_step.py                       # 256 seqs, lengths 16..200
    python benchmarks/host_step.py --profile 25
    RLSERVE_ASYNC_SCHEDULING=1 python benchmarks/host_step.py   # the overlapped loop
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlserve import LLM, SamplingParams  # noqa: E402
from rlserve.engine.core.sampler import SamplerOutput  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402


def stub_engine(llm: LLM, real_sampler: bool) -> None:
    """Replace the forward pass (and, unless ``real_sampler``, the sampler) with constant-time
    stubs that return tensors of the right shapes."""
    eng = llm.engine
    V = eng.vocab_size
    logits = torch.randn(max(eng.config.max_num_seqs, 1) * 4, V)

    def execute(step):
        return logits[: len(step.logits_indices)]

    eng.executor.execute = execute
    if not real_sampler:
        def sample(lg, meta):
            B = lg.shape[0]
            tok = torch.arange(B, dtype=torch.long) % V
            return SamplerOutput(tok, torch.zeros(B), torch.empty(B, 0, dtype=torch.long), torch.empty(B, 0))

        eng.sampler = sample


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=200)
    ap.add_argument("--real-sampler", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    args = ap.parse_args(argv)
    path = make_tiny_model("llama", tempfile.mkdtemp(), max_position_embeddings=4096)
    rng = random.Random(0)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(args.min_len, args.max_len))] for _ in range(args.num_seqs)]
    out_lens = [rng.randint(args.min_len, args.max_len) for _ in range(args.num_seqs)]
    llm = LLM(path, dtype="float32", device="cpu", max_num_seqs=args.num_seqs, max_model_len=2 * args.max_len + 8,
              num_kv_blocks=args.num_seqs * (-(-(2 * args.max_len + 8) // 16) + 1), skip_tokenizer_init=True)
    stub_engine(llm, args.real_sampler)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in out_lens]
    llm.generate(prompts[:2], params[:2])
    best = best_cpu = float("inf")
    steps = 0
    for r in range(args.repeats):
        fresh = [[(t + r + 1) % 300 for t in p] for p in prompts]  # a repeat would hit the prefix cache
        s0 = llm.engine.stats_counters["steps"]
        t0, c0 = time.perf_counter(), time.process_time()
        llm.generate(fresh, params)
        best = min(best, time.perf_counter() - t0)
        best_cpu = min(best_cpu, time.process_time() - c0)
        steps = llm.engine.stats_counters["steps"] - s0
    print(f"host_step: {args.num_seqs} seqs, lengths {args.min_len}..{args.max_len}, "
          f"overlap={llm.engine._overlap is not None}: best {best:.3f} s wall ({best / steps * 1e6:.0f} us/step), "
          f"best {best_cpu:.3f} s CPU ({best_cpu / steps * 1e6:.0f} us/step), {steps} steps", flush=True)
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        llm.generate(prompts, params)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
