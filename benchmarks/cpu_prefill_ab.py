"""A CPU prefill's time by attention path, in-process (``Worker.execute``), paths interleaved.

For each prompt length ``N`` (``--tokens``), one fresh prompt of ``N`` random ids is prefilled in
steps of at most ``--chunk`` tokens (0: one step; each later chunk attends to the earlier
chunks' KV, as chunked prefill runs it), by each path in turn, the order rotating every round:

- ``modules``: ``RLSERVE_CPU_STACK_PREFILL=0`` (gather + repeat_kv + SDPA per sequence, the
  linears on the team one module at a time);
- ``per-query``: ``RLSERVE_CPU_PREFILL_TILES=0`` (every query token through the paged decode
  kernel over its own context; steps over ``llama_cpu.STACK_PREFILL_MAX_CTX`` keys run the
  modules);
- ``tiles``: the default (causal query tiles, ``csrc/paged_prefill.c``);
- ``rows-1024`` (not run unless named): ``per-query`` with ``cpu_gemm.MAX_ROWS`` 1,024, the code
  before session 19 (steps of more rows: the modules with MKL linears on one thread).

Steps over ``cpu_gemm.MAX_ROWS`` rows run the modules on every path. One JSON line per ``N``:
medians of wall and process CPU ms (team workers included) per prefill, and per path the last
row's logits against ``modules``: max |diff| and whether the argmax agrees.

The model: ``--model`` (default rlserve's cached SmolLM2-135M-Instruct), float32. Run it under
``chrt -f 10`` (root) to emulate an idle machine on a shared one, as BENCHMARKS.md's CPU rows do.

``--layer``: instead, one layer's attention alone (SmolLM2-135M's 9 query / 3 KV heads of 64, blocks of
16, random q / K / V): CPU ms per call on the calling thread (team of 1) of the query tiles, the
per-query decode kernel (up to 1,024 tokens) and ``torch_paged_attention`` (gather + SDPA), medians.

Usage:
    python benchmarks/cpu_prefill_ab.py --tokens 128 512 2048 --rounds 5
    python benchmarks/cpu_prefill_ab.py --layer --tokens 128 512 2048 --rounds 7
    python benchmarks/cpu_prefill_ab.py --tokens 2048 --chunk 1024 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PATHS = {"modules": {"RLSERVE_CPU_STACK_PREFILL": "0", "RLSERVE_CPU_PREFILL_TILES": "1"},
         "per-query": {"RLSERVE_CPU_STACK_PREFILL": "1", "RLSERVE_CPU_PREFILL_TILES": "0"},
         "tiles": {"RLSERVE_CPU_STACK_PREFILL": "1", "RLSERVE_CPU_PREFILL_TILES": "1"},
         "rows-1024": {"RLSERVE_CPU_STACK_PREFILL": "1", "RLSERVE_CPU_PREFILL_TILES": "0"}}
ROWS_1024 = 1024  # "rows-1024": per-query with cpu_gemm.MAX_ROWS as before session 19 (main 0b11125)
BLOCK = 16


def _worker(model: str | None, max_len: int):
    from rlserve.config import EngineConfig
    from rlserve.download import ensure_default_model
    from rlserve.engine.worker.worker import Worker

    blocks = max_len // BLOCK + 8
    cfg = EngineConfig(model=model or str(ensure_default_model(progress=False)), dtype="float32", device="cpu",
                       max_model_len=max_len, num_kv_blocks=blocks, block_size=BLOCK)
    w = Worker(cfg)
    w.init_kv_cache(blocks)
    return w


def _steps(n: int, chunk: int, seed: int):
    """The StepInputs of one ``n``-token prompt in chunks of ``chunk`` (0: one step)."""
    from rlserve.engine.worker.model_runner import StepInput

    rng = random.Random(seed)
    ids = [rng.randrange(1000, 40000) for _ in range(n)]
    table = list(range(-(-n // BLOCK)))
    out, start = [], 0
    while start < n:
        end = n if chunk <= 0 else min(n, start + chunk)
        out.append(StepInput(ids[start:end], list(range(start, end)), [end - start], [end], [table],
                             [end - start - 1], True))
        start = end
    return out


def _use(name: str, max_rows: int) -> None:
    from rlserve.layers import cpu_gemm

    os.environ.update(PATHS[name])
    cpu_gemm.MAX_ROWS = ROWS_1024 if name == "rows-1024" else max_rows


def _prefill(w, steps) -> torch.Tensor:
    for s in steps:
        logits = w.execute(s)
    return logits


def bench_layer(tokens: list[int], rounds: int) -> None:
    """One JSON line per length: one layer's prefill attention by kernel (module docstring)."""
    from rlserve.batch_invariant.per_query import per_query_tables
    from rlserve.layers import cpu_gemm
    from rlserve.layers.attention import torch_paged_attention
    from tests.attention_cases import make_paged_case

    torch.set_num_threads(1)
    cpu_gemm.start(1)
    H, Hkv, D = 9, 3, 64
    for n in tokens:
        q, kc, vc, meta = make_paged_case([n], [n], H, Hkv, D, BLOCK, torch.float32)
        bt, sl = per_query_tables(meta)
        out = torch.empty_like(q)
        fns = {"tiles": lambda: cpu_gemm.paged_decode_call(q, kc, vc, bt, sl, out, H, Hkv, D, 0.125, prefill=True),
               "per-query": lambda: cpu_gemm.paged_decode_call(q, kc, vc, bt, sl, out, H, Hkv, D, 0.125),
               "gather+sdpa": lambda: torch_paged_attention(q, kc, vc, meta, 0.125)}
        if n > 1024:
            fns.pop("per-query")
        res = {k: [] for k in fns}
        for f in fns.values():
            f()
        for _ in range(rounds):
            for k, f in fns.items():
                c0 = time.thread_time()
                f()
                res[k].append(1e3 * (time.thread_time() - c0))
        print(json.dumps({"layer_tokens": n, **{f"{k}_cpu_median_ms": round(statistics.median(v), 2)
                                                for k, v in res.items()}, "load": round(os.getloadavg()[0], 2)}),
              flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--chunk", type=int, default=0, help="tokens per prefill step at most (0: the whole prompt)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--paths", nargs="+", default=["modules", "per-query", "tiles"], choices=list(PATHS))
    p.add_argument("--model", default=None)
    p.add_argument("--no-guard", action="store_true",
                   help="cpu_gemm.MIN_CORES = 0: no contention guard (a lost step would send the next path's "
                        "steps inline: this measures the kernels, not the guard)")
    p.add_argument("--layer", action="store_true", help="one layer's attention by kernel instead (docstring)")
    p.add_argument("--json", default=None, help="append the lines to this file too")
    a = p.parse_args(argv)
    if a.layer:
        bench_layer(a.tokens, a.rounds)
        return 0
    from rlserve.layers import cpu_gemm

    max_rows = cpu_gemm.MAX_ROWS
    if a.no_guard:
        cpu_gemm.MIN_CORES = 0
    w = _worker(a.model, max(a.tokens) + BLOCK)
    for n in a.tokens:
        steps = _steps(n, a.chunk, seed=n)
        ref, diffs = None, {}
        for name in ["modules"] + [x for x in a.paths if x != "modules"]:
            _use(name, max_rows)
            logits = _prefill(w, steps).clone()
            ref = logits if ref is None else ref
            diffs[name] = (float((logits - ref).abs().max()), bool(torch.equal(logits.argmax(-1), ref.argmax(-1))))
        res = {k: {"wall": [], "cpu": []} for k in a.paths}
        load0 = os.getloadavg()[0]
        for r in range(a.rounds):
            order = a.paths[r % len(a.paths):] + a.paths[:r % len(a.paths)]
            for name in order:
                _use(name, max_rows)
                c0, w0 = time.process_time(), time.perf_counter()
                _prefill(w, steps)
                res[name]["wall"].append(1e3 * (time.perf_counter() - w0))
                res[name]["cpu"].append(1e3 * (time.process_time() - c0))
        line = {"tokens": n, "chunk": a.chunk, "rounds": a.rounds, "guard": not a.no_guard, "max_rows": max_rows,
                **{name: {"wall_median_ms": round(statistics.median(v["wall"]), 1),
                          "cpu_median_ms": round(statistics.median(v["cpu"]), 1),
                          "wall_ms": [round(x, 1) for x in v["wall"]],
                          "logits_max_abs_diff_vs_modules": diffs[name][0], "argmax_equal": diffs[name][1]}
                   for name, v in res.items()},
                "load_before_after": [round(load0, 2), round(os.getloadavg()[0], 2)]}
        print(json.dumps(line), flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(line) + "\n")
    _use("tiles", max_rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
