"""Batch-invariant mode (issue 39): where results depend on the batch, and what the mode costs.

``probe``: the experiment behind ``rlserve/batch_invariant/cpu.py`` (and, on CUDA, the GEMM
half of ``gpu.py``): for GEMM shapes ``[M, K] x [K, N]``, is row ``i`` of ``X @ W`` bitwise
``X[i:i+1] @ W`` for every row count M? For each way of computing it (CPU: MKL ``F.linear``,
oneDNN on the plain weight, oneDNN on the pre-packed weight, the mode's ``linear``; CUDA:
cuBLAS ``F.linear`` and the mode's Triton GEMM) it prints the row counts whose rows differ
from the one-row result.

``cost``: an offline workload with the mode off and on, alternating fresh processes (A, B, A,
B, ...) so the machine's load hits both alike, dummy weights of a real model's shape
(``benchmarks/model_shapes.py``): ``--num-prompts`` random prompts of ``--input-len`` tokens
(+-50%), ``--output-len`` tokens each (+-50%), ``ignore_eos``, temperature 0.8 seeded, all
submitted at once. Reports output tokens per wall second, CPU seconds (the engine's process),
and whether the on-mode runs gave the same tokens every time.

Usage:
    python benchmarks/batch_invariant.py probe [--device cuda]
    python benchmarks/batch_invariant.py cost --shape smollm2-135m --device cpu --reps 2 --json out.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_CHILD = r"""
import hashlib, json, os, random, sys, time
import torch
from rlserve.engine.llm import LLM
from rlserve.engine.sampling_params import SamplingParams
a = json.loads(os.environ["BI_ARGS"])
rng = random.Random(0)
def around(n):
    return max(1, rng.randint(n // 2, n + n // 2))
prompts = [[rng.randrange(100, 30000) for _ in range(around(a["input_len"]))] for _ in range(a["num_prompts"])]
params = [SamplingParams(temperature=0.8, seed=i, max_tokens=around(a["output_len"]), ignore_eos=True, logprobs=0)
          for i in range(a["num_prompts"])]
llm = LLM(a["model"], dtype=a["dtype"], device=a["device"], load_format="dummy", skip_tokenizer_init=True,
          batch_invariant=a["batch_invariant"], max_num_seqs=a["max_num_seqs"], **a["extra_kw"])
llm.generate([[1, 2, 3, 4]] * 4, SamplingParams(temperature=0, max_tokens=4))
load = os.getloadavg()[0]
if a["device"] != "cpu":
    torch.cuda.synchronize()
c0, w0 = time.process_time(), time.perf_counter()
outs = llm.generate(prompts, params)
if a["device"] != "cpu":
    torch.cuda.synchronize()
c1, w1 = time.process_time(), time.perf_counter()
ntok = sum(len(o.outputs[0].token_ids) for o in outs)
h = hashlib.sha256()
for o in outs:
    h.update(json.dumps([o.outputs[0].token_ids, [d[t] for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]]).encode())
print("BI " + json.dumps({"batch_invariant": a["batch_invariant"], "load": round(load, 2), "tokens": ntok,
                          "wall_s": round(w1 - w0, 3), "cpu_s": round(c1 - c0, 2),
                          "tok_per_s": round(ntok / (w1 - w0), 1), "digest": h.hexdigest()[:16]}), flush=True)
"""


def probe(args) -> None:
    import torch
    import torch.nn.functional as F

    from rlserve.batch_invariant import ops
    from rlserve.layers.cpu_linear import pack_weight

    dev = torch.device(args.device)
    torch.manual_seed(0)
    rows = [1, 2, 3, 5, 8, 16, 17, 31, 32, 33, 64, 65, 128, 129, 256, 257, 513, 1024, 2100]
    for K, N in ((576, 192), (1536, 576), (576, 49152 // 4), (4096, 1024), (1024, 3072), (3072, 1024)):
        dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
        w = torch.randn(N, K, device=dev, dtype=dtype)
        x = torch.randn(max(rows), K, device=dev, dtype=dtype)
        ways = {"F.linear": lambda v: F.linear(v, w)}
        if dev.type == "cpu":
            packed = pack_weight(w)
            ways["onednn"] = lambda v: torch.ops.mkldnn._linear_pointwise(v, w, None, "none", [], "")
            ways["onednn_packed"] = lambda v: torch.ops.mkldnn._linear_pointwise(v, packed, None, "none", [], "")
            ways["batch_invariant"] = lambda v: ops.linear(v, w, packed)
        else:
            ways["batch_invariant"] = lambda v: ops.linear(v, w)
        for name, fn in ways.items():
            one = torch.cat([fn(x[i:i + 1]) for i in range(0, max(rows), 97)])
            bad = [m for m in rows[1:] if not torch.equal(fn(x[:m])[::97], one[:len(range(0, m, 97))])]
            print(f"K={K} N={N} {name}: rows differ from M=1 at M in {bad}", flush=True)


def cost(args) -> None:
    from benchmarks.model_shapes import save_shape

    root = tempfile.mkdtemp(prefix="bi_shape_")
    model = save_shape(args.shape, root)
    extra_kw = json.loads(args.engine_kw) if args.engine_kw else {}
    digests: dict[bool, set] = {False: set(), True: set()}
    results: dict[bool, list] = {False: [], True: []}
    for rep in range(args.reps):
        for on in (False, True):
            a = dict(model=model, dtype=args.dtype, device=args.device, batch_invariant=on, num_prompts=args.num_prompts,
                     input_len=args.input_len, output_len=args.output_len, max_num_seqs=args.max_num_seqs,
                     extra_kw=extra_kw)
            env = dict(os.environ, BI_ARGS=json.dumps(a), PYTHONPATH=os.getcwd())
            r = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True)
            line = next((ln[3:] for ln in r.stdout.splitlines() if ln.startswith("BI ")), None)
            if line is None:
                print(f"run failed (exit {r.returncode}): {r.stderr[-3000:]}", flush=True)
                continue
            res = json.loads(line)
            res.update(rep=rep, shape=args.shape, device=args.device, dtype=args.dtype)
            print(json.dumps(res), flush=True)
            digests[on].add(res["digest"])
            results[on].append(res)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(res) + "\n")
    if results[False] and results[True]:
        def median(xs):
            xs = sorted(xs)
            return xs[len(xs) // 2]

        wall = {on: median([r["wall_s"] for r in results[on]]) for on in (False, True)}
        cpu = {on: median([r["cpu_s"] for r in results[on]]) for on in (False, True)}
        summary = {"shape": args.shape, "device": args.device, "median_wall_s_off": wall[False],
                   "median_wall_s_on": wall[True], "wall_cost_pct": round((wall[True] / wall[False] - 1) * 100, 1),
                   "median_cpu_s_off": cpu[False], "median_cpu_s_on": cpu[True],
                   "cpu_cost_pct": round((cpu[True] / cpu[False] - 1) * 100, 1),
                   "on_runs_identical": len(digests[True]) == 1}
        print("SUMMARY " + json.dumps(summary), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(summary) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("probe")
    p.add_argument("--device", default="cpu")
    c = sub.add_parser("cost")
    c.add_argument("--shape", default="smollm2-135m")
    c.add_argument("--device", default="cpu")
    c.add_argument("--dtype", default="float32")
    c.add_argument("--num-prompts", type=int, default=16)
    c.add_argument("--input-len", type=int, default=128)
    c.add_argument("--output-len", type=int, default=24)
    c.add_argument("--max-num-seqs", type=int, default=256)
    c.add_argument("--reps", type=int, default=2)
    c.add_argument("--engine-kw", default=None, help="JSON of more LLM(...) keyword arguments")
    c.add_argument("--json", default=None, help="append one JSON line per run here")
    args = ap.parse_args()
    probe(args) if args.cmd == "probe" else cost(args)


if __name__ == "__main__":
    main()
