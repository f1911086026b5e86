"""LoRA kernels on the GPU: where a decode step's LoRA cost goes (issue 36; session 16).

Two parts (``--parts``):

- ``ab``: the batched kernels (:mod:`rlserve.lora.triton_ops`) of one decode step of a whole model,
  in one CUDA graph per variant, in this process: every decoder layer's four LoRA-capable linears
  (Qwen3-8B: ``qkv_proj`` 4096 -> 6144 in 3 slices, ``o_proj`` 4096 -> 4096, ``gate_up_proj``
  4096 -> 24576 in 2 slices, ``down_proj`` 12288 -> 4096; ``--layers`` of them, each layer its own
  random slot buffers of ``--max-loras + 1`` slots at ``--rank``), ``--batch`` rows over
  ``--adapters`` adapters (row i on adapter i % n), the static segment grid of rlserve's LoRA decode
  graphs (one segment per slot, ``max_rows`` = batch). Variants: ``base`` (the layers' base GEMMs
  ``x W^T`` alone, random bf16 weights: what the LoRA work is added to), ``planes`` (base + today's
  kernels: split-K parts in planes, two launches per linear), ``atomic`` (base + session 15's form:
  a zero-fill launch, atomic split-K adds: three launches per linear). Microseconds per replay
  (CUDA events, median of ``--reps`` rounds of ``--iters`` replays, variants interleaved); before
  timing, ``planes`` and ``atomic`` are checked against a float32 reference on the first layer.
- ``profile``: an rlserve offline engine (``benchmarks/lora_gpu.py``'s model and adapters, dummy
  weights) decoding ``--batch`` prompts on the base model, then every request on one adapter
  (the per-row path: the one-adapter merge switched off), under ``torch.profiler``: per case, the
  GPU kernels of the decode steps grouped by name (launches and microseconds per decode step: a
  ``--steps + 1``-token run minus a 1-token run, over ``--steps``), so the LoRA kernels' share and
  launch count per step show (kernels inside CUDA graph replays are traced by CUPTI).

Usage (GPU): python benchmarks/lora_kernels.py --rank 16 --out lora-kernels-r16.json
CPU smoke run (Triton's interpreter, tiny shape): TRITON_INTERPRET=1 python benchmarks/lora_kernels.py
--device cpu --dims 64 96 32 --layers 2 --batch 4 --reps 1 --iters 1 --parts ab
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _linears(hidden: int, inter: int, kv: int) -> list[tuple[str, int, tuple[int, ...]]]:
    """``[(name, in, slice sizes)]`` of one decoder layer (q = hidden)."""
    return [("qkv", hidden, (hidden, kv, kv)), ("o", hidden, (hidden,)), ("gate_up", hidden, (inter, inter)),
            ("down", inter, (hidden,))]


def _layer_buffers(lins, slots: int, rank: int, dtype, device, g, base: bool) -> list[dict]:
    out = []
    for name, K, sizes in lins:
        N = sum(sizes)
        out.append({"name": name, "K": K, "offs": tuple(sum(sizes[:i]) for i in range(len(sizes))),
                    "a": (torch.randn(slots, len(sizes) * rank, K, generator=g, device=device) / K ** 0.5).to(dtype),
                    "b": (torch.randn(slots, N, rank, generator=g, device=device) * 0.01).to(dtype),
                    "w": (torch.randn(N, K, generator=g, device=device) / K ** 0.5).to(dtype) if base else None})
    return out


def ab(args) -> dict:
    """The ``ab`` part (module docstring)."""
    from rlserve.lora.layers import segments
    from rlserve.lora.triton_ops import lora_expand, lora_shrink

    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    cuda = dev.type == "cuda"
    hidden, inter, kv = args.dims
    lins = _linears(hidden, inter, kv)
    slots = args.max_loras + 1
    g = torch.Generator(device=dev).manual_seed(0)
    layers = [_layer_buffers(lins, slots, args.rank, dtype, dev, g, base=True) for _ in range(args.layers)]
    xs = {K: torch.randn(args.batch, K, generator=g, device=dev).to(dtype) for K in {hidden, inter}}
    seq = [i % args.adapters + 1 for i in range(args.batch)]
    rows, seg_start, seg_slot = segments(seq, [1] * args.batch, {a: a - 1 for a in range(1, args.adapters + 1)},
                                         num_slots=slots)
    rows += [0] * (args.batch - len(rows))
    meta = [torch.tensor(v, dtype=torch.int32, device=dev) for v in (rows, seg_start, seg_slot)]

    def step(variant):
        for layer in layers:
            for lin in layer:
                x = xs[lin["K"]]
                y = x @ lin["w"].t()
                if variant != "base":
                    t = lora_shrink(x, lin["a"], *meta, args.batch, atomic=variant == "atomic")
                    lora_expand(t, lin["b"], y, lin["offs"], *meta, args.batch)

    # correctness on layer 0 (float32 reference of the same bf16 operands)
    check = {}
    for variant in ("planes", "atomic"):
        worst = 0.0
        for lin in layers[0]:
            x = xs[lin["K"]]
            y = torch.zeros(args.batch, lin["w"].shape[0], dtype=dtype, device=dev)
            lora_expand(lora_shrink(x, lin["a"], *meta, args.batch, atomic=variant == "atomic"), lin["b"], y,
                        lin["offs"], *meta, args.batch)
            ref = torch.zeros_like(y, dtype=torch.float32)
            for i, a in enumerate(seq):
                tt = lin["a"][a - 1].float() @ x[i].float()
                for s, (o, n) in enumerate(zip(lin["offs"], [*lin["offs"][1:], y.shape[1]])):
                    ref[i, o:n] = lin["b"][a - 1, o:n].float() @ tt[s * args.rank:(s + 1) * args.rank]
            worst = max(worst, ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item())
        check[variant] = worst  # bf16: t rounded to bf16 before the expand, y stored in bf16: ~2 x 2^-8
    res = {"rank": args.rank, "batch": args.batch, "adapters": args.adapters, "layers": args.layers,
           "dims": args.dims, "max_rel_err_layer0": check, "launches_per_linear": {"planes": 2, "atomic": 3}}
    print(json.dumps(res), flush=True)
    variants = ["base", "planes", "atomic"]
    graphs = {}
    for v in variants:
        if cuda:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                step(v)  # compiles, allocator warm-up
            torch.cuda.current_stream().wait_stream(s)
            graphs[v] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[v]):
                step(v)
        else:
            step(v)
    times = {v: [] for v in variants}
    for _ in range(args.reps):
        for v in variants:
            if cuda:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(args.iters):
                    graphs[v].replay()
                e1.record()
                torch.cuda.synchronize()
                times[v].append(e0.elapsed_time(e1) * 1e3 / args.iters)
            else:
                t = time.perf_counter()
                for _ in range(args.iters):
                    step(v)
                times[v].append((time.perf_counter() - t) * 1e6 / args.iters)
    res["us_per_step"] = {v: round(statistics.median(x), 1) for v, x in times.items()}
    res["us_per_step_all"] = {v: [round(y, 1) for y in x] for v, x in times.items()}
    b = res["us_per_step"]["base"]
    res["lora_us"] = {v: round(res["us_per_step"][v] - b, 1) for v in ("planes", "atomic")}
    return res


def profile(args) -> dict:
    """The ``profile`` part (module docstring)."""
    from benchmarks.lora_gpu import _build, write_adapters
    from benchmarks.model_shapes import save_shape
    from rlserve.lora.model import lora_of

    path = os.path.join(args.model_dir, args.shape)
    if not os.path.exists(os.path.join(path, "config.json")):
        save_shape(args.shape, args.model_dir)
    adapter = write_adapters(path, args.rank, args.adapter_root or os.path.join(path, "adapters"), n=1,
                             device=args.device)[0]
    args.max_tokens = args.steps + 1
    args.prompt_len = 128
    llm, LoRARequest, SamplingParams, wrap, _ = _build("rlserve", path, args.rank, args)
    lora_of(llm.engine.model).merge = None  # the per-row path
    V = json.load(open(os.path.join(path, "config.json")))["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, V - 1, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
    req = LoRARequest(f"r{args.rank}-a1", 1, adapter)
    from torch.profiler import ProfilerActivity, profile as tprofile

    out = {}
    for case, lr in (("base", None), ("one", [req] * args.batch)):
        for n in (args.max_tokens, 1):  # warm-up: graphs, compiles
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), lora_request=lr,
                         use_tqdm=False)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
        kerns = []
        for n in (args.max_tokens, 1):  # decode steps = the difference (prefill and first token cancel)
            with tprofile(activities=acts) as prof:
                llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), lora_request=lr,
                             use_tqdm=False)
            kern = collections.defaultdict(lambda: [0, 0.0])
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    k = kern[e.name[:80]]
                    k[0] += 1
                    k[1] += e.time_range.elapsed_us()
            kerns.append(kern)
        steps = args.steps
        diff = {n: (c - kerns[1].get(n, [0, 0.0])[0], t - kerns[1].get(n, [0, 0.0])[1]) for n, (c, t) in kerns[0].items()}
        top = sorted(diff.items(), key=lambda kv: -kv[1][1])[:25]
        out[case] = {"gpu_us_per_step": round(sum(v[1] for v in diff.values()) / steps, 1),
                     "kernels_per_step": round(sum(v[0] for v in diff.values()) / steps, 1),
                     "top": [{"name": n, "per_step": round(c / steps, 2), "us_per_step": round(t / steps, 1)}
                             for n, (c, t) in top]}
        print(json.dumps({case: {k: out[case][k] for k in ("gpu_us_per_step", "kernels_per_step")}}), flush=True)
    del llm
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", nargs="+", default=["ab"], choices=["ab", "profile"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 4], help="ab: adapters in the batch")
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--dims", type=int, nargs=3, default=[4096, 12288, 1024], help="ab: hidden, intermediate, kv")
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--shape", default="qwen3-8b", help="profile: benchmarks/model_shapes.py")
    p.add_argument("--model-dir", default="/tmp/lora-kernels", help="profile: the shape's config.json under it")
    p.add_argument("--adapter-root", default=None)
    p.add_argument("--steps", type=int, default=16, help="profile: decode steps")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    res = {"date": time.strftime("%Y-%m-%d"), "args": vars(args).copy(),
           "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)

    if "ab" in args.parts:
        res["ab"] = []
        for n in args.adapters:
            one = argparse.Namespace(**{**vars(args), "adapters": n})
            res["ab"].append(ab(one))
            print(json.dumps({k: res["ab"][-1][k] for k in ("adapters", "us_per_step", "lora_us")}), flush=True)
            save()
    if "profile" in args.parts:
        res["profile"] = profile(args)
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
