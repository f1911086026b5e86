"""Batch-invariant mode (issue 39): where results depend on the batch, and what the mode costs.

``probe``: the experiment behind ``rlserve/batch_invariant/cpu.py`` (and, on CUDA, the GEMM
half of ``gpu.py``): for GEMM shapes ``[M, K] x [K, N]``, is row ``i`` of ``X @ W`` bitwise
``X[i:i+1] @ W`` for every row count M? For each way of computing it (CPU: MKL ``F.linear``,
oneDNN on the plain weight, oneDNN on the pre-packed weight, the mode's ``linear``; CUDA:
cuBLAS ``F.linear``, cuBLASLt with split-K forbidden, the Triton GEMM) it prints
the row counts whose rows differ from the one-row result (``CUBLASLT_WORKSPACE_SIZE`` and
``CUBLAS_WORKSPACE_CONFIG`` are cuBLAS's own variables: set them before the run to try those).

``cost``: an offline workload with the mode off and on (``--modes``: also variants of the
mode's GEMM and prefill attention), alternating fresh processes (A, B, A, B, ...) so the
machine's load hits both alike, dummy weights of a real model's shape
(``benchmarks/model_shapes.py``): ``--num-prompts`` random prompts of ``--input-len`` tokens
(+-50%), ``--output-len`` tokens each (+-50%), ``ignore_eos``, temperature 0.8 seeded, all
submitted at once. Reports output tokens per wall second, CPU seconds (the engine's process),
whether the on-mode runs gave the same tokens every time, and whether the first prompt run
alone afterwards gives bitwise its tokens and logprobs in the batch (off: the control).
``--profile-dir``: a second, profiled pass of the off and on runs (torch profiler: top kernels
by device time, or CPU ops on CPU).

``gemm`` (CUDA): where the mode's GEMM time goes, per linear layer of a model shape and row
count M (decode batches 1 / 64 / 256, a prefill chunk): cuBLAS ``F.linear`` (the mode off), the
mode's Triton GEMM with session 13's fixed tile per (N, K) (``triton``) and with the tile by M
(``triton_m``, the default), ``--all-tiles``: every tile of ``rlserve.batch_invariant.gpu.TILES``
forced; ``triton.testing.do_bench`` medians (us), and per M the sum over one forward step
(each layer's time x its count), the mode's time over cuBLAS's.

Usage:
    python benchmarks/batch_invariant.py probe [--device cuda]
    python benchmarks/batch_invariant.py cost --shape smollm2-135m --device cpu --reps 2 --json out.jsonl
    python benchmarks/batch_invariant.py gemm --shapes qwen3-0.6b,qwen3-8b --ms 1,64,256,4096 --json out.jsonl
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
hi = min(30000, a.get("vocab", 30000))
prompts = [[rng.randrange(min(100, hi // 2), hi) for _ in range(around(a["input_len"]))] for _ in range(a["num_prompts"])]
params = [SamplingParams(temperature=0.8, seed=i, max_tokens=around(a["output_len"]), ignore_eos=True, logprobs=0)
          for i in range(a["num_prompts"])]
from rlserve.batch_invariant import cpu as bi_cpu, gpu as bi_gpu, query_tiles as bi_tiles
bi_gemm = bi_cpu.GEMM if a["device"] == "cpu" else bi_gpu.GEMM  # CPU: fma / onednn; CUDA: triton_m / triton / cublaslt
bi_gemm[0] = a.get("gemm") or bi_gemm[0]
bi_tiles.FORM[0] = a.get("attn") or "tiles"
if a.get("table"):  # a GEMM table (benchmarks/bi_gemm_sweep.py --table-out) for this GPU
    from rlserve.batch_invariant import gemm_table
    gemm_table.use(torch.cuda.get_device_name() if a["device"] != "cpu" else "cpu", a["table"])
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
def tl(o):
    return [o.outputs[0].token_ids, [d[t] for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]]
h = hashlib.sha256()
for o in outs:
    h.update(json.dumps(tl(o)).encode())
res = {"batch_invariant": a["batch_invariant"], "gemm": bi_gemm[0], "attn": bi_tiles.FORM[0], "table": a.get("table"),
       "load": round(load, 2), "tokens": ntok, "wall_s": round(w1 - w0, 3), "cpu_s": round(c1 - c0, 2),
       "tok_per_s": round(ntok / (w1 - w0), 1), "digest": h.hexdigest()[:16]}
if a.get("check_alone"):  # prompts[0] alone: bitwise its output in the batch? (the mode's promise)
    res["alone_equal_in_batch"] = tl(llm.generate([prompts[0]], [params[0]])[0]) == tl(outs[0])
print("BI " + json.dumps(res), flush=True)
if a.get("profile"):  # a per-kernel profile of the same workload (a second pass, profiled)
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a["device"] != "cpu" else [])
    with profile(activities=acts) as prof:
        llm.generate(prompts, params)
        if a["device"] != "cpu":
            torch.cuda.synchronize()
    key = "self_device_time_total" if a["device"] != "cpu" else "self_cpu_time_total"
    ka = prof.key_averages()
    with open(a["profile"] + ".txt", "w") as f:
        f.write(ka.table(sort_by=key, row_limit=40, max_name_column_width=90))
    rows = sorted(({"name": e.key, "calls": e.count, "self_us": round(getattr(e, key), 1),
                    "kernel": str(e.device_type) != "DeviceType.CPU"} for e in ka), key=lambda r: -r["self_us"])
    # on CUDA the device events (kernels, copies) alone: a CPU op's self device time repeats its kernels'
    kern = [r for r in rows if r["kernel"]]
    if a["device"] != "cpu" and kern:
        rows = kern
    total = sum(r["self_us"] for r in rows)
    with open(a["profile"] + ".json", "w") as f:
        json.dump({"sort": key, "kernels_total_us": round(total, 1), "top": rows[:40]}, f, indent=1)
"""


def probe(args) -> None:
    import torch
    import torch.nn.functional as F

    from rlserve.batch_invariant import ops
    from rlserve.layers.cpu_linear import pack_weight

    dev = torch.device(args.device)
    torch.manual_seed(0)
    rows = [1, 2, 3, 5, 8, 16, 17, 31, 32, 33, 64, 65, 128, 129, 256, 257, 513, 1024, 2100]
    shapes = [(576, 192), (1536, 576), (576, 49152 // 4), (4096, 1024), (1024, 3072), (3072, 1024)]
    if dev.type == "cuda":  # Qwen3-8B's q/k/v, gate/up, down, LM head
        shapes += [(4096, 6144), (4096, 24576), (12288, 4096), (4096, 151936)]
    for K, N in shapes:
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
            from rlserve.batch_invariant import gpu

            def nosplit(v):
                with gpu.no_split_k():
                    return F.linear(v, w)

            ways["cublaslt_no_split_k"] = nosplit
            for g in ("triton", "triton_m"):
                ways[g] = lambda v, g=g: _with_gemm(g, gpu.linear, v, w)
        for name, fn in ways.items():
            one = torch.cat([fn(x[i:i + 1]) for i in range(0, max(rows), 97)])
            bad = [m for m in rows[1:] if not torch.equal(fn(x[:m])[::97], one[:len(range(0, m, 97))])]
            print(f"K={K} N={N} {name}: rows differ from M=1 at M in {bad}", flush=True)


def _with_gemm(name: str, fn, *args, **kw):
    """``fn(*args, **kw)`` with ``rlserve.batch_invariant.gpu.GEMM`` set to ``name``, restored after."""
    from rlserve.batch_invariant import gpu

    gpu.GEMM[0], prev = name, gpu.GEMM[0]
    try:
        return fn(*args, **kw)
    finally:
        gpu.GEMM[0] = prev


def linear_shapes(shape: str) -> list[tuple[str, int, int, int]]:
    """``(name, K, N, count per forward step)`` of a dense model shape's linear layers (q/k/v
    fused, gate/up fused, the LM head once), from ``benchmarks/model_shapes.py``."""
    from benchmarks.model_shapes import shape_config

    c = shape_config(shape)
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    L, H = c.num_hidden_layers, c.hidden_size
    return [("qkv", H, (c.num_attention_heads + 2 * c.num_key_value_heads) * hd, L),
            ("o", c.num_attention_heads * hd, H, L), ("gate_up", H, 2 * c.intermediate_size, L),
            ("down", c.intermediate_size, H, L), ("lm_head", H, c.vocab_size, 1)]


def gemm_table(args) -> None:
    import torch
    import torch.nn.functional as F

    from rlserve.batch_invariant import gpu

    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dev.type == "cuda":
        from triton.testing import do_bench

        def bench(fn):
            return 1000 * do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median")
    else:  # the dry run: the interpreter, one call timed
        import time

        def bench(fn):
            t = time.perf_counter()
            fn()
            return 1e6 * (time.perf_counter() - t)
    ms = [int(m) for m in args.ms.split(",")]
    for shape in args.shapes.split(","):
        layers = linear_shapes(shape)
        for M in ms:
            step: dict[str, float] = {}
            for name, K, N, count in layers:
                g = torch.Generator(device=dev).manual_seed(K + N)
                w = torch.randn(N, K, device=dev, dtype=dtype, generator=g)
                x = torch.randn(M, K, device=dev, dtype=dtype, generator=g)
                ways = {"cublas": lambda: F.linear(x, w),
                        "triton": lambda: _with_gemm("triton", gpu.linear, x, w),
                        "triton_m": lambda: _with_gemm("triton_m", gpu.linear, x, w)}
                if args.all_tiles and dtype != torch.float32:
                    for t in gpu.TILES:
                        ways[f"{t[0]}x{t[1]}"] = lambda t=t: gpu.linear(x, w, tile_shape=t)
                us = {k: round(bench(fn), 1) for k, fn in ways.items()}
                picked = gpu.tile(M, N, K, dtype, gpu._num_sms(dev))
                row = {"shape": shape, "layer": name, "M": M, "K": K, "N": N, "count": count, "us": us,
                       "triton_m_tile": f"{picked['BLOCK_M']}x{picked['BLOCK_N']}",
                       "gb_per_s_cublas": round(2 * N * K / us["cublas"] / 1e3, 1) if us["cublas"] else None}
                print("GEMM " + json.dumps(row), flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(row) + "\n")
                for k, v in us.items():
                    step[k] = step.get(k, 0.0) + v * count
            tot = {k: round(v, 1) for k, v in step.items()}
            print(f"STEP {shape} M={M}: GEMM us per forward step " + ", ".join(
                f"{k} {v} ({(v / tot['cublas'] - 1) * 100:+.1f}%)" for k, v in tot.items()), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps({"shape": shape, "M": M, "step_gemm_us": tot}) + "\n")


def parse_modes(spec: str) -> list[dict]:
    """``"off,on,on:gemm=triton,on:attn=per_query"`` -> one dict per run in a round: ``on``
    (the mode), ``gemm`` (``rlserve.batch_invariant.gpu.GEMM``, on CPU ``cpu.GEMM``), ``attn``
    (``rlserve.batch_invariant.query_tiles.FORM``) and ``team`` (CPU: the engine's team size,
    ``extra["cpu_team"]``; ``on:gemm=onednn:team=1`` is session 13's CPU mode) and ``table`` (CUDA:
    a GEMM table's JSON, ``benchmarks/bi_gemm_sweep.py --table-out``, for this GPU), None = the default.

    Raises:
        ValueError: a run that is not ``off`` / ``on`` or a key other than gemm / attn / team / table."""
    out = []
    for item in spec.split(","):
        head, *kvs = item.strip().split(":")
        if head not in ("off", "on"):
            raise ValueError(f"mode {item!r}: starts with off or on")
        m = {"on": head == "on", "gemm": None, "attn": None, "team": None, "table": None}
        for kv in kvs:
            k, _, v = kv.partition("=")
            if k not in ("gemm", "attn", "team", "table") or not v or (k == "team" and not v.isdigit()):
                raise ValueError(f"mode {item!r}: gemm=..., attn=..., table=PATH or team=<int>")
            m[k] = v
        m["label"] = item.strip()
        out.append(m)
    return out


def cost(args) -> None:
    from benchmarks.model_shapes import save_shape, shape_config

    root = tempfile.mkdtemp(prefix="bi_shape_")
    model = save_shape(args.shape, root)
    vocab = shape_config(args.shape).vocab_size
    extra_kw = json.loads(args.engine_kw) if args.engine_kw else {}
    modes = parse_modes(args.modes)
    digests: dict[str, set] = {m["label"]: set() for m in modes}
    results: dict[str, list] = {m["label"]: [] for m in modes}
    for rep in range(args.reps):
        for m in modes:
            prof = None
            if args.profile_dir and rep == 0 and m["label"] in ("off", "on"):
                os.makedirs(args.profile_dir, exist_ok=True)
                prof = os.path.join(args.profile_dir, f"profile-{args.shape}-{m['label']}")
            kw = dict(extra_kw)
            if m["team"]:
                kw["extra"] = {**kw.get("extra", {}), "cpu_team": int(m["team"])}
            a = dict(model=model, dtype=args.dtype, device=args.device, batch_invariant=m["on"],
                     num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                     max_num_seqs=args.max_num_seqs, extra_kw=kw, gemm=m["gemm"], attn=m["attn"], table=m["table"],
                     check_alone=rep == 0, profile=prof, vocab=vocab)
            env = dict(os.environ, BI_ARGS=json.dumps(a), PYTHONPATH=os.getcwd())
            try:
                r = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True,
                                   timeout=args.run_timeout)
            except subprocess.TimeoutExpired:
                print(f"run {m['label']} timed out after {args.run_timeout} s", flush=True)
                continue
            line = next((ln[3:] for ln in r.stdout.splitlines() if ln.startswith("BI ")), None)
            if line is None:
                print(f"run {m['label']} failed (exit {r.returncode}): {r.stderr[-3000:]}", flush=True)
                continue
            res = json.loads(line)
            res.update(mode=m["label"], rep=rep, shape=args.shape, device=args.device, dtype=args.dtype,
                       num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len)
            print(json.dumps(res), flush=True)
            digests[m["label"]].add(res["digest"])
            results[m["label"]].append(res)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(res) + "\n")
    if not results.get("off"):
        return

    def median(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2]

    off_wall = median([r["wall_s"] for r in results["off"]])
    off_cpu = median([r["cpu_s"] for r in results["off"]])
    for label, rs in results.items():
        if label == "off" or not rs:
            continue
        wall, cpu = median([r["wall_s"] for r in rs]), median([r["cpu_s"] for r in rs])
        summary = {"shape": args.shape, "device": args.device, "mode": label, "median_wall_s_off": off_wall,
                   "median_wall_s_on": wall, "wall_cost_pct": round((wall / off_wall - 1) * 100, 1),
                   "median_cpu_s_off": off_cpu, "median_cpu_s_on": cpu,
                   "cpu_cost_pct": round((cpu / off_cpu - 1) * 100, 1),
                   "on_runs_identical": len(digests[label]) == 1,
                   "alone_equal_in_batch": [r.get("alone_equal_in_batch") for r in rs if "alone_equal_in_batch" in r],
                   "off_alone_equal_in_batch": [r.get("alone_equal_in_batch") for r in results["off"]
                                                if "alone_equal_in_batch" in r]}
        print("SUMMARY " + json.dumps(summary), flush=True)
        print(f"COST {args.shape} {label}: {wall} s vs off {off_wall} s = {summary['wall_cost_pct']:+}% wall, "
              f"alone = in batch: on {summary['alone_equal_in_batch']}, off {summary['off_alone_equal_in_batch']}",
              flush=True)
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
    c.add_argument("--modes", default="off,on",
                   help="runs of a round, e.g. off,on,on:gemm=triton,on:attn=per_query (parse_modes)")
    c.add_argument("--profile-dir", default=None,
                   help="profile the off and on runs of the first round (torch profiler, top kernels) here")
    c.add_argument("--run-timeout", type=float, default=900, help="seconds one run may take")
    c.add_argument("--json", default=None, help="append one JSON line per run here")
    gm = sub.add_parser("gemm")
    gm.add_argument("--device", default="cuda")
    gm.add_argument("--shapes", default="qwen3-0.6b,qwen3-8b")
    gm.add_argument("--ms", default="1,64,256,4096", help="row counts M")
    gm.add_argument("--all-tiles", action="store_true", help="also every tile of gpu.TILES, forced")
    gm.add_argument("--warmup-ms", type=float, default=5)
    gm.add_argument("--rep-ms", type=float, default=20)
    gm.add_argument("--json", default=None, help="append one JSON line per (layer, M) and per step here")
    args = ap.parse_args()
    {"probe": probe, "cost": cost, "gemm": gemm_table}[args.cmd](args)


if __name__ == "__main__":
    main()
