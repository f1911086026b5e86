"""Eager prefill / mixed step time on CUDA: host launch time, GPU time, host syncs (issue 37).

The H100 step traces of sessions 16-17 fit an eager prefill step of Qwen3-0.6B as ~10.7 ms + 0.74 us a
token (BENCHMARKS.md "HTTP serving"): most of a small prefill step is fixed cost. For each step size
``N`` (``--tokens``; prompts of at most ``--seq-len`` tokens each, so 8192 tokens are 4 prompts of
2048) this measures, on a random-weight model of ``--shape`` (``benchmarks/model_shapes.py``):

- ``runner``: one forward through ``ModelRunner.execute`` (input copies, metadata, the eager forward,
  the LM head of each prompt's last row): ``host_ms`` (until ``execute`` returns, nothing synchronised:
  the time the host needs to launch the step, any host sync inside included), ``wall_ms`` (returned
  and synchronised), ``gpu_ms`` (CUDA events around the call: the GPU's span, idle gaps included);
  medians over ``--iters`` steps.
- ``engine`` (``--engine``): ``LLMEngine.step()`` of ``N`` prompt tokens (``max_tokens=1``: schedule,
  build, forward, sampler, output), median wall time.
- ``--mixed-prefill-decode D``: the same runner step with ``D`` decode rows first (context
  ``--context``), as a mixed step of ``--mixed-prefill-decode`` schedules it.
- ``--profile``: ``torch.profiler`` over 3 runner steps: host (CPU) time by op, GPU kernel time, the
  CUDA runtime calls that wait for the GPU (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``,
  ``cudaEventSynchronize``, a blocking ``cudaMemcpy``) per step, and kernel launches per step.

``--prefill-graphs off,on`` repeats every measurement without and with the piecewise prefill CUDA graphs
(``RLSERVE_PREFILL_CUDA_GRAPHS``, :mod:`rlserve.engine.worker.prefill_graphs`; buckets ``--buckets``), one
engine captured with them and switched per pass; an ``on`` row adds ``max_abs_logit_diff`` and
``argmax_equal`` against the ``off`` pass's logits of the same step. One JSON line per row.

Usage:
    python benchmarks/prefill_step.py --shape qwen3-0.6b --tokens 512,2048,8192 --mixed-prefill-decode 64 \
        --profile --prefill-graphs off,on --json out.json
    python benchmarks/prefill_step.py --device cpu --shape tiny --tokens 32 --iters 2   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: CUDA runtime calls after which the host has waited for the GPU
SYNC_CALLS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpy2D",
              "cuStreamSynchronize", "cuCtxSynchronize"}
#: CUDA runtime / driver calls that launch a kernel
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _tiny(root: str) -> str:
    from transformers import Qwen3Config

    cfg = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                      tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"])
    path = os.path.join(root, "tiny")
    cfg.save_pretrained(path)
    return path


def prefill_step(n: int, seq_len: int, decodes: int, context: int, bs: int, vocab: int, g):
    """A StepInput of ``decodes`` decode rows (context ``context``) then prompts of ``n`` tokens in all
    (``seq_len`` each, the last shorter), blocks laid out one after the other."""
    from rlserve.engine.worker.model_runner import StepInput

    ids, pos, ql, sl, tables, logit_rows = [], [], [], [], [], []
    nxt = 0

    def blocks(k):
        nonlocal nxt
        t = list(range(nxt, nxt + -(-k // bs)))
        nxt += len(t)
        return t

    for _ in range(decodes):
        ids.append(int(torch.randint(0, vocab, (1,), generator=g)))
        pos.append(context - 1)
        ql.append(1)
        sl.append(context)
        tables.append(blocks(context))
        logit_rows.append(len(ids) - 1)
    left = n
    while left > 0:
        k = min(seq_len, left)
        ids.extend(torch.randint(0, vocab, (k,), generator=g).tolist())
        pos.extend(range(k))
        ql.append(k)
        sl.append(k)
        tables.append(blocks(k))
        logit_rows.append(len(ids) - 1)
        left -= k
    return StepInput(ids, pos, ql, sl, tables, logit_rows, True), nxt


def time_runner(runner, step, dev, iters: int) -> dict:
    """Medians of host_ms / wall_ms / gpu_ms of ``runner.execute(step)`` (see the module docstring)."""
    for _ in range(3):
        runner.execute(step)
    _sync(dev)
    host, wall, gpu = [], [], []
    for _ in range(iters):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if dev.type == "cuda" else None
        if ev:
            ev[0].record()
        t0 = time.perf_counter()
        runner.execute(step)
        t1 = time.perf_counter()
        if ev:
            ev[1].record()
        _sync(dev)
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        wall.append((t2 - t0) * 1e3)
        if ev:
            gpu.append(ev[0].elapsed_time(ev[1]))
    out = {"host_ms": statistics.median(host), "wall_ms": statistics.median(wall)}
    if gpu:
        out["gpu_ms"] = statistics.median(gpu)
    return out


def profile_runner(runner, step, dev, steps: int = 3, top: int = 12) -> dict:
    """``torch.profiler`` over ``steps`` runner steps: per step the host syncs and kernel launches, the
    summed GPU kernel time, and the ops with the most host (self CPU) time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    runner.execute(step)
    _sync(dev)
    with profile(activities=acts) as prof:
        for _ in range(steps):
            runner.execute(step)
        _sync(dev)
    syncs: dict[str, int] = {}
    launches = 0
    kernel_us = 0.0
    cpu_rows = []
    for e in prof.key_averages():
        name = e.key
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernel_us += getattr(e, "self_device_time_total", 0.0) or 0.0
            continue
        if name in SYNC_CALLS:
            syncs[name] = syncs.get(name, 0) + e.count
        if name.startswith(LAUNCH_CALLS):
            launches += e.count
        cpu_rows.append((e.self_cpu_time_total, e.count, name))
    cpu_rows.sort(reverse=True)
    # the final synchronize of the profiled block is not a step's
    for k in ("cudaDeviceSynchronize",):
        if k in syncs:
            syncs[k] -= 1
    return {"syncs_per_step": {k: v / steps for k, v in syncs.items() if v > 0},
            "launches_per_step": launches / steps, "kernel_ms_per_step": kernel_us / 1e3 / steps,
            "top_host_ops": [{"op": n[:90], "self_cpu_ms_per_step": round(t / 1e3 / steps, 3), "calls": c // steps}
                             for t, c, n in cpu_rows[:top]]}


def engine_step_ms(eng, n: int, seq_len: int, vocab: int, iters: int, g) -> float:
    """Median wall time of ``eng.step()`` scheduling prompts of ``n`` tokens in all (``max_tokens=1``)."""
    from rlserve import SamplingParams

    times = []
    for it in range(iters + 2):
        left, i = n, 0
        while left > 0:
            k = min(seq_len, left)
            eng.add_request(f"e{n}-{it}-{i}", torch.randint(0, vocab, (k,), generator=g).tolist(),
                            SamplingParams(temperature=0.6, max_tokens=1, ignore_eos=True))
            left -= k
            i += 1
        _sync(eng.device)
        t0 = time.perf_counter()
        eng.step()
        _sync(eng.device)
        if it >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
        while eng.has_unfinished_requests():
            eng.step()
    return statistics.median(times)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-0.6b", help="a benchmarks/model_shapes.py shape, or 'tiny'")
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--seq-len", type=int, default=2048, help="tokens of one prompt at most")
    ap.add_argument("--mixed-prefill-decode", type=int, default=0, metavar="D",
                    help="also a mixed step: D decode rows, then the prefill")
    ap.add_argument("--context", type=int, default=1024, help="context of the mixed step's decode rows")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--engine", action="store_true", help="also time LLMEngine.step() of the prompts")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--prefill-graphs", default="off", help="passes: off, on or off,on (piecewise prefill graphs)")
    ap.add_argument("--buckets", default="1", help="the graphs' token buckets (RLSERVE_PREFILL_CUDA_GRAPHS's syntax)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from rlserve import LLM

    dev = torch.device(args.device)
    tokens = [int(x) for x in args.tokens.split(",")]
    bs = 16
    passes = [p.strip() for p in args.prefill_graphs.split(",") if p.strip()]
    if not set(passes) <= {"off", "on"}:
        raise SystemExit(f"--prefill-graphs takes off / on, got {args.prefill_graphs!r}")
    extra = {"cuda_graph_sizes": [8]}  # decode graphs: one small size (the engine steps decode nothing)
    if "on" in passes:
        extra["prefill_cuda_graph_sizes"] = args.buckets
    if "on" in passes and dev.type != "cuda":
        extra["prefill_cuda_graphs_emulate"] = True  # smoke runs: the pieces as calls
    max_n = max(tokens)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        if args.shape == "tiny":
            path, vocab = _tiny(root), 512
        else:
            from model_shapes import save_shape, shape_config

            path, vocab = save_shape(args.shape, root), shape_config(args.shape).vocab_size
        D = args.mixed_prefill_decode
        need = -(-max_n // bs) + (-(-max_n // args.seq_len)) + D * -(-args.context // bs) + 64
        eng_blocks = (-(-max_n // bs) + 8) * 2 if args.engine else 0
        llm = LLM(path, dtype=args.dtype if dev.type == "cuda" else "float32", device=args.device,
                  load_format="dummy", skip_tokenizer_init=True, max_model_len=max(args.seq_len, args.context) + 16,
                  max_num_seqs=max(256, D + 8), block_size=bs, num_kv_blocks=need + eng_blocks,
                  max_num_batched_tokens=max(max_n + D, 8192), enable_prefix_caching=False, extra=extra)
        eng = llm.engine
        runner = eng.executor.runner
        graphs = None
        if "on" in passes:
            runner._prefill_graphs_ready()  # captured now (the warm-up did on CUDA)
            graphs = runner.prefill_graphs
            print(json.dumps({"prefill_graphs": graphs is not None, "why_off": runner._prefill_graphs_off,
                              "buckets": graphs.sizes if graphs else None,
                              "capture_s": round(graphs.capture_seconds, 3) if graphs else None}), flush=True)
        ref_logits = {}
        for mode in passes:
            runner.prefill_graphs = graphs if mode == "on" else None
            runner._prefill_graphs_off = None if mode == "on" and graphs is not None else f"benchmark pass {mode}"
            g = torch.Generator().manual_seed(0)  # the same steps in every pass
            for n in tokens:
                for d in sorted({0, D}):
                    step, _ = prefill_step(n, args.seq_len, d, args.context, bs, vocab, g)
                    row = {"shape": args.shape, "tokens": n, "decode_rows": d, "device": str(dev),
                           "prefill_graphs": mode}
                    logits = runner.execute(step).float()
                    if (n, d) in ref_logits:
                        ref = ref_logits[(n, d)]
                        row["max_abs_logit_diff"] = float((logits - ref).abs().max())
                        row["argmax_equal"] = bool(torch.equal(logits.argmax(-1), ref.argmax(-1)))
                    else:
                        ref_logits[(n, d)] = logits
                    del logits
                    row.update(time_runner(runner, step, dev, args.iters))
                    if args.profile:
                        row.update(profile_runner(runner, step, dev))
                    if args.engine and d == 0:
                        row["engine_step_ms"] = engine_step_ms(eng, n, args.seq_len, vocab, args.iters, g)
                    rows.append(row)
                    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}),
                          flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
