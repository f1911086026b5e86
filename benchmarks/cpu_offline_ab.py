"""A/B of rlserve source trees on the CPU engine (offline), runs alternating, CPU time recorded.

On a shared machine wall time mostly measures the other work; the CPU time of a one-thread
engine stays close to what the code costs. So each run reports both, with the load average,
and the trees alternate (A, B, A, B, ...) so that the machine's load hits them alike.

Each run is a fresh process per tree (``PYTHONPATH=<tree>``) on the default model
(SmolLM2-135M-Instruct float32 from rlserve's cache; ``rlserve download`` builds it), the
engine's default threads (one on 2 cores):

- throughput: ``--num-prompts`` random token-id prompts of 64-256 tokens, ``max_tokens``
  16-32 each, ``ignore_eos``, greedy, all submitted at once (issue 22's workload, shortened
  as in BENCHMARKS.md): output tokens per wall second and per CPU second;
- batch 1: one 64-token prompt, 33 tokens (its prefill included), CPU and wall ms per token.

The first four greedy ids of prompt 0 are printed so that runs can be seen to agree.

Usage (a tree is any checkout, e.g. ``git archive main | tar -x -C /tmp/base``):
    python benchmarks/cpu_offline_ab.py --trees /tmp/base . --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_CHILD = r"""
import json, os, random, time
from rlserve.engine.llm import LLM
from rlserve.engine.sampling_params import SamplingParams
n, model = int(os.environ["AB_N"]), os.environ["AB_MODEL"]
rng = random.Random(0)
prompts = [[rng.randrange(100, 49000) for _ in range(rng.randint(64, 256))] for _ in range(n)]
params = [SamplingParams(temperature=0, max_tokens=rng.randint(16, 32), ignore_eos=True) for _ in range(n)]
llm = LLM(model, dtype="float32", device="cpu")
llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=2))
load = os.getloadavg()[0]
c0, w0 = time.process_time(), time.perf_counter()
outs = llm.generate(prompts, params)
c1, w1 = time.process_time(), time.perf_counter()
ntok = sum(len(o.outputs[0].token_ids) for o in outs)
p1 = [rng.randrange(100, 49000) for _ in range(64)]
llm.generate([p1], SamplingParams(temperature=0, max_tokens=1))
c2, w2 = time.process_time(), time.perf_counter()
llm.generate([p1[::-1]], SamplingParams(temperature=0, max_tokens=33, ignore_eos=True))
c3, w3 = time.process_time(), time.perf_counter()
print("AB " + json.dumps({"load": round(load, 2), "tokens": ntok, "cpu_s": round(c1 - c0, 2),
                          "wall_s": round(w1 - w0, 2), "tok_per_cpu_s": round(ntok / (c1 - c0), 2),
                          "tok_per_s": round(ntok / (w1 - w0), 2),
                          "b1_cpu_ms_per_tok": round((c3 - c2) / 33 * 1e3, 1),
                          "b1_wall_ms_per_tok": round((w3 - w2) / 33 * 1e3, 1),
                          "first_ids": outs[0].outputs[0].token_ids[:4]}), flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", required=True, help="rlserve source trees, run in this order each rep")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--model", default=None, help="model dir (default: rlserve's cached SmolLM2-135M-Instruct)")
    ap.add_argument("--json", default=None, help="append one JSON line per run here")
    args = ap.parse_args()
    model = args.model
    if model is None:
        from rlserve.download import default_cache_root

        model = str(default_cache_root() / "SmolLM2-135M-Instruct")
    for rep in range(args.reps):
        for tree in args.trees:
            tree = os.path.abspath(tree)
            env = dict(os.environ, PYTHONPATH=tree, AB_N=str(args.num_prompts), AB_MODEL=model)
            r = subprocess.run([sys.executable, "-c", _CHILD], cwd=tree, env=env, capture_output=True, text=True)
            line = next((ln[3:] for ln in r.stdout.splitlines() if ln.startswith("AB ")), None)
            if line is None:
                print(f"{tree}: run failed (exit {r.returncode}): {r.stderr[-2000:]}", flush=True)
                continue
            rec = {"rep": rep, "tree": tree, **json.loads(line)}
            print(json.dumps(rec), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
