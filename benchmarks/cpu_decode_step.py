"""CPU decode step of the default model, piece by piece: attention per layer and the whole step.

Measures CPU time (``time.thread_time`` / ``time.process_time``) as well as wall time: on a
machine shared with other work, wall time mostly measures the other work, while CPU time of a
one-thread run stays close to what the code costs (cache and memory-bandwidth contention
still inflate it). Prints the machine's load average with every figure.

- attention: one layer's decode attention for ``--batch`` sequences of 128-512 tokens
  (SmolLM2-135M shapes: 9 heads, 3 KV heads, head_dim 64, blocks of 16, shuffled block
  tables), one thread: the native kernel (``rlserve/layers/cpu_attention.py``), the PyTorch
  fallback (index_select of blocks + SDPA), and the gather + SDPA code it replaced.
- step: the whole model's decode step (``Worker.execute``) on the real SmolLM2-135M-Instruct
  weights at ``--batch`` sequences, for each ``--threads`` value.
- ``--ab-team N``: instead, the decode step with the CPU team in use and not, alternating
  step by step (N steps each), wall and CPU ms; one JSON line per batch size.
- ``--ab-fast-layer N``: instead, the decode step with :mod:`rlserve.models.llama_cpu`'s fast
  path off and on, alternating step by step (N steps each, one thread), after checking that
  the two give bit-equal logits; prints one JSON line per batch size.
- ``--ab-stack N``: the same for ``llama_cpu.stack_forward`` (a team step's layers in one C
  call) off and on, the team in use.
- ``--ab-rev REV N``: the same for the CPU kernels of git revision ``REV`` ("off": ``cpu_team.c``
  and ``paged_decode.c`` with what they include, built from ``git show REV:...``, their own team
  of workers started) against this tree's ("on"), the team in use; the logits' largest
  difference and whether every row's argmax agrees are printed (kernels that round differently
  are not bit-equal).

Usage:
    python benchmarks/cpu_decode_step.py                       # batch 64, threads 1 and 2
    python benchmarks/cpu_decode_step.py --batch 1 --threads 1 --skip-attention
    python benchmarks/cpu_decode_step.py --ab-fast-layer 100 --batch 1 4 16 64
    python benchmarks/cpu_decode_step.py --ab-team 30 --batch 1 16 32 64
    python benchmarks/cpu_decode_step.py --ab-stack 30 --batch 1 16
    python benchmarks/cpu_decode_step.py --ab-rev main 30 --batch 16 1
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlserve.layers import cpu_attention  # noqa: E402
from rlserve.layers.attention import AttentionMetadata, torch_paged_attention  # noqa: E402


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def _case(batch: int, bs: int = 16, num_blocks: int = 4096, seed: int = 0):
    rng = random.Random(seed)
    lens = [rng.randint(128, 512) for _ in range(batch)]
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in lens]
    return lens, tables


def gather_sdpa_before(q, k_cache, v_cache, meta, scale):
    """The decode path before the kernel (advanced indexing of [B, n_blocks], slice, SDPA)."""
    B, H, D = q.shape
    n_blocks = -(-meta.max_seq_len // meta.block_size)
    bt = meta.block_tables[:, :n_blocks].long()
    mask = (torch.arange(meta.max_seq_len)[None, :] < meta.seq_lens.long()[:, None])[:, None, None, :]
    k = k_cache[bt].flatten(1, 2)[:, : meta.max_seq_len].transpose(1, 2)
    v = v_cache[bt].flatten(1, 2)[:, : meta.max_seq_len].transpose(1, 2)
    return F.scaled_dot_product_attention(q.view(B, 1, H, D).transpose(1, 2), k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=True).transpose(1, 2).reshape(B, H, D)


def bench_attention(batch: int, reps: int) -> None:
    torch.set_num_threads(1)
    lens, tables = _case(batch)
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(4096, 16, 3, 64, generator=g), torch.randn(4096, 16, 3, 64, generator=g)
    q = torch.randn(batch, 9, 64, generator=g)
    ref = gather_sdpa_before(q, kc, vc, AttentionMetadata.build([1] * batch, lens, tables, 16), 0.125)

    def kernel(q, kc, vc, meta, scale):
        return cpu_attention.paged_decode(q, kc, vc, meta.block_tables, meta.seq_lens, scale)

    def fallback(q, kc, vc, meta, scale):
        os.environ["RLSERVE_CPU_ATTENTION"] = "torch"
        try:
            return torch_paged_attention(q, kc, vc, meta, scale)
        finally:
            del os.environ["RLSERVE_CPU_ATTENTION"]

    print(f"attention, one layer, batch {batch}, contexts 128-512 (mean {sum(lens) / batch:.0f}), 1 thread:")
    for name, fn in (("gather + SDPA (before)", gather_sdpa_before), ("index_select + SDPA (fallback)", fallback),
                     ("native kernel", kernel)):
        meta = AttentionMetadata.build([1] * batch, lens, tables, 16)
        err = (fn(q, kc, vc, meta, 0.125) - ref).abs().max().item()
        cpu, wall = [], []
        for _ in range(reps):
            c0, w0 = time.thread_time(), time.perf_counter()
            fn(q, kc, vc, meta, 0.125)
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - w0)
        print(f"  {name:32s} CPU {1e3 * statistics.median(cpu):7.2f} ms  wall {1e3 * statistics.median(wall):7.2f} ms"
              f"  max|diff| {err:.1e}  load {_load()}")


def _worker(threads: int):
    from rlserve.config import EngineConfig
    from rlserve.download import ensure_default_model
    from rlserve.engine.worker.worker import Worker

    cfg = EngineConfig(model=str(ensure_default_model(progress=False)), dtype="float32", device="cpu",
                       max_model_len=1024, num_kv_blocks=4096, extra={"cpu_threads": threads})
    w = Worker(cfg)
    w.init_kv_cache(4096)
    return w


def _decode_step(batch: int):
    from rlserve.engine.worker.model_runner import StepInput

    lens, tables = _case(batch)
    rng = random.Random(1)
    return StepInput([rng.randrange(49152) for _ in range(batch)], [n - 1 for n in lens], [1] * batch, lens, tables,
                     list(range(batch)), False)


def bench_switch_ab(w, batch: int, steps: int, switch, name: str) -> None:
    """One JSON line: ms per decode step with ``switch(False)`` / ``switch(True)`` (a setter that
    returns the previous setting, e.g. :func:`rlserve.models.llama_cpu.set_enabled`), alternating
    step by step (which goes first alternates too): medians of the calling thread's CPU
    (``time.thread_time``), the process's CPU (``time.process_time``: team workers included) and
    wall time, and the median of the paired thread-CPU differences, after checking that the two
    give bit-equal logits."""
    import json

    step = _decode_step(batch)
    logits = {}
    for on in (False, True):
        switch(on)
        logits[on] = w.execute(step).clone()
    for _ in range(3):
        w.execute(step)
    res: dict = {k: [] for k in ("off", "on", "off_proc", "on_proc", "off_wall", "on_wall")}
    load0 = os.getloadavg()[0]
    for i in range(steps):
        for on in ((False, True) if i % 2 == 0 else (True, False)):
            switch(on)
            k = "on" if on else "off"
            c0, p0, w0 = time.thread_time(), time.process_time(), time.perf_counter()
            w.execute(step)
            res[k].append(1e3 * (time.thread_time() - c0))
            res[k + "_proc"].append(1e3 * (time.process_time() - p0))
            res[k + "_wall"].append(1e3 * (time.perf_counter() - w0))
    switch(True)
    diffs = sorted(a - b for a, b in zip(res["off"], res["on"]))
    print(json.dumps({"ab": name, "batch": batch, "steps_each": steps,
                      "logits_bit_equal": torch.equal(logits[False], logits[True]),
                      "logits_max_abs_diff": float((logits[False] - logits[True]).abs().max()),
                      "same_argmax": torch.equal(logits[False].argmax(-1), logits[True].argmax(-1)),
                      "off_median_ms": round(statistics.median(res["off"]), 2),
                      "on_median_ms": round(statistics.median(res["on"]), 2),
                      "off_mean_ms": round(statistics.mean(res["off"]), 2), "on_mean_ms": round(statistics.mean(res["on"]), 2),
                      **{f"{k}_median_ms": round(statistics.median(v), 2) for k, v in res.items() if "_" in k},
                      "paired_diff_median_ms": round(diffs[len(diffs) // 2], 2),
                      "load_before_after": [round(load0, 2), round(os.getloadavg()[0], 2)]}), flush=True)


def rev_switch(rev: str):
    """A switch for :func:`bench_switch_ab`: ``switch(False)`` makes the CPU team library
    (:mod:`rlserve.layers.cpu_gemm`) and the attention kernel (:mod:`rlserve.layers.cpu_attention`)
    those built from git revision ``rev``'s sources, ``switch(True)`` this tree's; returns the
    previous setting. Call it after the worker started (this tree's team is running): the old
    library gets a team of the same size (its own workers; they spin ``DEFAULT_SPIN_US`` after
    each job, then sleep)."""
    import ctypes
    import tempfile
    from pathlib import Path

    from benchmarks.csrc_revision import compile_lib, sources
    from rlserve.layers import cpu_gemm

    root = Path(__file__).resolve().parent.parent
    tmp = Path(tempfile.mkdtemp(prefix="cpu_rev_"))
    new_team, new_attn = cpu_gemm._lib(), cpu_attention._load()
    old_team = compile_lib(sources(rev, root, "cpu_team.c"), "cpu_team.c", tmp / "team")
    for name, f in list(vars(new_team).items()):  # the entry points cpu_gemm bound, same types
        if isinstance(f, ctypes._CFuncPtr):
            g = getattr(old_team, name)
            g.argtypes, g.restype = f.argtypes, f.restype
    size = cpu_gemm.current().size
    if size > 1:
        old_team.rlserve_team_start(size - 1, cpu_gemm.DEFAULT_SPIN_US)
    old_attn = cpu_attention.bind(compile_lib(sources(rev, root), "paged_decode.c", tmp / "attn"))
    state = {"on": True}

    def switch(on: bool) -> bool:
        prev, state["on"] = state["on"], on
        cpu_gemm._state["lib"] = new_team if on else old_team
        cpu_attention._state["fn"] = new_attn if on else old_attn
        return prev

    return switch


def bench_team_ab(w, batch: int, steps: int) -> None:
    """One JSON line: wall and CPU ms per decode step (``Worker.execute``) with the CPU team
    (:mod:`rlserve.layers.cpu_gemm`) in use and not (the previous default: micro-batches of rows
    from 16 rows, oneDNN's packed copies), alternating step by step (which goes first
    alternates too); medians, and the median of the paired wall differences. Logits of the two
    are compared (same argmax per row; max |diff|)."""
    import json

    from rlserve.layers import cpu_gemm

    team = w.runner.cpu_team or cpu_gemm.current()  # the engine's (made current around every step)
    size = team.size
    step = _decode_step(batch)
    logits = {}
    for on in (False, True):
        team.size = size if on else 1
        logits[on] = w.execute(step).clone()
    res: dict = {"off": [], "on": [], "off_cpu": [], "on_cpu": []}
    load0 = os.getloadavg()[0]
    for i in range(steps):
        for on in ((False, True) if i % 2 == 0 else (True, False)):
            team.size = size if on else 1
            c0, w0 = time.process_time(), time.perf_counter()
            w.execute(step)
            k = "on" if on else "off"
            res[k].append(1e3 * (time.perf_counter() - w0))
            res[k + "_cpu"].append(1e3 * (time.process_time() - c0))
    team.size = size
    diffs = sorted(a - b for a, b in zip(res["off"], res["on"]))
    med = {k: round(statistics.median(v), 2) for k, v in res.items()}
    print(json.dumps({"batch": batch, "steps_each": steps, "team_size": size,
                      "same_argmax": torch.equal(logits[False].argmax(-1), logits[True].argmax(-1)),
                      "logits_max_abs_diff": float((logits[False] - logits[True]).abs().max()),
                      "wall_off_median_ms": med["off"], "wall_on_median_ms": med["on"],
                      "cpu_off_median_ms": med["off_cpu"], "cpu_on_median_ms": med["on_cpu"],
                      "paired_wall_diff_median_ms": round(diffs[len(diffs) // 2], 2),
                      "load_before_after": [round(load0, 2), round(os.getloadavg()[0], 2)]}), flush=True)


def bench_step(batch: int, threads: int, reps: int) -> None:
    w = _worker(threads)
    step = _decode_step(batch)
    for _ in range(2):
        w.execute(step)
    cpu, wall = [], []
    for _ in range(reps):
        c0, w0 = time.process_time(), time.perf_counter()
        w.execute(step)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    print(f"decode step, SmolLM2-135M fp32, batch {batch}, {threads} thread(s): CPU {1e3 * statistics.median(cpu):.0f} ms"
          f"  wall {1e3 * statistics.median(wall):.0f} ms (min {1e3 * min(wall):.0f})  load {_load()}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[64])
    p.add_argument("--ab-fast-layer", type=int, default=0, metavar="STEPS",
                   help="A/B of the llama_cpu fast path (off/on alternating, STEPS each) at every --batch")
    p.add_argument("--ab-stack", type=int, default=0, metavar="STEPS",
                   help="A/B of llama_cpu.stack_forward (a team step's layers in one C call) off/on, alternating, "
                        "STEPS each, at every --batch")
    p.add_argument("--ab-team", type=int, default=0, metavar="STEPS",
                   help="A/B of the CPU team (rlserve.layers.cpu_gemm) on/off, alternating, STEPS each, at every --batch")
    p.add_argument("--ab-rev", nargs=2, default=None, metavar=("REV", "STEPS"),
                   help="A/B of git revision REV's CPU kernels (cpu_team.c, paged_decode.c) against this tree's, "
                        "alternating, STEPS each, at every --batch")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--skip-attention", action="store_true")
    p.add_argument("--skip-step", action="store_true")
    args = p.parse_args(argv)
    if args.ab_team:
        w = _worker(1)
        for b in args.batch:
            bench_team_ab(w, b, args.ab_team)
        return 0
    if args.ab_rev:
        w = _worker(1)
        switch = rev_switch(args.ab_rev[0])
        for b in args.batch:
            bench_switch_ab(w, b, int(args.ab_rev[1]), switch, f"rev {args.ab_rev[0]}")
        return 0
    if args.ab_fast_layer or args.ab_stack:
        from rlserve.models import llama_cpu

        w = _worker(1)
        switch, name = ((llama_cpu.set_enabled, "fast_layer") if args.ab_fast_layer else
                        (llama_cpu.set_stack_enabled, "stack"))
        for b in args.batch:
            bench_switch_ab(w, b, args.ab_fast_layer or args.ab_stack, switch, name)
        return 0
    for batch in args.batch:
        if not args.skip_attention:
            bench_attention(batch, args.reps)
        if not args.skip_step:
            for t in args.threads:
                bench_step(batch, t, max(3, args.reps // 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
