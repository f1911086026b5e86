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
        bw = measure_copy_bandwidth(dev)
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
