"""rlserve's offline engine against vLLM CPU's, one process each, same prompts: CPU time.

Where does vLLM CPU's speed come from: its kernels, or its share of the machine? Each
engine runs in its own process (rlserve from this tree in this interpreter; vLLM from
``--vllm-python``, in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the process's CPU
time is all of its work), one OpenMP thread (``OMP_NUM_THREADS=1``), SmolLM2-135M-Instruct
float32 from rlserve's cache, and reports the CPU seconds of the process
(``getrusage``) for:

- prefill: 16 random-id prompts of 64-256 tokens, one output token each;
- a batch: 16 other such prompts, ``max_tokens`` 16-32, ``ignore_eos`` (as
  ``benchmarks/cpu_offline_ab.py``);
- batch 1: a 64-token prompt, 33 tokens, CPU ms per token.

vLLM runs compiled (its default on CPU: inductor, 5-8 minutes of start-up here) or, with
``--vllm-eager``, eager. The first greedy ids are printed so that the engines can be seen to
agree. Runs alternate (rlserve, vLLM, rlserve, ...) with the load average recorded.

Usage:
    python benchmarks/cpu_offline_vs_vllm.py --vllm-python /work/venv-vllm/bin/python [--vllm-eager] [--reps 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_COMMON = r"""
import json, os, random, resource, time
n = 16
rng = random.Random(0)
prompts = [[rng.randrange(100, 49000) for _ in range(rng.randint(64, 256))] for _ in range(n)]
mts = [rng.randint(16, 32) for _ in range(n)]
pre = [[rng.randrange(100, 49000) for _ in range(rng.randint(64, 256))] for _ in range(n)]
p1 = [rng.randrange(100, 49000) for _ in range(64)]
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
def measure(gen, startup_s):
    gen([[1, 2, 3, 4]], [2], False)
    c0 = cpu(); w0 = time.perf_counter(); gen(pre, [1] * n, False); c1 = cpu(); w1 = time.perf_counter()
    load = os.getloadavg()[0]
    outs = gen(prompts, mts, True); c2 = cpu(); w2 = time.perf_counter()
    gen([p1], [1], False); c3 = cpu()
    gen([p1[::-1]], [33], True); c4 = cpu()
    print("RESULT " + json.dumps({"load": round(load, 2), "startup_s": round(startup_s, 1),
          "prefill_tokens": sum(map(len, pre)), "prefill_cpu_s": round(c1 - c0, 2), "prefill_wall_s": round(w1 - w0, 2),
          "batch_tokens": sum(len(o) for o in outs), "batch_cpu_s": round(c2 - c1, 2), "batch_wall_s": round(w2 - w1, 2),
          "b1_cpu_ms_per_tok": round((c4 - c3) / 33 * 1e3, 1), "first_ids": list(outs[0][:4])}), flush=True)
"""

_RLSERVE = _COMMON + r"""
from rlserve.engine.llm import LLM
from rlserve.engine.sampling_params import SamplingParams
t0 = time.perf_counter()
llm = LLM(os.environ["OV_MODEL"], dtype="float32", device="cpu")
def gen(ps, mt, eos):
    outs = llm.generate(ps, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=eos) for m in mt])
    return [o.outputs[0].token_ids for o in outs]
measure(gen, time.perf_counter() - t0)
"""

_VLLM = _COMMON + r"""
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
t0 = time.perf_counter()
llm = LLM(os.environ["OV_MODEL"], dtype="float32", enforce_eager=os.environ["OV_EAGER"] == "1",
          kv_cache_memory_bytes=1 << 30, max_num_seqs=64)
def gen(ps, mt, eos):
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps],
                        [SamplingParams(temperature=0, max_tokens=m, ignore_eos=eos) for m in mt], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]
measure(gen, time.perf_counter() - t0)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default=os.environ.get("RLSERVE_BENCH_VLLM_PYTHON"))
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM without its inductor compile")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    from rlserve.download import default_cache_root

    model = args.model or str(default_cache_root() / "SmolLM2-135M-Instruct")
    engines = [("rlserve", sys.executable, _RLSERVE, dict(os.environ, PYTHONPATH=root))]
    if args.vllm_python and subprocess.run([args.vllm_python, "-c", "import vllm"], capture_output=True).returncode == 0:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", OV_EAGER="1" if args.vllm_eager else "0")
        engines.append(("vllm" + ("-eager" if args.vllm_eager else ""), args.vllm_python, _VLLM, env))
    else:
        print("SKIPPED vLLM: no --vllm-python that imports vllm", flush=True)
    for rep in range(args.reps):
        for name, python, code, env in engines:
            env = dict(env, OV_MODEL=model, OMP_NUM_THREADS="1")
            r = subprocess.run([python, "-c", code], env=env, cwd="/tmp", capture_output=True, text=True)
            line = next((ln[7:] for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                print(f"{name}: failed (exit {r.returncode}): {r.stderr[-2000:]}", flush=True)
                continue
            print(json.dumps({"rep": rep, "engine": name, **json.loads(line)}), flush=True)


if __name__ == "__main__":
    main()
