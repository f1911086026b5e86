"""Offline generation throughput: rlserve against vLLM and Hugging Face ``generate``, one run.

Workload (nano-vllm's): ``--num-seqs`` sequences with random prompt lengths and random
output lengths in ``[--min-len, --max-len]``, random token ids, ``ignore_eos``, temperature
0.6, fixed seed, random weights of a named model shape (``benchmarks/model_shapes.py``).
Each engine also reports its startup time (construction: weights, KV cache, kernel
compilation, CUDA graphs); ``--floor`` (rlserve) the workload's own HBM floor (weights + KV
read per step, summed over the timed run's steps) and roofline (per step the larger of bytes /
bandwidth and FLOPs / matmul rate), :class:`workload_floor.FloorRecorder`, and time / each; with
``--batch1-tokens N``, batch-1 decode latency: one
``--batch1-prompt-len``-token prompt, N greedy tokens, wall time / N (ms per token).

``--engine`` picks the engines (comma-separated, in order): ``rlserve``; ``vllm`` (vLLM's
``LLM.generate``, in a child process whose ``PYTHONPATH`` is ``--vllm-pythonpath``, default
``/tmp/vsite`` -- where ``../shared/tools/device-vllm`` installs vLLM 0.24 on the GPU
machine -- so vLLM's pinned packages never mix with ours; skipped with a message when it
cannot be imported there); ``hf``. HF cannot give each row of a batch its own output
length, so it runs batches of ``--hf-batch`` prompts (left-padded) to the batch's longest
output length; only the requested tokens count as output.

Usage:
    python benchmarks/throughput.py --shape smollm2-135m --device cpu --num-seqs 16 --min-len 16 --max-len 64
    python benchmarks/throughput.py --shape qwen3-0.6b --engine rlserve,vllm --batch1-tokens 1024   # on the GPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_shapes import save_shape, shape_config  # noqa: E402
from workload_floor import FloorRecorder  # noqa: E402


def make_workload(num_seqs: int, min_len: int, max_len: int, vocab: int, seed: int):
    """Prompts (token-id lists) and output lengths, deterministic for ``seed``."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_seqs)]
    out_lens = [rng.randint(min_len, max_len) for _ in range(num_seqs)]
    return prompts, out_lens


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _max_model_len(args) -> int:
    """Room for the workload's longest sequence and for the batch-1 run."""
    return max(2 * args.max_len + 8, args.batch1_prompt_len + args.batch1_tokens + 8)


def run_rlserve(path: str, prompts, out_lens, args) -> dict:
    from rlserve import LLM, SamplingParams

    if args.fp8_operand:  # before the engine: its CUDA graphs capture the kernel variant
        from rlserve.layers import triton_attention as ta

        print(f"  rlserve fp8 operands: {ta.set_fp8_operand(args.fp8_operand)}", flush=True)
    t0 = time.perf_counter()
    mem = _probe_kv_sizing(args)
    llm = LLM(
        path, dtype=args.dtype, device=args.device, load_format="dummy", skip_tokenizer_init=True,
        max_model_len=_max_model_len(args), enforce_eager=args.enforce_eager,
        max_num_seqs=args.max_num_seqs, seed=args.seed, **_memory_kwargs(args),
        **({"enable_return_routed_experts": True} if args.enable_return_routed_experts else {}),
    )
    _sync(args.device)
    startup = time.perf_counter() - t0
    mem = mem()
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in out_lens]
    rec = FloorRecorder(llm.engine) if args.floor or args.step_trace else None

    def gen(ps, sps):  # the timed workload (``prompts`` itself) runs under the floor's recorder
        with rec if rec is not None and ps is prompts else contextlib.nullcontext():
            return [len(o.outputs[0].token_ids) for o in llm.generate(ps, sps)]

    res = _timed("rlserve", startup, gen, prompts, out_lens, params, SamplingParams, args)
    res["async_scheduling"] = getattr(llm.engine, "_overlap", None) is not None
    if res["async_scheduling"]:  # launches before / after the read of the step in flight (warm-up included)
        res["overlap_counts"] = dict(llm.engine._overlap.counts)
    bm = getattr(llm.engine, "block_manager", None)
    if bm is not None:
        res["kv_cache_tokens"] = bm.num_blocks * llm.engine.config.block_size
    if mem:
        res["memory_at_kv_sizing"] = mem
    # the extra runs below get other prompt tokens (same lengths): a repeat would hit the prefix cache
    fresh = lambda k: [[(t + k) % llm.engine.vocab_size for t in p] for p in prompts]  # noqa: E731
    if rec is not None:
        print(f"rlserve timed: {res['output_tokens']} tokens in {res['seconds']:.3f} s", flush=True)
        if args.step_trace:  # before the floor's probes: a run cut by its time bound keeps the trace
            from workload_floor import write_trace

            write_trace(rec.trace, args.step_trace)
        try:  # its bandwidth probe allocates 4 GiB beside the cache: a failure must not lose the run
            res["floor"] = rec.result(res["seconds"], args.device, args.dtype)
        except torch.OutOfMemoryError as e:
            res["floor_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            res["floor_sums"] = dict(rec.acc)  # the recorded bytes and FLOPs, without the probes' rates
            print(f"floor: not measured ({res['floor_error']})", flush=True)
            torch.cuda.empty_cache()
        else:
            _print_steps(res["floor"])
    if args.phases:
        res["phases"] = _phases(llm.engine, lambda: gen(fresh(1), params), args)
    if args.profile:
        _profile(lambda: gen(fresh(2), params), args)
    if args.kernel_profile and args.device.startswith("cuda"):
        from kernel_table import profile_kernels

        one = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1)] * len(prompts)
        res["kernels_prefill"] = profile_kernels(lambda: gen(fresh(3), one), "prefill only (max_tokens=1)",
                                                 args.kernel_profile)
        res["kernels_workload"] = profile_kernels(lambda: gen(fresh(4), params), "whole workload",
                                                  args.kernel_profile)
    return res


def _print_steps(floor: dict) -> None:
    """One line per step class of the floor's step summary (``workload_floor.summarize_steps``)."""
    st = floor.get("steps")
    if not st:
        return
    print(f"serial floor {st['serial_floor_s']:.2f} s (weights-or-GEMMs + attention per step, in sequence), "
          f"time / serial floor {floor['x_serial_floor']:.2f}x", flush=True)
    for name, b in [("prefill", st["P"]), *((f"decode {k}", v) for k, v in st["D"].items())]:
        x = f"{b['x_serial_floor']:.2f}x" if b["x_serial_floor"] else "-"
        print(f"  steps {name:12s} {b['steps']:5d}  {b['seconds']:7.3f} s  tokens {b['tokens']:7d}  "
              f"padded rows {b['padded_rows']:6d}  serial floor {b['serial_floor_s']:7.3f} s  {x}", flush=True)


def _probe_kv_sizing(args):
    """On CUDA, watch the in-process worker's KV sizing (``Worker.determine_num_blocks``) of the
    engine built next: returns ``done() -> dict`` (GiB: the device's total, in use by every
    process, PyTorch's allocated and reserved bytes, the worker's activation estimate, at the
    moment it sizes the cache; and the blocks it chose), which also restores the method. Where the
    KV budget goes; {} on CPU."""
    if not args.device.startswith("cuda"):
        return lambda: {}
    from rlserve.engine.worker.worker import Worker

    orig, seen = Worker.determine_num_blocks, {}

    def probe(self):
        free, total = torch.cuda.mem_get_info(self.device)
        gib = 1 << 30
        seen.update(total_gib=total / gib, used_gib=(total - free) / gib,
                    torch_allocated_gib=torch.cuda.memory_allocated(self.device) / gib,
                    torch_reserved_gib=torch.cuda.memory_reserved(self.device) / gib,
                    activation_estimate_gib=self._activation_estimate() / gib,
                    gpu_memory_utilization=self.config.gpu_memory_utilization)
        seen["kv_blocks"] = orig(self)
        return seen["kv_blocks"]

    Worker.determine_num_blocks = probe

    def done() -> dict:
        Worker.determine_num_blocks = orig
        if seen:
            print("rlserve KV sizing:", {k: round(v, 3) if isinstance(v, float) else v for k, v in seen.items()},
                  flush=True)
        return dict(seen)

    return done


def _memory_kwargs(args) -> dict:
    """``gpu_memory_utilization`` for both engines when ``--gpu-memory-utilization`` is given
    (each engine's default otherwise: 0.92 for both, vLLM 0.24's offline ``LLM`` printed 0.92 on an
    H100, 2026-12-06), and ``kv_cache_dtype`` when
    ``--kv-cache-dtype`` is not ``auto`` (both engines take vLLM's values)."""
    kw = {} if args.gpu_memory_utilization is None else {"gpu_memory_utilization": args.gpu_memory_utilization}
    if getattr(args, "kv_cache_dtype", "auto") != "auto":
        kw["kv_cache_dtype"] = args.kv_cache_dtype
    return kw


def _phases(engine, fn, args) -> dict:
    """Run ``fn`` (the workload again) with light instruments; returns seconds spent in
    engine steps that computed prompt tokens (prefill) and in the others (decode), the host's
    waits for an overlapped step's tokens (the GPU was the bottleneck that long), the time
    and count of Python's garbage collections, and on CUDA the GPU time from the start of each
    step's launch to the end of its sampler (``gpu_prefill_s`` / ``gpu_decode_s``, CUDA events;
    ``wall_s`` minus their sum is time the GPU sat idle between steps)."""
    import gc

    acc = {"wall_s": 0.0, "prefill_steps_s": 0.0, "decode_steps_s": 0.0, "prefill_steps": 0, "decode_steps": 0,
           "overlap_wait_s": 0.0, "gc_s": 0.0, "gc_count": [0, 0, 0]}
    step0 = engine.step
    c = engine.stats_counters

    def step(*a, **kw):
        p0 = c["prefill_tokens_computed"]
        t0 = time.perf_counter()
        out = step0(*a, **kw)
        kind = "prefill" if c["prefill_tokens_computed"] != p0 else "decode"
        acc[f"{kind}_steps_s"] += time.perf_counter() - t0
        acc[f"{kind}_steps"] += 1
        return out

    wait0 = None
    try:
        from rlserve.engine.core import overlap as ov

        wait0 = ov._InFlight.wait

        def wait(self):
            t0 = time.perf_counter()
            r = wait0(self)
            acc["overlap_wait_s"] += time.perf_counter() - t0
            return r

        ov._InFlight.wait = wait
    except (ImportError, AttributeError):
        pass
    gc_t = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            gc_t[0] = time.perf_counter()
        else:
            acc["gc_s"] += time.perf_counter() - gc_t[0]
            acc["gc_count"][info["generation"]] += 1

    gc.callbacks.append(on_gc)
    engine.step = step
    events = []  # (start, end, is_prefill) CUDA events around each step's launch: its GPU time
    launch0 = engine._launch
    if args.device.startswith("cuda"):
        def launch(batch, *a, **kw):
            e0 = torch.cuda.Event(enable_timing=True)
            e1 = torch.cuda.Event(enable_timing=True)
            e0.record()
            out = launch0(batch, *a, **kw)
            e1.record()
            events.append((e0, e1, batch.is_prefill))
            return out

        engine._launch = launch
    t0 = time.perf_counter()
    try:
        fn()
        _sync(args.device)
    finally:
        acc["wall_s"] = time.perf_counter() - t0
        engine.step = step0
        engine._launch = launch0
        for e0, e1, pre in events:
            k = "gpu_prefill_s" if pre else "gpu_decode_s"
            acc[k] = acc.get(k, 0.0) + e0.elapsed_time(e1) / 1e3
        gc.callbacks.remove(on_gc)
        if wait0 is not None:
            ov._InFlight.wait = wait0
    print("phases:", {k: round(v, 4) if isinstance(v, float) else v for k, v in acc.items()}, flush=True)
    return acc


def _profile(fn, args) -> None:
    """Run ``fn`` (the workload again) under cProfile; print the top ``--profile`` functions
    by own time and by cumulative time (host view: a large own time in a copy or an event wait
    is the host waiting for the GPU)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    fn()
    _sync(args.device)
    prof.disable()
    print(f"--- cProfile of the workload ({time.perf_counter() - t0:.2f} s under the profiler) ---")
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(args.profile)
    st.sort_stats("cumulative").print_stats(args.profile)


def _timed(engine: str, startup: float, gen, prompts, out_lens, params, SamplingParams, args, sync=None) -> dict:
    """Warm up, then time the workload and (``--batch1-tokens``) batch-1 decode through
    ``gen(prompts, params) -> output lengths``; ``sync()`` waits for the device (default:
    ``torch.cuda.synchronize`` on CUDA)."""
    wait = sync or (lambda: _sync(args.device))
    gen(prompts[:2], [SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.6)] * 2)  # warm-up
    wait()
    t0 = time.perf_counter()
    n_out = sum(gen(prompts, params))
    wait()
    dt = time.perf_counter() - t0
    assert n_out == sum(out_lens), (n_out, sum(out_lens))
    res = {"engine": engine, "seconds": dt, "output_tokens": n_out, "tokens_per_s": n_out / dt,
           "startup_s": startup}
    if args.batch1_tokens:
        n = args.batch1_tokens
        prompt = [prompts[0][i % len(prompts[0])] for i in range(args.batch1_prompt_len)]
        sp = SamplingParams(temperature=0, ignore_eos=True, max_tokens=n)
        gen([prompt], [SamplingParams(temperature=0, ignore_eos=True, max_tokens=16)])
        wait()
        t0 = time.perf_counter()
        got = sum(gen([prompt], [sp]))
        wait()
        assert got == n, (got, n)
        res["batch1_ms_per_token"] = (time.perf_counter() - t0) / n * 1e3
    return res


def run_vllm_child(path: str, prompts, out_lens, args) -> dict:
    """vLLM ``LLM.generate`` on the same workload (run inside the child process)."""
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=path, load_format="dummy", dtype=args.dtype, skip_tokenizer_init=True, seed=args.seed,
        max_model_len=_max_model_len(args), max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager,
        **_memory_kwargs(args),
        **({"enable_return_routed_experts": True} if args.enable_return_routed_experts else {}),
    )
    startup = time.perf_counter() - t0
    import vllm

    cache = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None), "cache_config", None)
    kv_tokens = (cache.num_gpu_blocks or 0) * cache.block_size if cache is not None else None

    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in out_lens]

    def gen(ps, sps):
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], sps, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outs]

    # vLLM's generate returns finished outputs: nothing is left running on the device
    res = _timed(f"vllm-{vllm.__version__}", startup, gen, prompts, out_lens, params, SamplingParams, args,
                 sync=lambda: None)
    if kv_tokens:  # the engine core's KV blocks (vLLM's cache_config.num_gpu_blocks) x block size
        res["kv_cache_tokens"] = kv_tokens
    return res


def run_vllm(args, argv: list[str]) -> dict | None:
    """Run this script with ``--engine vllm`` in a child process whose ``PYTHONPATH`` is
    ``--vllm-pythonpath``; its JSON result, or None (with the reason printed) when vLLM
    cannot run there."""
    env = dict(os.environ)
    env["PYTHONPATH"] = args.vllm_pythonpath
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    # this script has initialised CUDA before the child runs vLLM's engine core: a forked core
    # fails with "Cannot re-initialize CUDA in forked subprocess" (seen on the H200, 2026-12-01)
    env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "vllm.json")
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--engine", "vllm", "--no-hf",
               "--json", out, "--vllm-child"]
        proc = subprocess.run(cmd, env=env)
        if proc.returncode != 0 or not os.path.exists(out):
            print(f"vllm: child exited with {proc.returncode} (PYTHONPATH={args.vllm_pythonpath}); skipped", flush=True)
            return None
        with open(out) as f:
            return json.load(f)["results"][0]


def run_hf(path: str, prompts, out_lens, args) -> dict:
    from transformers import AutoModelForCausalLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(shape_config(args.shape), dtype=dtype).to(args.device).eval()
    pad = 0
    total = 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), args.hf_batch):
        ps, ls = prompts[i : i + args.hf_batch], out_lens[i : i + args.hf_batch]
        width = max(len(p) for p in ps)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in ps], device=args.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps], device=args.device)
        with torch.no_grad():
            model.generate(
                ids, attention_mask=mask, do_sample=True, temperature=0.6, max_new_tokens=max(ls),
                min_new_tokens=max(ls), pad_token_id=pad,
            )
        total += sum(ls)
    _sync(args.device)
    dt = time.perf_counter() - t0
    return {"engine": "hf-generate", "seconds": dt, "output_tokens": total, "tokens_per_s": total / dt}


def _strip(argv: list[str], flags: dict[str, bool]) -> list[str]:
    """``argv`` without the given flags (value-taking ones with their value)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in flags:
            skip = flags[name] and "=" not in a
            continue
        out.append(a)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--engine", default="rlserve,hf", help="comma-separated: rlserve, vllm, hf")
    ap.add_argument("--hf-batch", type=int, default=None, help="HF batch size (default: all prompts at once)")
    ap.add_argument("--no-hf", action="store_true", help="drop hf from --engine")
    ap.add_argument("--batch1-tokens", type=int, default=0, help="also time batch-1 greedy decode of this many tokens")
    ap.add_argument("--batch1-prompt-len", type=int, default=128)
    ap.add_argument("--vllm-pythonpath", default=os.environ.get("VLLM_PYTHONPATH", "/tmp/vsite"))
    ap.add_argument("--vllm-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="both engines' KV cache dtype (vLLM's values: auto, fp8, fp8_e4m3, fp8_e5m2)")
    ap.add_argument("--fp8-operand", default=None, metavar="MODE[:BLOCK_N]",
                    help="rlserve on an fp8 KV cache: the attention kernels' dot operands, bf16 / f16 / asm, and the "
                         "decode tile (rlserve.layers.triton_attention.set_fp8_operand; default: that module's)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="both engines' gpu_memory_utilization (weights + KV cache; default: each engine's own, "
                         "0.92 for both rlserve and vLLM 0.24)")
    ap.add_argument("--enable-return-routed-experts", action="store_true",
                    help="MoE shapes: routed-experts replay on (rlserve, and vLLM where its version has it)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--phases", action="store_true",
                    help="rlserve: run the workload once more, timing prefill vs decode steps, overlap waits, GC")
    ap.add_argument("--floor", action="store_true",
                    help="rlserve: record the timed run's steps; the workload's HBM floor "
                         "(weights + KV read per step, summed) and time / floor")
    ap.add_argument("--step-trace", metavar="PATH",
                    help="rlserve, with --floor: write the timed run's steps as JSON lines (kind, tokens, sequences, "
                         "rows incl. CUDA-graph padding, bytes, FLOPs, launch time)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="rlserve: run the workload once more under cProfile and print its top N functions")
    ap.add_argument("--kernel-profile", type=int, default=0, metavar="N",
                    help="rlserve on CUDA: GPU kernel tables (top N) of a prefill-only run of the prompts and of "
                         "the whole workload once more (torch.profiler)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.hf_batch = args.hf_batch or args.num_seqs
    engines = [e for e in args.engine.split(",") if e and not (args.no_hf and e == "hf")]
    vocab = shape_config(args.shape).vocab_size
    prompts, out_lens = make_workload(args.num_seqs, args.min_len, args.max_len, vocab, args.seed)
    if args.vllm_child:  # the vLLM run of a parent process: no CUDA call before vLLM's LLM()
        with tempfile.TemporaryDirectory() as root:
            res = run_vllm_child(save_shape(args.shape, root), prompts, out_lens, args)
        with open(args.json, "w") as f:
            json.dump({"results": [res]}, f)
        return
    machine = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"{platform.processor() or 'cpu'} x{os.cpu_count()}"
    child_argv = _strip(argv, {"--engine": True, "--json": True, "--no-hf": False})
    results = []
    with tempfile.TemporaryDirectory() as root:
        path = save_shape(args.shape, root)
        for engine in engines:
            if engine == "rlserve":
                res = run_rlserve(path, prompts, out_lens, args)
            elif engine == "vllm":
                res = run_vllm(args, child_argv)
            elif engine == "hf":
                res = run_hf(path, prompts, out_lens, args)
            else:
                raise SystemExit(f"unknown engine {engine!r} (rlserve, vllm, hf)")
            if res is not None:
                results.append(res)
                print(f"{engine}:", res, flush=True)
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    fused = os.environ.get("RLSERVE_FUSED_KERNELS", "1") != "0"
    overlap = [r["async_scheduling"] for r in results if "async_scheduling" in r]
    print(f"shape={args.shape} device={args.device} ({machine}) dtype={args.dtype} seqs={args.num_seqs} "
          f"lens={args.min_len}..{args.max_len} fused_kernels={fused} "
          f"async_scheduling={overlap[0] if overlap else os.environ.get('RLSERVE_ASYNC_SCHEDULING') == '1'}")
    for r in results:
        b1 = f"  batch-1 {r['batch1_ms_per_token']:.3f} ms/token" if "batch1_ms_per_token" in r else ""
        st = f"  startup {r['startup_s']:.1f} s" if "startup_s" in r else ""
        st += f"  KV {r['kv_cache_tokens']} tokens" if "kv_cache_tokens" in r else ""
        fl = r.get("floor")
        fl = (f"  HBM floor {fl['floor_s']:.2f} s (decode {fl['decode_floor_s']:.2f}), {fl['x_floor']:.2f}x; "
              f"roofline {fl['roofline_s']:.2f} s, {fl['x_roofline']:.2f}x") if fl else ""
        print(f"  {r['engine']:12s} {r['output_tokens']:8d} tok  {r['seconds']:8.2f} s  {r['tokens_per_s']:10.1f} tok/s"
              f"{st}{b1}{fl}")
    base = next((r for r in results if r["engine"] == "rlserve"), None)
    for r in [r for r in results if r is not base] if base else []:
        line = f"  rlserve / {r['engine']}: {base['tokens_per_s'] / r['tokens_per_s']:.2f}x throughput"
        if "batch1_ms_per_token" in r and "batch1_ms_per_token" in base:
            line += f", batch-1 ms/token {base['batch1_ms_per_token'] / r['batch1_ms_per_token']:.2f}x of theirs"
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": machine, "fused_kernels": fused, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
