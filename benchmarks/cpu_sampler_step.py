"""CPU per decode step with the sampler: the real SmolLM2-135M's batch-B decode step (``Worker.execute``,
contexts 128-512, as ``cpu_decode_step.py``) followed by the engine's sampler and the host read of its
tokens and logprobs (``.tolist()``, as ``engine_step._finish_step``), with the sampler's lean paths
(:mod:`rlserve.engine.core.lean_sampling`) off and on, alternating step by step (which goes first
alternates too), in one process.

Per arm, medians: the engine thread's CPU ms for the whole step (``time.thread_time``: model +
sampler), the sampler's alone (thread CPU, the ``.tolist()`` reads included), the process's CPU ms
(``time.process_time``: the team worker included) and wall ms; and the medians of the paired
(same-iteration) off - on differences. Checks that both arms give the same tokens and, in the
rows that asked for logprobs, bit-equal logprobs. One JSON line per ``--logprobs`` value.

Usage:
    python benchmarks/cpu_sampler_step.py --steps 60 --batch 16
    python benchmarks/cpu_sampler_step.py --steps 60 --batch 16 --logprobs none 0
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def bench(w, batch: int, steps: int, logprobs: int | None) -> dict:
    import torch
    from cpu_decode_step import _decode_step

    from rlserve.engine.core import lean_sampling
    from rlserve.engine.core.sampler import Sampler, SamplingMetadata
    from rlserve.engine.sampling_params import SamplingParams

    step = _decode_step(batch)
    sampler = Sampler({0, 2}, 49152)  # SmolLM2's EOS ids (<|endoftext|>, <|im_end|>); greedy rows draw nothing
    params = [SamplingParams(temperature=0.0, max_tokens=128, logprobs=logprobs) for _ in range(batch)]
    meta = SamplingMetadata(params, [[1] * 128] * batch, [[5] * 64] * batch)

    def one(lean: bool):
        lean_sampling.set_lean(lean)
        c0, p0, w0 = time.thread_time(), time.process_time(), time.perf_counter()
        logits = w.execute(step)
        s0 = time.thread_time()
        out = sampler(logits, meta)
        toks, lps = out.token_ids.tolist(), out.logprobs.tolist()
        c1 = time.thread_time()
        return (toks, lps), (1e3 * (c1 - c0), 1e3 * (c1 - s0), 1e3 * (time.process_time() - p0),
                             1e3 * (time.perf_counter() - w0))

    ref = {lean: one(lean)[0] for lean in (False, True)}
    same = ref[False][0] == ref[True][0] and (logprobs is None or ref[False][1] == ref[True][1])
    for _ in range(3):
        one(True)
    keys = ("step_cpu", "sampler_cpu", "proc_cpu", "wall")
    res = {lean: {k: [] for k in keys} for lean in (False, True)}
    load0 = os.getloadavg()
    for i in range(steps):
        for lean in ((False, True) if i % 2 == 0 else (True, False)):
            for k, v in zip(keys, one(lean)[1]):
                res[lean][k].append(v)
    lean_sampling.set_lean(True)
    out = {"batch": batch, "logprobs": logprobs, "steps_each": steps, "same_tokens_and_logprobs": same,
           "torch_threads": torch.get_num_threads()}
    for k in keys:
        out[f"{k}_off_median_ms"] = round(statistics.median(res[False][k]), 3)
        out[f"{k}_on_median_ms"] = round(statistics.median(res[True][k]), 3)
        out[f"{k}_paired_diff_median_ms"] = round(statistics.median(
            a - b for a, b in zip(res[False][k], res[True][k])), 3)
    out["load_before"] = [round(x, 2) for x in load0]
    out["load_after"] = [round(x, 2) for x in os.getloadavg()]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="steps per arm")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--logprobs", nargs="+", default=["none"],
                   help="per run: 'none' (no row asks, as issue 37's requests) or K (every row asks for K)")
    p.add_argument("--json-out", default=None, help="append the JSON lines to this file too")
    args = p.parse_args(argv)
    from cpu_decode_step import _worker

    w = _worker(1)
    for lp in args.logprobs:
        line = json.dumps(bench(w, args.batch, args.steps, None if lp == "none" else int(lp)))
        print(line, flush=True)
        if args.json_out:
            with open(args.json_out, "a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
