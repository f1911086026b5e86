"""The HBM floor and the roofline of a whole offline workload (issue 37), recorded from the
engine's own steps: ``benchmarks/throughput.py --floor`` wraps its timed run in a
:class:`FloorRecorder`."""

from __future__ import annotations

import time

import torch


class FloorRecorder:
    """While entered (the timed run), records every launched step and sums the bytes it must
    read at least: every weight once (``decode_step.weight_bytes``: the LM head once; of an MoE
    layer the experts that many tokens are expected to touch) plus the KV of every token each
    sequence attends to (``len(seq)``: context + this step's tokens; ``layers x 2 x kv_heads x
    head_dim x itemsize`` bytes a token); and the FLOPs it must do at least: 2 x (weights a
    token multiplies) a token, 2 x (LM head) a sampled row, 4 x layers x query heads x head_dim
    a (query, key) pair of attention. :meth:`result` divides by the device-to-device copy
    bandwidth (``decode_step.measure_copy_bandwidth``: read + write bytes / s) and by the bf16
    matmul rate (:func:`measure_matmul_flops`), both measured then. Prefill steps are
    compute-bound, so their bytes floor is a loose bound (reported apart; the roofline takes the
    larger of the two per step). Recording costs the host a sum over the batch's sequences per
    step (~10-20 us at 256), off the GPU's path under overlap."""

    def __init__(self, engine):
        self.engine = engine
        runner = engine.executor.runner
        layer = runner.attn_layers[0]
        item = torch.tensor([], dtype=runner.kv_cache_dtype).element_size()
        self.kv_tok = len(runner.attn_layers) * 2 * layer.num_kv_heads * layer.head_dim * item
        self.tok_params, self.head_params = flop_params(engine.model)
        self.pair_flops = 4 * len(runner.attn_layers) * layer.num_heads * layer.head_dim
        self.wb: dict[int, int] = {}
        self.acc = {f"{k}_{v}": 0 for k in ("prefill", "decode") for v in ("steps", "weight_bytes", "kv_bytes", "flops")}
        self.steps: list[tuple[int, int]] = []  # (bytes, FLOPs) of each step
        # the step trace: one dict a step (:data:`TRACE_KEYS`), see :func:`summarize_steps`
        self.trace: list[dict] = []
        runner = engine.executor.runner
        self._graphs = lambda: getattr(runner, "cuda_graphs", None)
        self.launch0 = None

    def __enter__(self):
        from decode_step import weight_bytes

        eng, acc, launch0 = self.engine, self.acc, self.engine._launch
        self.launch0 = launch0

        def launch(batch, *a, **kw):
            n = batch.num_tokens
            if n not in self.wb:
                self.wb[n] = weight_bytes(eng.model, n)
            kind = "prefill" if batch.is_prefill else "decode"
            attended = sum(len(s) for s in batch.seqs)
            if batch.is_prefill:  # new tokens attend to the cached ones and causally to each other
                pairs = 0
                for s in batch.seqs:
                    c, new = s.num_cached_tokens, len(s) - s.num_cached_tokens
                    pairs += c * new + new * (new + 1) // 2
            else:
                pairs = attended
            linear = 2 * self.tok_params * n + 2 * self.head_params * len(batch.seqs)
            flops = linear + self.pair_flops * pairs
            acc[f"{kind}_steps"] += 1
            acc[f"{kind}_weight_bytes"] += self.wb[n]
            acc[f"{kind}_kv_bytes"] += self.kv_tok * attended
            acc[f"{kind}_flops"] += flops
            self.steps.append((self.wb[n] + self.kv_tok * attended, flops))
            self.trace.append(dict(t=time.perf_counter(), kind="P" if batch.is_prefill else "D", tokens=n,
                                   seqs=len(batch.seqs), rows=self._rows(batch), weight_bytes=self.wb[n],
                                   kv_bytes=self.kv_tok * attended, linear_flops=linear,
                                   attn_flops=self.pair_flops * pairs))
            return launch0(batch, *a, **kw)

        eng._launch = launch
        return self

    def __exit__(self, *exc):
        self.engine._launch = self.launch0
        if self.trace:
            self.trace.append(dict(t=time.perf_counter(), kind="end"))

    def _rows(self, batch) -> int:
        """Rows the step computes: a decode step that replays a CUDA graph computes the graph's
        batch size (the padded rows included); any other step its tokens."""
        g = self._graphs()
        n = batch.num_tokens
        if batch.is_prefill or g is None or not g.can_run(n, max(len(s) for s in batch.seqs)):
            return n
        return g.padded_size(n)

    def result(self, timed_s: float, device: str, dtype: str) -> dict:
        """The sums; ``floor_s`` (prefill + decode bytes / bandwidth) and ``x_floor`` = ``timed_s``
        / floor; ``roofline_s`` (per step the larger of bytes / bandwidth and FLOPs / matmul rate,
        summed) and ``x_roofline``."""
        from decode_step import measure_copy_bandwidth

        acc = dict(self.acc)
        dev = torch.device(device)
        try:
            bw = measure_copy_bandwidth(dev)
        except torch.OutOfMemoryError:  # a full card (a 61 GB MoE model at 0.92): 2 x 256 MiB still measures it
            torch.cuda.empty_cache()
            bw = measure_copy_bandwidth(dev, nbytes=256 * 1024**2, iters=50)
        peak = measure_matmul_flops(dev, dtype)
        for kind in ("prefill", "decode"):
            acc[f"{kind}_floor_s"] = (acc[f"{kind}_weight_bytes"] + acc[f"{kind}_kv_bytes"]) / bw
        acc.update(copy_bandwidth_TBps=bw / 1e12, matmul_TFLOPs=peak / 1e12, kv_bytes_per_token=self.kv_tok,
                   floor_s=acc["prefill_floor_s"] + acc["decode_floor_s"],
                   roofline_s=sum(max(b / bw, f / peak) for b, f in self.steps))
        acc["x_floor"] = timed_s / acc["floor_s"]
        acc["x_roofline"] = timed_s / acc["roofline_s"]
        if self.trace:
            acc["steps"] = summarize_steps(self.trace, bw, peak)
            acc["serial_floor_s"] = acc["steps"]["serial_floor_s"]
            acc["x_serial_floor"] = timed_s / acc["serial_floor_s"]
        print("floor:", {k: round(v, 4) if isinstance(v, float) else v for k, v in acc.items()}, flush=True)
        return acc


#: decode batch-size buckets of :func:`summarize_steps` (upper bounds, inclusive)
BATCH_BUCKETS = (1, 8, 32, 64, 128, 192, 256, 1 << 30)


def summarize_steps(trace: list[dict], bw: float, peak: float) -> dict:
    """Where a recorded run's steps went (the step trace of :class:`FloorRecorder`).

    ``trace``: one dict a launched step (``t`` perf_counter seconds at its launch, ``kind`` "P" /
    "D", ``tokens``, ``seqs``, ``rows`` computed incl. a CUDA graph's padded rows,
    ``weight_bytes``, ``kv_bytes``, ``linear_flops``, ``attn_flops``), then ``{"kind": "end"}`` at
    the run's end. A step's time is the interval from its launch to the next launch (overlapped
    decode launches step N+1 while step N runs, so this is the step's share of the pipeline).
    ``bw``: copy bandwidth in bytes/s, ``peak``: matmul FLOP/s (both measured in the same run).

    Returns per kind and per decode batch bucket (:data:`BATCH_BUCKETS`): steps, seconds, rows,
    padded rows, and the *serial floor* in seconds: per step ``max(weight bytes / bw, linear
    FLOPs / peak) + max(KV bytes / bw, attention FLOPs / peak)`` -- the weights-and-GEMMs kernels
    and the attention kernels one after the other at their own bound (what an engine that runs
    them in sequence, as rlserve and vLLM do, can reach at most); ``serial_floor_s`` its sum."""
    steps = [s for s in trace if s["kind"] != "end"]
    ends = [s["t"] for s in trace[1:]]
    out = {"P": _bucket(), "D": {}}
    total = 0.0
    for s, t1 in zip(steps, ends, strict=False):
        serial = (max(s["weight_bytes"] / bw, s["linear_flops"] / peak)
                  + max(s["kv_bytes"] / bw, s["attn_flops"] / peak))
        total += serial
        if s["kind"] == "P":
            b = out["P"]
        else:
            key = next(f"<={u}" if u < 1 << 30 else "more" for u in BATCH_BUCKETS if s["seqs"] <= u)
            b = out["D"].setdefault(key, _bucket())
        b["steps"] += 1
        b["seconds"] += t1 - s["t"]
        b["tokens"] += s["tokens"]
        b["rows"] += s["rows"]
        b["padded_rows"] += s["rows"] - s["tokens"]
        b["serial_floor_s"] += serial
    for b in [out["P"], *out["D"].values()]:
        b["x_serial_floor"] = b["seconds"] / b["serial_floor_s"] if b["serial_floor_s"] else None
    out["D"] = dict(sorted(out["D"].items(), key=lambda kv: BATCH_BUCKETS.index(
        int(kv[0][2:]) if kv[0] != "more" else 1 << 30)))
    out["serial_floor_s"] = total
    return out


def _bucket() -> dict:
    return {"steps": 0, "seconds": 0.0, "tokens": 0, "rows": 0, "padded_rows": 0, "serial_floor_s": 0.0}


def write_trace(trace: list[dict], path: str) -> None:
    """The step trace as JSON lines (one step a line, times relative to the first launch)."""
    import json

    t0 = trace[0]["t"] if trace else 0.0
    with open(path, "w") as f:
        for s in trace:
            f.write(json.dumps({**s, "t": round(s["t"] - t0, 6)}) + "\n")


def flop_params(model) -> tuple[int, int]:
    """``(weights a token multiplies, LM head weights)`` in elements: every parameter but the
    input embedding and the LM head (a tied embedding is the LM head), of an MoE layer's experts
    ``top_k / num_experts``; the LM head apart (it multiplies only the sampled rows)."""
    from rlserve.layers.moe import FusedMoE

    head_w = getattr(getattr(model, "lm_head", None), "weight", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    skip = {id(p) for p in embed.parameters()} if embed is not None else set()
    if head_w is not None:
        skip.add(id(head_w))
    total = 0.0
    for m in model.modules():
        if isinstance(m, FusedMoE):
            params = list(m.parameters(recurse=False))
            skip |= {id(p) for p in params}
            total += sum(p.numel() for p in params) * m.top_k / m.num_experts
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) not in skip and id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return int(total), (head_w.numel() if head_w is not None else 0)


def measure_matmul_flops(device: torch.device, dtype: str, n: int = 8192, iters: int = 10) -> float:
    """Dense matmul rate in FLOP/s: ``[n, n] @ [n, n]`` in ``dtype`` (CPU smoke runs: n = 512)."""
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    if device.type != "cuda":
        n = 512
    a = torch.randn(n, n, device=device).to(dt)
    b = torch.randn(n, n, device=device).to(dt)
    for _ in range(3):
        a @ b
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync()
    return 2 * n ** 3 * iters / (time.perf_counter() - t0)


def estimate_serial_floor(shape: str, bw: float, peak: float, num_seqs: int = 256, min_len: int = 100,
                          max_len: int = 1024, seed: int = 0, itemsize: int = 2) -> dict:
    """The serial floor of ``throughput.py``'s offline workload for a dense shape of
    ``benchmarks/model_shapes.py`` without running it (the same formula as :func:`summarize_steps`,
    on an idealised schedule: every prompt prefilled first, then decode step ``t = 1 ..`` runs every
    sequence whose output length exceeds ``t``, attending to its prompt + ``t`` tokens).

    ``bw``: copy bandwidth in bytes/s, ``peak``: matmul FLOP/s the GEMMs reach (at the power cap
    for a batch-256 8B step: ~640 TFLOPS on an H100, gate_up's rate in BENCHMARKS.md D2).
    Weights: every linear of a layer (q / k / v / o, gate / up / down) and the LM head, ``itemsize``
    bytes each (norms are < 0.01% and left out). Returns seconds: ``prefill_s`` (GEMMs + causal
    attention FLOPs), ``decode_s`` and its parts (steps bound by the weights' read, steps bound by
    GEMM FLOPs, KV reads), ``total_s``. Raises ValueError for a mixture-of-experts shape."""
    from model_shapes import shape_config
    from throughput import make_workload

    c = shape_config(shape)
    if getattr(c, "num_experts", 0):
        raise ValueError(f"{shape}: dense shapes only (expert reads depend on routing)")
    h, layers = c.hidden_size, c.num_hidden_layers
    hd = getattr(c, "head_dim", None) or h // c.num_attention_heads
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    tok = layers * (h * (q + 2 * kv) + q * h + 3 * h * c.intermediate_size)  # weights a token multiplies
    head = c.vocab_size * h
    weights = (tok + head) * itemsize
    kv_tok = layers * 2 * kv * itemsize
    pair = 4 * layers * q  # FLOPs of one (query, key) pair: QK^T and PV over every query head
    prompts, outs = make_workload(num_seqs, min_len, max_len, c.vocab_size, seed)
    plen = [len(p) for p in prompts]
    prefill = (2 * tok * sum(plen) + 2 * head * num_seqs + pair * sum(n * (n + 1) // 2 for n in plen)) / peak
    w_s = g_s = kv_s = 0.0
    for t in range(1, max(outs)):
        live = [i for i, o in enumerate(outs) if o > t]
        w, g = weights / bw, 2 * (tok + head) * len(live) / peak
        w_s += w if w > g else 0.0
        g_s += g if g >= w else 0.0
        kv_s += max(kv_tok * sum(plen[i] + t for i in live) / bw, pair * sum(plen[i] + t for i in live) / peak)
    dec = w_s + g_s + kv_s
    return {"shape": shape, "bw_TBps": bw / 1e12, "peak_TFLOPs": peak / 1e12, "weight_bytes": weights,
            "kv_bytes_per_token": kv_tok, "prefill_s": prefill, "decode_s": dec, "decode_weights_bound_s": w_s,
            "decode_gemm_bound_s": g_s, "decode_kv_s": kv_s, "total_s": prefill + dec}


def main(argv=None) -> None:
    """``python benchmarks/workload_floor.py --shape qwen3-8b --bw-tbps 4.24 --tflops 640``: print
    :func:`estimate_serial_floor` (JSON)."""
    import argparse
    import json

    ap = argparse.ArgumentParser(description=estimate_serial_floor.__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--bw-tbps", type=float, required=True, help="copy bandwidth, TB/s (read + write)")
    ap.add_argument("--tflops", type=float, required=True, help="the GEMMs' bf16 rate, TFLOP/s")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    res = estimate_serial_floor(a.shape, a.bw_tbps * 1e12, a.tflops * 1e12, a.num_seqs, a.min_len, a.max_len,
                                a.seed)
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}))


if __name__ == "__main__":
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
