"""Decode step time against the HBM floor, CUDA graphs against eager, attention kernels.

For each model shape (``benchmarks/model_shapes.py``, random weights via
``load_format="dummy"``) and batch size ``B``, every sequence holding ``--context``
tokens, this measures:

- ``forward``: one decode forward through the model runner (input preparation, CUDA-graph
  replay or eager launch, logits of every row), synchronised after every step; median
  over ``--iters`` steps. Both with CUDA graphs and eager (the same runner with graphs
  switched off), so the two are directly comparable.
- ``engine`` (``--engine-steps``): a full ``LLMEngine.step()`` in steady decode
  (scheduling, inputs, forward, sampling at temperature 0.6, output bookkeeping;
  ``--profile-engine`` prints the GPU kernel table of 5 more steps). By
  default as offline ``generate`` and non-streamed requests run it (``outputs_for=()``:
  outputs are built for finished requests only); ``--engine-outputs all`` builds a
  cumulative output for every request every step, as for streamed requests (the
  measurement before 2026-12-01).
- ``batch-1`` (``--batch1-tokens N``, batch 1): a 128-token prompt decoding N greedy tokens
  through ``LLM.generate`` (ms per token, as ``throughput.py --batch1-tokens``), with the GPU
  span of each step and the gap between steps (``batch1_latency.py``).
- the HBM floor: ``(weight bytes + KV bytes read) / copy bandwidth``, where weight bytes
  are every parameter read once per step (a tied embedding counts once, as the LM head;
  an untied input embedding is not counted -- only ``B`` rows of it are read; of an MoE
  layer only the experts ``B`` tokens are expected to touch, :func:`weight_bytes`), KV bytes
  are ``B x context x layers x 2 x kv_heads x head_dim x itemsize``, and the bandwidth is
  that of a device-to-device ``copy_`` of a 2 GiB buffer measured in the same run,
  counting bytes read plus bytes written.

``--kernels`` adds attention micro-benchmarks (bf16): the Triton decode kernel on a
Qwen3-0.6B layer (16 query heads, 8 KV heads, head_dim 128) and a SmolLM2-135M layer
(9 / 3 / 64) against the torch backend, timed both as plain launches (Python launch cost
included) and replayed from a CUDA graph (GPU time only; the K/V read bandwidth is taken
from this one), with ``--sweep`` over tile configurations; and the
Triton varlen prefill against the torch backend and against PyTorch's flash SDPA on
padded contiguous tensors (the best case for a prefill without cache hits).

Usage:
    python benchmarks/decode_step.py --shape qwen3-0.6b --batch 1,64,256 --context 1024
    python benchmarks/decode_step.py --shape smollm2-135m,qwen3-0.6b,qwen3-8b --kernels --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model_shapes import save_shape, shape_config  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure_copy_bandwidth(device, nbytes: int = 2 * 1024**3, iters: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write bytes over the time)."""
    if device.type != "cuda":  # CPU smoke runs: memcpy bandwidth of a smaller buffer
        nbytes = min(nbytes, 256 * 1024**2)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        return 2 * nbytes * iters / (time.perf_counter() - t0)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize(device)
    secs = start.elapsed_time(end) / 1e3 / iters
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / secs


def cuda_time(fn, warmup: int = 3, iters: int = 20) -> float:
    """Median GPU time of ``fn()`` in seconds (CUDA events around each call)."""
    if not torch.cuda.is_available():
        return wall_time(fn, warmup, iters)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def graph_time(fn, iters: int = 20) -> float:
    """Median GPU time of ``fn()`` replayed from a CUDA graph (no Python launch cost), s."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return cuda_time(g.replay, iters=iters)


def wall_time(fn, warmup: int = 3, iters: int = 20) -> float:
    """Median wall time of ``fn(); synchronize()`` in seconds."""
    for _ in range(warmup):
        fn()
    _sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def weight_bytes(model, batch: int | None = None) -> int:
    """Bytes of parameters read in one decode step (see the module docstring). Mixture-of-experts
    layers (:class:`rlserve.layers.moe.FusedMoE`) count the experts a batch of ``batch`` tokens is
    expected to touch under uniform top-k routing, ``E * (1 - (1 - K / E) ** batch)`` (each token
    picks K distinct experts of E), times one expert's bytes (all experts when ``batch`` is None)."""
    from rlserve.layers.moe import FusedMoE

    seen, total = set(), 0
    tied = getattr(model, "tie_word_embeddings", False)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    skip = set() if tied or embed is None else {id(p) for p in embed.parameters()}
    for m in model.modules():
        if isinstance(m, FusedMoE) and batch is not None:
            params = [p for p in m.parameters(recurse=False)]
            skip |= {id(p) for p in params}
            used = m.num_experts * (1 - (1 - m.top_k / m.num_experts) ** batch)
            total += int(sum(p.numel() * p.element_size() for p in params) / m.num_experts * used)
    for p in model.parameters():
        if id(p) in seen or id(p) in skip:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total


def bench_shape(shape: str, args, bw: float, root: str) -> list[dict]:
    from rlserve import LLM, SamplingParams
    from rlserve.engine.worker.model_runner import StepInput

    cfg = shape_config(shape)
    path = save_shape(shape, root)
    batches = args.batch
    max_b = max(batches)
    ctx = args.context
    bs = 16
    extra_steps = args.iters + 8 + (args.engine_steps + 16 if args.engine_steps else 0)
    per_seq = -(-(ctx + extra_steps) // bs)
    b1_len = args.batch1_prompt_len + args.batch1_tokens + 32 if args.batch1_tokens and 1 in batches else 0
    t0 = time.perf_counter()
    llm = LLM(
        path, dtype=args.dtype, device=args.device, load_format="dummy", skip_tokenizer_init=True,
        max_model_len=max(ctx + extra_steps + 16, b1_len), max_num_seqs=max_b, block_size=bs,
        num_kv_blocks=max_b * per_seq + 8 + -(-b1_len // bs),
        max_num_batched_tokens=max(8192, ctx + extra_steps + 16, b1_len),
        enable_prefix_caching=False, enforce_eager=args.enforce_eager, extra={"cuda_graph_sizes": batches},
        kv_cache_dtype=args.kv_cache_dtype,
    )
    build_s = time.perf_counter() - t0
    eng = llm.engine
    runner = eng.executor.runner
    model = eng.model
    layers = len(runner.attn_layers)
    hkv, hd = runner.attn_layers[0].num_kv_heads, runner.attn_layers[0].head_dim
    item = torch.tensor([], dtype=runner.kv_cache_dtype).element_size()  # KV bytes per element (fp8: 1)
    rows = []
    g = torch.Generator().manual_seed(0)
    for B in batches:
        ids = torch.randint(0, cfg.vocab_size, (B,), generator=g).tolist()
        step = StepInput(
            input_ids=ids, positions=[ctx - 1] * B, query_lens=[1] * B, seq_lens=[ctx] * B,
            block_tables=[list(range(i * per_seq, i * per_seq + -(-ctx // bs))) for i in range(B)],
            logits_indices=list(range(B)), is_prefill=False,
        )
        kv_bytes = B * ctx * layers * 2 * hkv * hd * item
        wbytes = weight_bytes(model, B)
        floor = (wbytes + kv_bytes) / bw
        row = {"shape": shape, "batch": B, "context": ctx, "kv_cache_dtype": args.kv_cache_dtype,
               "fp8_operand": args.fp8_label if args.kv_cache_dtype != "auto" else None,
               "weight_bytes": wbytes, "kv_bytes": kv_bytes,
               "floor_ms": floor * 1e3}
        graphs_on = runner.use_cuda_graphs  # what the engine chose (False on CPU / enforce_eager)
        for mode in ("graph", "eager"):
            if mode == "graph" and not graphs_on:
                continue
            runner.use_cuda_graphs = mode == "graph"
            t = wall_time(lambda: runner.execute(step), iters=args.iters)
            row[f"{mode}_ms"] = t * 1e3
        runner.use_cuda_graphs = graphs_on
        best = row.get("graph_ms", row["eager_ms"])
        row["graph_speedup"] = row["eager_ms"] / row["graph_ms"] if "graph_ms" in row else None
        row["x_floor"] = best / row["floor_ms"]
        if args.profile and B in (args.profile_batches or [max_b]):
            profile_step(runner, step, graphs_on, shape, B)
        if args.engine_steps:
            row["engine_step_ms"] = engine_step_ms(eng, B, ctx, cfg.vocab_size, args, SamplingParams) * 1e3
        if B == 1 and args.batch1_tokens:  # end to end through LLM.generate, and its host-side gap
            from batch1_latency import measure

            row.update(measure(llm, cfg.vocab_size, args.batch1_tokens, args.batch1_prompt_len))
        rows.append(row)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    if runner.cuda_graphs is not None:
        print(f"  [{shape}] build {build_s:.1f}s, graph capture {runner.cuda_graphs.capture_seconds:.2f}s "
              f"for sizes {runner.cuda_graphs.sizes}", flush=True)
    del llm, eng, runner, model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def profile_step(runner, step, graphs_on: bool, shape: str, B: int, top: int = 30) -> None:
    """Print the GPU kernel tables (:mod:`kernel_table`) of 5 decode steps (forward and
    logits), eager and (if on) replayed from the CUDA graph."""
    from kernel_table import profile_kernels

    def five():
        for _ in range(5):
            runner.execute(step)

    for mode in ("eager", "graph") if graphs_on else ("eager",):
        runner.use_cuda_graphs = mode == "graph"
        runner.execute(step)
        _sync()
        profile_kernels(five, f"{shape} B={B} {mode}, 5 steps", top)
    runner.use_cuda_graphs = graphs_on


def chain_us(f, iters: int, chain: int) -> float:
    """Microseconds a call of ``f`` (a kernel launch): ``chain`` calls replayed from one CUDA graph."""
    def fn():
        for _ in range(chain):
            f()
    return graph_time(fn, iters=iters) / chain * 1e6


def gemv_vs_cublas(x, w, iters: int, chain: int = 10) -> dict:
    """``x [1, K]`` times ``w [N, K]``: microseconds a launch, ``chain`` launches replayed from one
    CUDA graph (the launch gap between kernels included, as in a decode step): ``F.linear``
    (cuBLAS), the batch-1 GEMV (:mod:`rlserve.layers.gemv`) with plain launches and with PDL."""
    from rlserve.layers import gemv, pdl

    K = x.shape[1]

    def run(f):
        return chain_us(f, iters, chain)

    out = {"chain_cublas_us": run(lambda: torch.nn.functional.linear(x, w))}
    for tag, on in (("chain_gemv_us", False), ("chain_gemv_pdl_us", True)):
        if on and pdl.unavailable(x.device) is not None:
            continue
        prev = gemv.set_pdl(on)
        try:
            out[tag] = run(lambda: gemv._launch(0, x, K, w, None))
        finally:
            gemv.set_pdl(prev)
    return out


def rows_vs_cublas(x, w, iters: int, chain: int = 10) -> dict:
    """``x [M, K]`` (2 <= M <= 64) times ``w [N, K]``: microseconds a launch, ``chain`` launches replayed
    from one CUDA graph, of ``F.linear`` (cuBLAS, its split-K reduce kernel included) and the small-batch
    GEMM (:func:`rlserve.layers.gemv._launch_rows`; with PDL where the card has it), the GEMM's weight
    TB/s, its tile plan and its largest difference from cuBLAS."""
    from rlserve.layers import gemv, pdl

    M, K = x.shape
    N = w.shape[0]

    def run(f):
        return chain_us(f, iters, chain)

    prev = gemv.set_pdl(pdl.unavailable(x.device) is None)
    try:
        us = run(lambda: gemv._launch_rows(0, x, K, w, None)[0])
        diff = (gemv._launch_rows(0, x, K, w, None)[0].float() - torch.nn.functional.linear(x, w).float()).abs().max()
    finally:
        gemv.set_pdl(prev)
    return {"chain_cublas_us": run(lambda: torch.nn.functional.linear(x, w)), "chain_rows_us": us,
            "rows_TBps": N * K * w.element_size() / us / 1e6, "rows_tile": list(gemv.rows_tile(M, N, K, x.device)),
            "rows_max_abs_diff": float(diff)}


# (BLOCK_N, BLOCK_K, stages) of the 16-row (also 32) and 64-row tiles; the first of each is the default before
# session 18 (gemv._ROWS_TILE now)
ROWS_SWEEP = {16: [(32, 128, 4), (64, 128, 4), (128, 128, 3), (64, 256, 3), (64, 64, 6)],
              64: [(128, 128, 3), (128, 64, 4), (128, 128, 2), (64, 128, 3), (64, 64, 6)]}


def rows_sweep(x, w, iters: int) -> list[dict]:
    """The small-batch GEMM's us a launch (chains of 10 from a CUDA graph) for each ``ROWS_SWEEP`` tile of
    ``x``'s row tile (``rlserve.layers.gemv._ROWS_TILE`` of that row tile set in turn)."""
    from rlserve.layers import gemv

    bm = gemv.rows_tile(x.shape[0], w.shape[0], x.shape[1], x.device)[0]
    saved = gemv._ROWS_TILE[bm]
    out = []
    try:
        for bn, bk, st in ROWS_SWEEP[64 if bm == 64 else 16]:
            gemv._ROWS_TILE[bm] = (bn, bk, st)
            us = chain_us(lambda: gemv._launch_rows(0, x, x.shape[1], w, None)[0], iters, 10)
            out.append({"tile": [bn, bk, st], "split": gemv.rows_tile(x.shape[0], w.shape[0], x.shape[1], x.device)[3],
                        "us": round(us, 2), "TBps": round(w.numel() * w.element_size() / us / 1e6, 3)})
    finally:
        gemv._ROWS_TILE[bm] = saved
    return out


def bench_gemms(args, shapes: list[str]) -> list[dict]:
    """GPU time of each decoder linear (and the LM head) of ``shapes`` as ``F.linear`` on a
    bf16 weight (cuBLAS), replayed from a CUDA graph, for M = ``--gemm-rows`` rows: TB/s of
    weight bytes and TFLOP/s, against the decode step's share of such GEMMs."""
    import torch.nn.functional as F
    from rows_forms import rows_forms

    rows_list = [int(x) for x in args.gemm_rows.split(",")]
    out = []
    for shape in shapes:
        cfg = shape_config(shape)
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        H = cfg.hidden_size
        lin = {
            "qkv": (H, (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd),
            "o": (cfg.num_attention_heads * hd, H),
            "gate_up": (H, 2 * cfg.intermediate_size),
            "down": (cfg.intermediate_size, H),
            "lm_head": (H, cfg.vocab_size),
        }
        for name, (K, N) in lin.items():
            w = torch.randn(N, K, dtype=torch.bfloat16, device="cuda") * 0.02
            for M in rows_list:
                x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
                t = graph_time(lambda: F.linear(x, w), iters=args.iters)
                r = {"shape": shape, "linear": name, "M": M, "K": K, "N": N, "us": t * 1e6,
                     "weight_TBps": N * K * 2 / t / 1e12, "TFLOPs": 2 * M * N * K / t / 1e12}
                if M == 1 and name != "lm_head":
                    r.update(gemv_vs_cublas(x, w, args.iters))
                if 2 <= M <= 64 and name != "lm_head":
                    r.update(rows_vs_cublas(x, w, args.iters))
                    r.update(rows_forms(name, M, w, args.iters, chain_us))  # the model's form, cold weights
                    if M in args.rows_sweep:
                        r["rows_sweep"] = rows_sweep(x, w, args.iters)
                out.append(r)
                print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
            del w
    return out


def engine_step_ms(eng, B, ctx, vocab, args, SamplingParams) -> float:
    """Median wall time of ``engine.step()`` with B sequences in steady decode."""
    g = torch.Generator().manual_seed(B)
    profile = (args.profile_engine and eng.device.type == "cuda"
               and B in (args.profile_batches or [max(args.batch)]))
    n = args.engine_steps + 8 + (5 if profile else 0)
    for i in range(B):
        prompt = torch.randint(0, vocab, (ctx - 1,), generator=g).tolist()
        eng.add_request(f"b{B}-{i}", prompt, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n))
    # prefill everything, then a few warm decode steps
    while eng.scheduler.waiting or eng.scheduler.prefilling or any(s.num_output_tokens == 0 for s in eng.scheduler.running):
        eng.step()
    for _ in range(3):
        eng.step()
    times = []
    outputs_for = None if args.engine_outputs == "all" else ()
    for _ in range(args.engine_steps):
        t0 = time.perf_counter()
        eng.step(outputs_for=outputs_for)
        times.append(time.perf_counter() - t0)
    if profile:  # the whole step's GPU kernels: forward, LM head, sampler, copies
        from kernel_table import profile_kernels

        def five():
            for _ in range(5):
                eng.step(outputs_for=outputs_for)

        profile_kernels(five, f"engine step B={B}, 5 steps", 40)
    eng.abort_all()
    return statistics.median(times)


def bench_kernels(args) -> dict:
    """Attention kernels (bf16): decode on a Qwen3-0.6B layer (16 query heads, 8 KV heads,
    head_dim 128) and a SmolLM2-135M layer (9 / 3 / 64); prefill on the Qwen3 layer."""
    import torch.nn.functional as F

    from rlserve.layers import triton_attention as ta
    from rlserve.layers.attention import AttentionMetadata, torch_paged_attention

    dev = torch.device("cuda")
    P = 16
    dt = torch.bfloat16
    out = {"decode": [], "decode_sweep": [], "prefill": []}

    def cache_for(seq_lens, Hkv, D):
        per = [-(-s // P) for s in seq_lens]
        nb = sum(per) + 1
        perm = torch.randperm(nb).tolist()
        tables, i = [], 0
        for n in per:
            tables.append(perm[i : i + n])
            i += n
        kc = torch.randn(nb, P, Hkv, D, device=dev, dtype=dt)
        vc = torch.randn(nb, P, Hkv, D, device=dev, dtype=dt)
        return kc, vc, tables

    layers = (("qwen3-0.6b", (16, 8, 128)), ("smollm2-135m", (9, 3, 64)))
    for ctx, (layer, (H, Hkv, D)), B in itertools.product(args.kernel_contexts, layers, args.batch):
        kc, vc, tables = cache_for([ctx] * B, Hkv, D)
        meta = AttentionMetadata.build([1] * B, [ctx] * B, tables, P, dev)
        q = torch.randn(B, H, D, device=dev, dtype=dt)
        kv = B * ctx * Hkv * D * 2 * 2
        t_tr = cuda_time(lambda: ta.triton_paged_attention(q, kc, vc, meta, D**-0.5))
        t_gr = graph_time(lambda: ta.triton_paged_attention(q, kc, vc, meta, D**-0.5))
        row = {"layer": layer, "batch": B, "context": ctx, "triton_us": t_tr * 1e6,
               "triton_graph_us": t_gr * 1e6, "triton_kv_TBps": kv / t_gr / 1e12,
               "splits": ta.plan_num_splits(B, Hkv, ctx, dev)}
        if B * ctx <= 64 * 1024:  # the padded torch path materialises B x H x ctx scores
            row["torch_us"] = cuda_time(lambda: torch_paged_attention(q, kc, vc, meta, D**-0.5), iters=5) * 1e6
        # best case for a library kernel: contiguous [B, Hkv, ctx, D] K/V (no paging) through
        # PyTorch's SDPA (flash / cuDNN / efficient backends, whichever it picks), one query each
        kk = torch.randn(B, Hkv, ctx, D, device=dev, dtype=dt)
        vv = torch.randn(B, Hkv, ctx, D, device=dev, dtype=dt)
        qq = q.view(B, H, 1, D)
        try:
            t = graph_time(lambda: F.scaled_dot_product_attention(qq, kk, vv, enable_gqa=True))
            row["sdpa_contiguous_graph_us"] = t * 1e6
        except Exception as e:  # a backend may refuse the shape
            row["sdpa_error"] = repr(e)[:160]
        del kk, vv
        if args.sweep and layer == "qwen3-0.6b":  # split-K plan: forced split counts
            for S in (1, 2, 4, 8, 16, 32):
                t = graph_time(lambda: ta.triton_paged_attention(q, kc, vc, meta, D**-0.5, num_splits=S))
                row[f"splits{S}_us"] = round(t * 1e6, 1)
        out["decode"].append(row)
        print("decode", json.dumps(row), flush=True)
        if args.sweep and B == max(args.batch) and ctx == args.kernel_contexts[0]:
            base = (ta.DECODE_BLOCK_N, ta.DECODE_NUM_WARPS)
            for bn in (32, 64, 128):
                for nw in (4, 8):
                    ta.DECODE_BLOCK_N, ta.DECODE_NUM_WARPS = bn, nw
                    try:
                        t = graph_time(lambda: ta.triton_paged_attention(q, kc, vc, meta, D**-0.5))
                        r = {"layer": layer, "batch": B, "block_n": bn, "num_warps": nw, "us": t * 1e6,
                             "kv_TBps": kv / t / 1e12}
                    except Exception as e:  # a config may not compile
                        r = {"layer": layer, "batch": B, "block_n": bn, "num_warps": nw, "error": repr(e)[:200]}
                    out["decode_sweep"].append(r)
                    print("sweep", json.dumps(r), flush=True)
            ta.DECODE_BLOCK_N, ta.DECODE_NUM_WARPS = base
        del kc, vc

    ctx = args.context
    H, Hkv, D = 16, 8, 128
    cases = [("8x1024 prompts", [1024] * 8, [1024] * 8), ("32x256 prompts", [256] * 32, [256] * 32),
             ("4x512 new on 1024 cached", [512] * 4, [1536] * 4)]
    for name, ql, sl in cases:
        kc, vc, tables = cache_for(sl, Hkv, D)
        meta = AttentionMetadata.build(ql, sl, tables, P, dev)
        T = sum(ql)
        q = torch.randn(T, H, D, device=dev, dtype=dt)
        flops = sum(4 * H * D * (q_ * (s - q_) + q_ * (q_ + 1) / 2) for q_, s in zip(ql, sl))
        t_tr = cuda_time(lambda: ta.triton_paged_attention(q, kc, vc, meta, D**-0.5))
        row = {"case": name, "tokens": T, "triton_us": t_tr * 1e6, "triton_TFLOPs": flops / t_tr / 1e12}
        row["torch_us"] = cuda_time(lambda: torch_paged_attention(q, kc, vc, meta, D**-0.5), iters=5) * 1e6
        if ql == sl:  # no cache hit: flash SDPA on padded contiguous [B, H, L, D]
            L = max(ql)
            qq = torch.randn(len(ql), H, L, D, device=dev, dtype=dt)
            kk = torch.randn(len(ql), Hkv, L, D, device=dev, dtype=dt)
            vv = torch.randn(len(ql), Hkv, L, D, device=dev, dtype=dt)
            try:
                t = cuda_time(lambda: F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True))
                row["sdpa_padded_us"] = t * 1e6
            except Exception as e:
                row["sdpa_padded_error"] = repr(e)[:200]
        out["prefill"].append(row)
        print("prefill", json.dumps(row), flush=True)
        if args.sweep and name.startswith("8x1024"):
            base = (ta.PREFILL_BLOCK_M, ta.PREFILL_BLOCK_N)
            for bm, bn in ((64, 64), (128, 64), (128, 32), (64, 32)):
                ta.PREFILL_BLOCK_M, ta.PREFILL_BLOCK_N = bm, bn
                try:
                    t = cuda_time(lambda: ta.triton_paged_attention(q, kc, vc, meta, D**-0.5))
                    r = {"case": name, "block_m": bm, "block_n": bn, "us": t * 1e6}
                except Exception as e:
                    r = {"case": name, "block_m": bm, "block_n": bn, "error": repr(e)[:200]}
                out.setdefault("prefill_sweep", []).append(r)
                print("sweep", json.dumps(r), flush=True)
            ta.PREFILL_BLOCK_M, ta.PREFILL_BLOCK_N = base
        del kc, vc
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-0.6b", help="comma-separated shapes from model_shapes.py")
    ap.add_argument("--batch", default="1,64,256", help="comma-separated batch sizes")
    ap.add_argument("--context", type=int, default=1024, help="tokens in each sequence's context")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="the KV cache's dtype (auto, fp8, fp8_e4m3, fp8_e5m2); comma-separated: each in turn in "
                         "this process (a cache of most of the GPU is not handed back in between: then one process "
                         "each)")
    ap.add_argument("--decode-gemv", default=None,
                    help="comma-separated 0 / 1 / pdl / pdla / auto: one engine each with the batch-1 GEMV path off / "
                         "on / on with programmatic dependent launch for the GEMVs / for the attention kernels between "
                         "them too / as pdl for linears of at most 8M weights (rlserve.layers.gemv, "
                         "rlserve.layers.pdl.set_neighbours; default: RLSERVE_DECODE_GEMV); MODE:N also runs steps of "
                         "2..N rows through the small-batch GEMM (RLSERVE_DECODE_GEMM_ROWS=N; MODE alone: 0), MODE:Nf with "
                         "the add + RMSNorm / SiLU-and-mul folded into it (RLSERVE_DECODE_GEMM_ROWS_FOLD=1)")
    ap.add_argument("--fp8-operand", default=None,
                    help="an fp8 cache's dot operands: bf16 / f16 / asm (rlserve.layers.triton_attention.FP8_OPERAND; "
                         "default: that module's); optionally :N for DECODE_BLOCK_N_FP8, e.g. f16:128")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--engine-steps", type=int, default=0, help="also time this many full engine steps")
    ap.add_argument("--batch1-tokens", type=int, default=0,
                    help="with batch 1: also time a --batch1-prompt-len-token prompt decoding this many greedy tokens "
                         "through LLM.generate (throughput.py's batch-1 ms/token) and its host-side gap "
                         "(batch1_latency.py)")
    ap.add_argument("--batch1-prompt-len", type=int, default=128)
    ap.add_argument("--engine-outputs", choices=("finished", "all"), default="finished",
                    help="engine steps build outputs for finished requests only (offline / non-streamed) or all")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--kernels", action="store_true", help="attention kernel micro-benchmarks")
    ap.add_argument("--kernel-contexts", default=None,
                    help="comma-separated contexts for the decode kernel micro-benchmarks (default: --context)")
    ap.add_argument("--sweep", action="store_true", help="with --kernels: tile-configuration sweeps")
    ap.add_argument("--profile", action="store_true", help="profile the largest batch of each shape")
    ap.add_argument("--profile-batches", default=None,
                    help="with --profile / --profile-engine: the batch sizes to profile (default: the largest)")
    ap.add_argument("--profile-engine", action="store_true",
                    help="with --engine-steps: kernel table of 5 engine steps (forward, LM head, sampler)")
    ap.add_argument("--gemms", action="store_true", help="cuBLAS time of each linear of --shape at --gemm-rows rows (at 1 row also "
                         "the batch-1 GEMV, plain and PDL, against cuBLAS in chains of 10 launches; at 2..64 the "
                         "small-batch GEMM, and each linear in the model's form with cold weights: rows_forms.py)")
    ap.add_argument("--gemm-rows", default="1,16,64,128,256,8192")
    ap.add_argument("--rows-sweep", default="", help="with --gemms: comma-separated row counts (of --gemm-rows, 2..64) "
                    "at which each linear also times the small-batch GEMM's tiles of ROWS_SWEEP")
    ap.add_argument("--no-models", action="store_true", help="skip the model decode-step part")
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark); cpu only smoke-tests this script")
    args = ap.parse_args(argv)
    args.batch = [int(x) for x in args.batch.split(",")]
    args.rows_sweep = [int(x) for x in args.rows_sweep.split(",") if x]
    args.profile_batches = [int(x) for x in args.profile_batches.split(",")] if args.profile_batches else None
    args.kernel_contexts = [int(x) for x in (args.kernel_contexts or str(args.context)).split(",")]
    from rlserve.layers import gemv, pdl

    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("decode_step.py needs a CUDA GPU (or --device cpu for a smoke test)")
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    info = {
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__, "triton": triton_version,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "fused_kernels": os.environ.get("RLSERVE_FUSED_KERNELS", "1") != "0",
        "fused_sampler": os.environ.get("RLSERVE_FUSED_SAMPLER", "1") != "0",
        "engine_outputs": args.engine_outputs,
        "cuda_driver": pdl.cuda_driver_version() if dev.type == "cuda" else None,
        "pdl_unavailable": pdl.unavailable(dev),  # None: the GEMVs' PDL runs on this device
        "command": " ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
    }
    try:  # before any engine is built: its CUDA graphs capture the kernel variant
        from rlserve.layers import triton_attention as ta

        info["fp8_operand"] = ta.set_fp8_operand(args.fp8_operand or ta.FP8_OPERAND)
    except ImportError:  # no triton
        info["fp8_operand"] = None
    args.fp8_label = info["fp8_operand"]
    bw = measure_copy_bandwidth(dev)
    info["copy_bandwidth_TBps"] = bw / 1e12
    print(json.dumps(info), flush=True)
    result = {"info": info, "models": [], "kernels": None}
    if args.kernels and dev.type == "cuda":
        result["kernels"] = bench_kernels(args)
    if args.gemms and dev.type == "cuda":
        result["gemms"] = bench_gemms(args, args.shape.split(","))
    if not args.no_models:
        with tempfile.TemporaryDirectory() as root:
            kvs = args.kv_cache_dtype.split(",")
            gemvs = [None] if args.decode_gemv is None else args.decode_gemv.split(",")
            for shape in args.shape.split(","):
                for args.kv_cache_dtype, on in itertools.product(kvs, gemvs):  # one engine each, in turn
                    if on is not None:  # before the engine is built: its CUDA graphs capture the choice
                        mode, _, n_rows = on.partition(":")
                        gemv.set_rows_fold(n_rows.endswith("f"))  # N f: the norm / SiLU folded into the GEMM
                        n_rows = n_rows.rstrip("f")
                        gemv.set_enabled("auto" if mode == "auto" else mode != "0")
                        gemv.set_pdl(mode in ("pdl", "pdla", "auto"))
                        pdl.set_neighbours(mode == "pdla")
                        gemv.set_rows(int(n_rows or 0))
                    try:
                        rows = bench_shape(shape, args, bw, root)
                    except Exception as e:  # noqa: BLE001 -- one variant's failure must not lose the others
                        if on is None:
                            raise
                        print(f"  [{shape}] decode_gemv={on}: {type(e).__name__}: {e}", flush=True)
                        continue
                    for r in rows:
                        r["decode_gemv"] = on if on is not None else gemv.mode()
                    result["models"].extend(rows)
            args.kv_cache_dtype = ",".join(kvs)
        print(f"\n{'shape':14s} {'gemv':>7s} {'kv':>8s} {'B':>4s} {'ctx':>5s} {'floor ms':>9s} {'graph ms':>9s} {'eager ms':>9s} "
              f"{'graph x':>8s} {'x floor':>8s} {'engine ms':>9s} {'b1 ms/tok':>9s} {'b1 gpu':>7s} {'b1 gap':>7s} {'launch':>7s} {'wait':>7s}")
        for r in result["models"]:
            print(f"{r['shape']:14s} {r['decode_gemv']:>7s} {r['kv_cache_dtype']:>8s} {r['batch']:4d} {r['context']:5d} {r['floor_ms']:9.3f} "
                  f"{r.get('graph_ms', float('nan')):9.3f} {r['eager_ms']:9.3f} "
                  f"{(r['graph_speedup'] or float('nan')):8.2f} {r['x_floor']:8.2f} "
                  f"{r.get('engine_step_ms', float('nan')):9.3f} {r.get('batch1_ms_per_token', float('nan')):9.3f} "
                  f"{r.get('gpu_ms_per_step') or float('nan'):7.3f} {r.get('gap_ms') or float('nan'):7.3f} "
                  f"{r.get('launch_host_ms') or float('nan'):7.3f} {r.get('wait_ms') or float('nan'):7.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
