"""CPU time of :meth:`~rlserve.engine.front.output_processor.OutputProcessor.process` alone, without a tokenizer
(no detokenization: what the per-step bookkeeping costs, at its largest share of the API process's output work):
256 streamed requests x 64 steps, one token each, every delta of weight version "0" (``--switch-at K``: of "1"
from step K on, so that every sample's outputs from then on carry two version marks, as after a weight update
mid-generation). Prints the best of ``REPS`` (default 7) ``time.process_time()`` figures per request and step,
in microseconds, and all of them.

Written for session 22's weight-version marks (``CompletionOutput.version_marks``); compare two checkouts by
alternating them (``PYTHONPATH=TREE python benchmarks/output_processor_bare.py 7``), or count instructions under
``valgrind --tool=callgrind`` with 1 and 3 repetitions (their difference over 2 is one repetition's)."""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

from rlserve.engine import core_protocol as proto
from rlserve.engine.front.output_processor import OutputProcessor
from rlserve.engine.sampling_params import SamplingParams

REQUESTS, STEPS = 256, 64


def main(reps: int, switch_at: int | None = None) -> dict:
    params = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    reqs = {f"r{i}": SimpleNamespace(prompt=None, params=params, stream=True, arrival_time=0.0)
            for i in range(REQUESTS)}

    def versions(k: int) -> list[str]:
        return ["1"] if switch_at is not None and k >= switch_at else ["0"]

    steps = [[proto.RequestDelta(rid, [proto.SampleDelta(0, [7], [-1.0])], False, versions(k), 1.0,
                                 proto.RequestStart([5] * 16) if k == 0 else None) for rid in reqs]
             for k in range(STEPS)]
    runs = []
    for _ in range(reps):
        op = OutputProcessor(None)
        t0 = time.process_time()
        for deltas in steps:
            op.process(deltas, reqs)
        runs.append((time.process_time() - t0) / (REQUESTS * STEPS) * 1e6)
    return {"us_per_request_step_best": round(min(runs), 3), "all": [round(x, 3) for x in runs]}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reps", nargs="?", type=int, default=7)
    p.add_argument("--switch-at", type=int, default=None, metavar="K",
                   help="deltas of steps K.. carry weight version '1' (two version marks per sample from then on)")
    a = p.parse_args()
    print(json.dumps(main(a.reps, a.switch_at)))
