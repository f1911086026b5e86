"""Sampling cost per decode step, and where a whole engine step's host time goes.

- ``sampler``: :class:`rlserve.engine.core.sampler.Sampler` on ``[B, V]`` float32 logits
  (temperature 0.6, unseeded, ``V`` = 151,936), the general path against the one-pass path
  (:mod:`rlserve.engine.core.fused_sampling`), alternating in one process; median wall time of
  the call plus a device synchronize (launches included).
- ``engine``: ``LLMEngine.step()`` (``--engine-outputs all``: a cumulative output for every
  request every step, as for streamed requests; ``finished``: as offline ``generate``) of a Qwen3-0.6B-shaped model (random weights) in steady
  decode at ``--batch`` sequences of ``--context`` tokens, one-pass sampler off and on
  alternating in blocks of ``--steps`` steps; then a cProfile of ``--steps`` steps (the
  functions with the most own time: the host work the GPU waits for).

Usage:
    python benchmarks/sampler_step.py --batch 256 --context 1024
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model_shapes import save_shape, shape_config  # noqa: E402

from rlserve.engine.core import fused_sampling  # noqa: E402


def _wall(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_sampler(batches: list[int], iters: int) -> None:
    from rlserve.engine.core.sampler import Sampler, SamplingMetadata
    from rlserve.engine.sampling_params import SamplingParams

    V = 151936
    for B in batches:
        logits = torch.randn(B, V, device="cuda") * 3
        params = [SamplingParams(temperature=0.6, max_tokens=100)] * B
        meta = SamplingMetadata(params, [[1]] * B, [[]] * B)
        s = Sampler(set(), V)
        res = {False: [], True: []}
        for _ in range(3):
            for on in (False, True):
                fused_sampling.set_fused_sampler(on)
                s(logits, meta)
                res[on].append(_wall(lambda: s(logits, meta), iters))
        fused_sampling.set_fused_sampler(True)
        print(f"sampler B={B:4d}: general {min(res[False]) * 1e3:.3f} ms  one-pass {min(res[True]) * 1e3:.3f} ms",
              flush=True)


def bench_engine(args) -> None:
    from rlserve import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as root:
        path = save_shape("qwen3-0.6b", root)
        B, ctx = args.batch, args.context
        n_steps = 6 * args.steps + 16
        bs = 16
        llm = LLM(path, dtype="bfloat16", device="cuda", load_format="dummy", skip_tokenizer_init=True,
                  max_model_len=ctx + n_steps + 16, max_num_seqs=B, block_size=bs,
                  num_kv_blocks=B * (-(-(ctx + n_steps + 16) // bs)) + 8, enable_prefix_caching=False,
                  max_num_batched_tokens=max(8192, ctx + n_steps + 16))
        eng = llm.engine
        g = torch.Generator().manual_seed(0)
        vocab = shape_config("qwen3-0.6b").vocab_size
        for i in range(B):
            prompt = torch.randint(0, vocab, (ctx - 1,), generator=g).tolist()
            eng.add_request(f"r{i}", prompt, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n_steps))
        while eng.scheduler.waiting or eng.scheduler.prefilling or any(s.num_output_tokens == 0 for s in eng.scheduler.running):
            eng.step()
        for _ in range(3):
            eng.step()
        outputs_for = None if args.engine_outputs == "all" else ()
        res = {False: [], True: []}
        for _ in range(2):
            for on in (False, True):
                fused_sampling.set_fused_sampler(on)
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    eng.step(outputs_for=outputs_for)
                    res[on].append(time.perf_counter() - t0)
        fused_sampling.set_fused_sampler(True)
        print(f"engine step B={B} ctx~{ctx}: general sampler {statistics.median(res[False]) * 1e3:.3f} ms, "
              f"one-pass {statistics.median(res[True]) * 1e3:.3f} ms (medians of {2 * args.steps})", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            eng.step(outputs_for=outputs_for)
        torch.cuda.synchronize()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
        print(out.getvalue())
        eng.abort_all()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sampler-batches", default="1,64,256")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--top", type=int, default=22)
    ap.add_argument("--engine-outputs", choices=("finished", "all"), default="all",
                    help="outputs for finished requests only (offline / non-streamed) or for all (streamed)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("sampler_step.py needs a CUDA GPU")
    bench_sampler([int(x) for x in args.sampler_batches.split(",")], args.iters)
    bench_engine(args)


if __name__ == "__main__":
    main()
