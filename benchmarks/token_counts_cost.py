"""CPU cost of counting ``vllm:generation_tokens_total`` / ``prompt_tokens_total`` per engine step (session 25,
METRICS2) against the same work in another checkout (``--base TREE``: e.g. a worktree of the commit before),
alternating A/B turn by turn, each part in a fresh process (``PYTHONPATH`` = the tree), ``time.process_time()``
(this process's CPU seconds, which the machine's load moves least), not wall time:

* ``op_stream``: :meth:`OutputProcessor.process` for 256 streamed requests x 64 steps of one token (no tokenizer:
  the bookkeeping alone, where the added count is the largest share), microseconds per request and step;
* ``op_plain``: the same for 256 requests that are not streamed, ``--tokens`` tokens each: the base tree gets
  what its core sent (one final delta with every token), this tree what its core sends now (a progress delta
  every ``--per-delta`` tokens: every ``PROGRESS_EVERY_S`` = 1 s at that many steps a second, then the final
  one); microseconds per request (the whole request);
* ``core_plain``: :meth:`EngineCore.step` in delta mode over a stub engine (one token per sequence and step, no
  model) with 256 requests that are not streamed, 64 steps, a progress pass forced every ``--progress-every``
  steps (the real cadence is ``PROGRESS_EVERY_S`` of wall time; the base tree has none; ``--progress-every 1``
  gives one pass's cost per step); microseconds per step;
* ``metrics``: ``ServerMetrics.record_request`` (in memory), then this tree's ``add_tokens`` (one call per
  core message), microseconds per call.

    python benchmarks/token_counts_cost.py --base /tmp/wt-base --turns 3 --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r'''
import json, sys, time
from types import SimpleNamespace
part, tokens, per_delta, progress_every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
from rlserve.engine import core_protocol as proto
from rlserve.engine.sampling_params import SamplingParams
R = 256

def best(fn, reps=5):
    runs = []
    for _ in range(reps):
        t0 = time.process_time()
        n = fn()
        runs.append((time.process_time() - t0) / n * 1e6)
    return min(runs)

if part in ("op_stream", "op_plain"):
    from rlserve.engine.front.output_processor import OutputProcessor
    stream = part == "op_stream"
    params = SamplingParams(max_tokens=10 ** 6, ignore_eos=True)
    reqs = {f"r{i}": SimpleNamespace(prompt=None, params=params, stream=stream, arrival_time=0.0) for i in range(R)}
    new = hasattr(OutputProcessor, "take_counts")
    if stream:
        chunks, per = [1] * 64, R * 64
    else:
        chunks = [per_delta] * (tokens // per_delta) if new else [tokens]
        per = R
    msgs = []
    for k, c in enumerate(chunks):
        last = k == len(chunks) - 1 and not stream
        msgs.append([proto.RequestDelta(rid, [proto.SampleDelta(0, [7] * c, [-1.0] * c, None,
                                                                "length" if last else None)], last, ["0"], 1.0,
                                        proto.RequestStart([5] * 16) if k == 0 else None) for rid in reqs])

    def run():
        op = OutputProcessor(None)
        for deltas in msgs:
            op.process(deltas, reqs)
            if new:
                op.take_counts()
        return per
    print(json.dumps({"us": best(run)}))
elif part == "core_plain":
    from rlserve.engine.core import engine_core

    class Seq:
        def __init__(self):
            self.index, self.output_token_ids, self.finish_reason, self.stop_reason = 0, [], None, None
            self.sampled_logprobs, self.logprobs, self.streamed = None, None, False

    class Req:
        def __init__(self):
            self.seqs, self.prompt_token_ids, self.prompt_logprobs, self.extra = [Seq()], [5] * 16, None, {}

    class Engine:
        routed_experts, detokenize = None, True
        def __init__(self):
            self.requests, self.last_step_request_ids = {}, []
        def add_request(self, rid, prompt, params):
            self.requests[rid] = Req()
        def step(self, outputs_for=None):
            for r in self.requests.values():
                r.seqs[0].output_token_ids.append(7)
            self.last_step_request_ids = list(self.requests)
            return []
        def has_unfinished_requests(self):
            return bool(self.requests)

    params = SamplingParams(max_tokens=10 ** 6, ignore_eos=True)

    def run():
        core = engine_core.EngineCore(Engine(), deltas=True)
        for i in range(R):
            core.add(f"r{i}", [5] * 16, params, stream=False)
        for k in range(64):
            if hasattr(core, "_progress_time"):  # the 0.2 s cadence, by steps here
                core._progress_time = -1e9 if k % progress_every == progress_every - 1 else time.monotonic()
            core.step()
        return 64
    print(json.dumps({"us": best(run)}))
else:
    from rlserve.server.metrics import ServerMetrics
    m = ServerMetrics("m", 4096)
    args = ("completions", ["length"], 40, 100, 1.2, 0.05)
    kw = dict(decode_s=1.1, sample_tokens=[100], n=1, max_tokens=100, timing=(0.0, 0.01, 0.05, 1.2))
    calls = 20000

    def record():
        for _ in range(calls):
            m.record_request(*args, **kw)
        return calls
    out = {"record_request_us": best(record)}
    if hasattr(m, "add_tokens"):
        def add():
            for _ in range(calls):
                m.add_tokens(256, 3)
            return calls
        out["add_tokens_us"] = best(add)
    print(json.dumps(out))
'''


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="the other checkout (A); this one is B")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--per-delta", type=int, default=50)
    ap.add_argument("--progress-every", type=int, default=1)
    ap.add_argument("--out")
    a = ap.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"base": os.path.abspath(a.base), "this": here}
    runs = []
    for turn in range(a.turns):
        for part in ("op_stream", "op_plain", "core_plain", "metrics"):
            for name in (("base", "this") if turn % 2 == 0 else ("this", "base")):  # alternate A/B
                env = dict(os.environ, PYTHONPATH=trees[name])
                out = subprocess.run([sys.executable, "-c", CHILD, part, str(a.tokens), str(a.per_delta),
                                      str(a.progress_every)], capture_output=True, text=True, check=True, env=env,
                                     cwd=trees[name]).stdout
                runs.append({"turn": turn, "part": part, "tree": name, **json.loads(out)})
                print(runs[-1], flush=True)
    result = {"args": vars(a), "load_average_end": os.getloadavg(), "runs": runs}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
