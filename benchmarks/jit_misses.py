"""Triton kernels compiled after the engine is ready (issue 37): start an offline engine (dummy weights of
a model shape), wait for its warm-up, then count every Triton JIT miss while a varied workload runs.

A launch whose specialization a kernel has not compiled in this process (a ``tl.constexpr`` value, an
integer's being 1 or divisible by 16, a pointer's 16-byte alignment: Triton's key) compiles it -- or loads it
from Triton's disk cache -- in the engine's step, and every running stream waits (BENCHMARKS.md H25: one
prefill-kernel miss, a 675-891 ms step with 42-86 streams running). ``triton.knobs.runtime.jit_cache_hook``
sees each miss before it compiles (:class:`JitCounter`; chained with the hook found there, e.g.
:mod:`rlserve.engine.worker.triton_precompile`'s).

The workload (:func:`run_workload`), each phase through ``engine.add_request`` / ``engine.step`` so the
running batch changes from step to step:

* ``ladder``: bursts of B = 1, 2, 3, 4, 5, 7, 8, 9, ..., 255, 256 requests (each B a batch size and every
  smaller one as they finish: their output lengths differ), prompts of 1..4,096 tokens (log-uniform);
* ``staggered``: one request added per step (prompts arrive while others decode: mixed steps where
  ``mixed_prefill_decode`` is on, chunked prefills of the long ones) up to 256 running;
* ``sampling``: n = 2..4, logprobs 0..5, prompt logprobs, temperature / top-p / top-k with seeds, min_tokens,
  stop_token_ids (stop *strings* are the API process's detokenizer's: no kernel sees them; a stop token
  ends a request in the engine the same way);
* ``prefix``: the ladder's prompts again with new tails (prefix-cache hits: the prefill kernel over a cached
  context, block tables of other lengths).

LoRA and MoE are off (a dense shape, no adapters). Prints each miss after ready as it happens (``[jit] PHASE
+SECONDS module.kernel[options](arguments: types and specializations)``), then each step that had one
(``[stall] PHASE step MS: N miss(es)``) and a summary; ``--json`` writes everything. ``--scale`` shrinks the request counts (a CPU
dry run: ``--shape tiny-llama --device cpu --scale 0.05 --max-model-len 512``; no Triton kernel runs there,
so nothing is counted: it checks the script).

    python benchmarks/jit_misses.py --shape qwen3-0.6b --json /tmp/jit.json
    python benchmarks/jit_misses.py --shape qwen3-0.6b --engine-arg mixed_prefill_decode=true
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_IDS = itertools.count()
#: burst sizes: each a batch size, around every power of two Triton's divisibility classes and the CUDA-graph
#: sizes meet (the bursts drain through every smaller size as well)
LADDER = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256)


class JitCounter:
    """While installed (a context manager), every Triton JIT miss of this process: ``misses``, one dict per
    miss with ``kernel`` (module.name), ``repr`` (Triton's: options and each argument's type and
    specialization), ``phase`` (:attr:`phase` then) and ``t`` (seconds since install). Chained: the hook
    found at install is called first, and a miss it takes over (returns True: a precompile recording) is not
    counted. A process without Triton counts nothing (``available`` False)."""

    def __init__(self, echo: bool = False):
        self.echo = echo  # print each miss as it happens (``[jit] PHASE +SECONDS kernel repr``)
        self.misses: list[dict] = []
        self.phase = "start"
        self.available = False
        self._prev = None
        self._t0 = time.perf_counter()

    def _hook(self, **kw):
        prev = self._prev(**kw) if self._prev is not None else None
        if prev:
            return prev
        fn = kw.get("fn")
        m = {"kernel": f"{getattr(fn, 'module', '?')}.{getattr(fn, 'name', '?')}", "repr": kw.get("repr", ""),
             "phase": self.phase, "t": round(time.perf_counter() - self._t0, 3)}
        self.misses.append(m)
        if self.echo:
            print(f"[jit] {m['phase']} +{m['t']:.2f}s {m['kernel']} {m['repr']}", flush=True)
        return prev

    def __enter__(self):
        try:
            from triton import knobs
        except ImportError:
            return self
        self.available = True
        self._prev = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self._hook
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.available:
            from triton import knobs

            knobs.runtime.jit_cache_hook = self._prev


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(5, vocab) for _ in range(max(1, n))]


def _length(rng: random.Random, hi: int) -> int:
    """Log-uniform in 1..hi."""
    return max(1, min(hi, int(math.exp(rng.uniform(0, math.log(hi))))))


def _drive(engine, arrivals: list[list[tuple]], counter: JitCounter, steps: list) -> dict:
    """Add ``arrivals[i]`` (``(prompt, params)`` pairs) before step ``i``, then step until done; each step's
    wall time and misses go to ``steps`` (``[phase, ms, misses]``). Returns the finished outputs by id."""
    done, i = {}, 0
    while i < len(arrivals) or engine.has_unfinished_requests():
        for prompt, params in arrivals[i] if i < len(arrivals) else ():
            engine.add_request(f"{counter.phase}-{next(_IDS)}", prompt, params)
        i += 1
        n0, t0 = len(counter.misses), time.perf_counter()
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        steps.append([counter.phase, round(1e3 * (time.perf_counter() - t0), 2), len(counter.misses) - n0])
    return done


def run_workload(engine, counter: JitCounter, vocab: int, scale: float = 1.0, max_len: int = 4096,
                 max_seqs: int = 256, seed: int = 0, phases=("ladder", "staggered", "sampling", "prefix")) -> dict:
    """The module docstring's workload on ``engine`` (an ``LLMEngine``: ``add_request`` / ``step``), prompts of
    token ids below ``vocab``, at most ``max_len`` tokens of prompt + output and ``max_seqs`` requests a burst;
    ``scale`` multiplies the request counts (a burst keeps its size from 0.5 on) and, below 0.25, the output
    lengths (at most 48 tokens). Sets ``counter.phase``. Returns ``{"steps": [[phase, ms,
    misses]], "requests": {phase: finished}}``."""
    from rlserve import SamplingParams

    rng = random.Random(seed)
    out_hi = max(2, min(48, int(192 * scale)))
    hi = max(out_hi + 2, max_len)
    steps: list = []
    requests = {}
    ladder_prompts = []
    for phase in phases:
        counter.phase = phase
        arrivals: list[list[tuple]] = []
        if phase == "ladder":
            for B in [b for b in LADDER if b <= max_seqs]:
                burst = []
                for _ in range(max(1, round(B * min(1.0, scale * 2)))):
                    p = _prompt(rng, _length(rng, hi - out_hi), vocab)
                    ladder_prompts.append(p)
                    burst.append((p, SamplingParams(temperature=0, max_tokens=rng.randint(1, out_hi), ignore_eos=True)))
                arrivals.append(burst)
                arrivals += [[] for _ in range(out_hi + 2)]  # this burst drains before the next
        elif phase == "staggered":
            arrivals = [[(_prompt(rng, _length(rng, hi - out_hi), vocab),
                          SamplingParams(temperature=0, max_tokens=rng.randint(out_hi // 2, out_hi), ignore_eos=True))]
                        for _ in range(max(4, int(max_seqs * 1.2 * scale)))]
        elif phase == "sampling":
            for k in range(max(8, int(64 * scale))):
                sp = SamplingParams(
                    n=rng.choice((1, 2, 3, 4)), temperature=rng.choice((0.0, 0.7, 1.0)), top_p=rng.choice((1.0, 0.9)),
                    top_k=rng.choice((-1, 20)), seed=rng.choice((None, k)), logprobs=rng.choice((None, 0, 1, 5)),
                    prompt_logprobs=rng.choice((None, None, 2)), min_tokens=rng.choice((0, 4)),
                    stop_token_ids=[rng.randrange(5, vocab)], max_tokens=rng.randint(4, out_hi))
                arrivals.append([(_prompt(rng, _length(rng, min(hi - out_hi, 512)), vocab), sp)])
        elif phase == "prefix":
            for p in ladder_prompts[: max(4, int(128 * scale))]:
                tail = _prompt(rng, rng.randint(1, 40), vocab)
                arrivals.append([(p[: max(1, len(p) - len(tail))] + tail,
                                  SamplingParams(temperature=0, max_tokens=rng.randint(1, out_hi), ignore_eos=True))])
        else:
            raise ValueError(f"unknown phase {phase!r}")
        requests[phase] = len(_drive(engine, arrivals, counter, steps))
    return {"steps": steps, "requests": requests}


def summary(counter: JitCounter, work: dict) -> list[str]:
    """Lines: each step with a miss (its wall time, the kernels), then totals per kernel."""
    lines, k = [], 0
    for phase, ms, n in work["steps"]:
        if n:
            names = [m["kernel"].rsplit(".", 1)[-1] for m in counter.misses[k:k + n]]
            lines.append(f"[stall] {phase} step {ms:.1f} ms: {n} miss(es) {names}")
        k += n
    by_kernel: dict[str, int] = {}
    for m in counter.misses:
        by_kernel[m["kernel"]] = by_kernel.get(m["kernel"], 0) + 1
    steps = work["steps"]
    slow = sorted((ms for _, ms, n in steps if n), reverse=True)
    lines.append(f"compiles after ready: {len(counter.misses)} (by kernel: {by_kernel or '{}'}) over {len(steps)} steps, "
                 f"requests {work['requests']}; steps with a compile: {len(slow)} (ms: {slow[:10]}); "
                 f"p99 step {sorted(ms for _, ms, _ in steps)[int(0.99 * (len(steps) - 1))] if steps else 0:.1f} ms"
                 + ("" if counter.available else " -- no Triton here: nothing counted"))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--model", help="a model directory instead of --shape")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=4096 + 64)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--phases", default="ladder,staggered,sampling,prefix")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="an LLM keyword (JSON value, else a string), e.g. mixed_prefill_decode=true")
    ap.add_argument("--json")
    args = ap.parse_args()
    from model_shapes import save_shape

    from rlserve import LLM

    kw = {}
    for item in args.engine_arg:
        key, _, val = item.partition("=")
        try:
            kw[key] = json.loads(val)
        except json.JSONDecodeError:
            kw[key] = val
    root = tempfile.mkdtemp(prefix="jit_misses_")
    path = args.model or save_shape(args.shape, root)
    t0 = time.perf_counter()
    llm = LLM(path, dtype=args.dtype, device=args.device, load_format="dummy", skip_tokenizer_init=True, seed=args.seed,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, **kw)
    ready_s = time.perf_counter() - t0
    engine = llm.engine
    import rlserve

    print(f"ready in {ready_s:.1f} s (warm-up {getattr(engine.executor, 'warm_up_seconds', None)}); engine args {kw}; "
          f"rlserve from {os.path.dirname(os.path.dirname(rlserve.__file__))}", flush=True)
    with JitCounter(echo=True) as counter:
        work = run_workload(engine, counter, engine.vocab_size, args.scale, args.max_model_len - 64,
                            args.max_num_seqs, args.seed, tuple(args.phases.split(",")))
    lines = summary(counter, work)
    print("\n".join(lines), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ready_s": ready_s, "misses": counter.misses, "counted": counter.available,
                       "requests": work["requests"], "steps": work["steps"], "summary": lines[-1]}, f)


if __name__ == "__main__":
    main()
