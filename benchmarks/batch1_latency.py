"""Batch-1 decode latency end to end, and where its time goes (issue 37's ``ms/token`` measure).

:func:`measure` runs one ``prompt_len``-token prompt for ``n`` greedy tokens through
``LLM.generate`` (``LLMEngine.generate_blocking``: the offline loop, overlapped decode as
configured) and reports wall time / ``n`` -- the same measure as ``throughput.py
--batch1-tokens`` -- then the same request once more with light instruments
(:func:`_split`): per engine step the host's wall time and, on CUDA, the GPU span of its launch
(a CUDA event before the step's inputs are built and one after its sampler: forward, LM head,
sampling), the host time of each launch and of each wait for an overlapped step's tokens.
``gpu_ms_per_step`` is that span's mean over the decode steps; ``gap_ms`` = wall per token - GPU
span per step is time the GPU sat idle between two steps (the host-side gap); ``wait_ms`` near 0
says the host, not the GPU, set the pace.
Used by ``decode_step.py --batch1-tokens`` (one engine per ``--decode-gemv`` mode, in one process).
:func:`host_only` (``--host-only``): the same loop with the decode forward replaced by cached logits,
the host's own time per token (what runs between two graph replays), with ``--profile N`` its top
functions.

Usage:
    python benchmarks/batch1_latency.py --shape qwen3-0.6b                       # on the GPU
    python benchmarks/batch1_latency.py --shape tiny-llama --device cpu --host-only --profile 20
"""

from __future__ import annotations

import random
import statistics
import time

import torch


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _split(engine, run, dev: torch.device) -> dict:
    """Run ``run()`` with every ``engine.step`` timed on the host, the host time of every decode
    ``engine._launch`` (inputs, graph replay, LM head and sampler launches) and of every wait for an
    overlapped step's tokens (``overlap._InFlight.wait``: the host idle, the GPU the bottleneck),
    and (CUDA) every decode launch bracketed by CUDA events. Returns ms per step: ``step_ms_median``,
    ``launch_host_ms``, ``wait_ms`` (means over the decode steps / waits), ``gpu_ms_per_step``
    (decode launches' mean GPU span, None on CPU), and ``steps``."""
    from rlserve.engine.core import overlap

    walls: list[float] = []
    launches: list[float] = []
    waits: list[float] = []
    events: list[tuple] = []
    step0, launch0, wait0 = engine.step, engine._launch, overlap._InFlight.wait

    def step(*a, **kw):
        t0 = time.perf_counter()
        out = step0(*a, **kw)
        walls.append(time.perf_counter() - t0)
        return out

    def launch(batch, *a, **kw):
        if batch.is_prefill:
            return launch0(batch, *a, **kw)
        t0 = time.perf_counter()
        if dev.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            out = launch0(batch, *a, **kw)
            e1.record()
            events.append((e0, e1))
        else:
            out = launch0(batch, *a, **kw)
        launches.append(time.perf_counter() - t0)
        return out

    def wait(self):
        t0 = time.perf_counter()
        out = wait0(self)
        waits.append(time.perf_counter() - t0)
        return out

    engine.step, engine._launch, overlap._InFlight.wait = step, launch, wait
    try:
        run()
        _sync(dev)
    finally:
        engine.step, engine._launch, overlap._InFlight.wait = step0, launch0, wait0
    gpu = [e0.elapsed_time(e1) for e0, e1 in events]
    ms = lambda xs: statistics.fmean(xs) * 1e3 if xs else None  # noqa: E731
    return {"steps": len(walls), "step_ms_median": statistics.median(walls) * 1e3 if walls else None,
            "launch_host_ms": ms(launches), "wait_ms": ms(waits),
            "gpu_ms_per_step": statistics.fmean(gpu) if gpu else None}


def measure(llm, vocab: int, n: int, prompt_len: int = 128, seed: int = 0) -> dict:
    """Batch-1 greedy decode of ``n`` tokens after a ``prompt_len``-token random prompt (ids in
    ``[0, vocab)``, seeded) through ``llm`` (:class:`rlserve.LLM`, built with room for
    ``prompt_len + n`` tokens). Returns ``{"batch1_ms_per_token", "step_ms_median",
    "gpu_ms_per_step", "gap_ms", "steps"}`` (ms; the GPU fields None on CPU)."""
    from rlserve import SamplingParams

    eng = llm.engine
    dev = eng.device
    rng = random.Random(seed)
    prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
    sp = SamplingParams(temperature=0, ignore_eos=True, max_tokens=n)
    llm.generate([prompt], [SamplingParams(temperature=0, ignore_eos=True, max_tokens=16)])  # warm-up
    _sync(dev)
    t0 = time.perf_counter()
    out = llm.generate([prompt], [sp])
    _sync(dev)
    ms = (time.perf_counter() - t0) / n * 1e3
    got = len(out[0].outputs[0].token_ids)
    if got != n:
        raise RuntimeError(f"batch-1 run produced {got} tokens, asked for {n}")
    res = {"batch1_ms_per_token": ms}
    res.update(_split(eng, lambda: llm.generate([prompt], [sp]), dev))
    g = res["gpu_ms_per_step"]
    res["gap_ms"] = ms - g if g is not None else None
    return res


def host_only(llm, vocab: int, n: int, prompt_len: int = 128, top: int = 0) -> dict:
    """The host's share of a batch-1 decode step: ``n`` greedy tokens as in :func:`measure`, with
    every decode step's forward replaced by the logits of the first one (no model work: what is
    left is what runs between two graph replays -- scheduling, the step's inputs, sampling,
    appending the token, the stop checks). Returns ``{"host_ms_per_token"}``; ``top`` > 0 prints
    cProfile's top functions by own time."""
    from rlserve import SamplingParams

    eng = llm.engine
    rng = random.Random(0)
    prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
    sp = SamplingParams(temperature=0, ignore_eos=True, max_tokens=n)
    llm.generate([prompt], [SamplingParams(temperature=0, ignore_eos=True, max_tokens=16)])
    ex0, cached = eng.executor.execute, []

    def execute(step):
        if step.is_prefill:
            return ex0(step)
        if not cached:
            cached.append(ex0(step))
        return cached[0]

    eng.executor.execute = execute
    try:
        llm.generate([prompt], [sp])  # warm
        t0 = time.perf_counter()
        llm.generate([prompt], [sp])
        res = {"host_ms_per_token": (time.perf_counter() - t0) / n * 1e3}
        if top:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            llm.generate([prompt], [sp])
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(top)
    finally:
        eng.executor.execute = ex0
    return res


def main(argv=None) -> dict:
    """``python benchmarks/batch1_latency.py --shape tiny-llama --device cpu --host-only --profile 20``"""
    import argparse
    import json
    import os
    import sys
    import tempfile

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from model_shapes import save_shape, shape_config

    from rlserve import LLM

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--host-only", action="store_true", help="also the host's share (host_only)")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="with --host-only: cProfile's top N")
    args = ap.parse_args(argv)
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"  # the model dtype each engine serves
    with tempfile.TemporaryDirectory() as root:
        llm = LLM(save_shape(args.shape, root), device=args.device, dtype=dtype, load_format="dummy",
                  skip_tokenizer_init=True, max_model_len=args.prompt_len + args.tokens + 32)
        vocab = shape_config(args.shape).vocab_size
        res = {"shape": args.shape, "device": args.device, **measure(llm, vocab, args.tokens, args.prompt_len)}
        if args.host_only:
            res.update(host_only(llm, vocab, args.tokens, args.prompt_len, args.profile))
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in res.items()}))
    return res


if __name__ == "__main__":
    main()
