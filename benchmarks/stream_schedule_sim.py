"""Closed-loop streaming workload through rlserve's real scheduler with a model of the GPU's step times
(issue 37, session 15): what each prefill budget does to the engine's inter-token gaps, TTFT and output
rate, before a device run measures it.

``vllm bench serve``'s workload: ``--concurrency`` clients, ``--num-prompts`` prompts of ``--prompt-len``
tokens, ``--output-len`` tokens each (ignore_eos); a client sends its next prompt ``--turnaround-ms``
after its previous request's last token. Every step goes through :class:`rlserve.engine.core.scheduler.
Scheduler` and :class:`rlserve.engine.core.block_manager.BlockManager` as in the engine; its duration
comes from the model below, and every running sequence gets its token at the step's end. The API
process is not modelled (its per-chunk delay adds to every gap here).

Step-time model (ms; defaults for the Qwen3-0.6B shape on one H100, bf16):

* decode step: ``--decode-fixed-ms`` + (KV bytes read) / ``--hbm-gbps``: KV bytes = the batch's
  context tokens x ``--kv-bytes-per-token`` (Qwen3-0.6B: 28 layers x 2 x 8 KV heads x 128 x 2 bytes =
  114,688). 1.4 ms + 3.0 TB/s put batch 64 at ~3.0 ms and batch 256 at ~7.7 ms, window 1's TPOT at
  concurrency 64 and 256 (3.03, 7.61 ms; BENCHMARKS.md H13);
* prefill step: ``--prefill-fixed-ms`` + tokens x ``--prefill-us-per-token``: 2.1 us a token is
  ~0.86 GFLOP a token (the 28 layers' linears) at ~410 TFLOP/s: an assumption, not a measurement
  (``benchmarks/step_trace.py`` measures it on the device).

    python benchmarks/stream_schedule_sim.py --budgets old default 4096 1024 --concurrency 256 64
    python benchmarks/stream_schedule_sim.py --budgets old default --concurrency 256 --num-prompts 256 \
        --random-lens 100 1024   # the offline workload, had its sequences streamed
    python benchmarks/stream_schedule_sim.py --budgets default --chunked off on --concurrency 64 \
        --num-prompts 256 --prompt-lens 205 3891 --output-len 128
        # s16_chunk.sh's long-prompt mix: a prompt longer than the budget runs whole, or in chunks

``--chunked on`` runs the scheduler with chunked prefill (``enable_chunked_prefill``): only the
sequences whose prompt ends in a step get a token from it (``ScheduledBatch.sampled``).

``--mixed on`` (session 17) runs it with mixed steps (``mixed_prefill_decode``): a prefill step while
sequences run also decodes each of them (one token each, counted in the step's budget). A mixed step
is an eager prefill step: ``--prefill-fixed-ms`` + (its prefill and decode tokens) x
``--prefill-us-per-token`` + its decode rows' KV bytes / ``--hbm-gbps`` (their attention reads the
same KV as a decode step does). ``--prefill-launch-ms`` (default 0: off) is the host's time to launch
an eager step, which the GPU's work overlaps: a prefill or mixed step then takes
``max(launch, the sum above)``. Session 16's window-1 step trace (2048-token steps p50 12.0 ms,
8192-token steps 16.4 ms) fits both ``--prefill-fixed-ms 10.7 --prefill-us-per-token 0.74`` (the launches
add to the work: a mixed step pays its decode rows' KV reads on top) and ``--prefill-launch-ms 11.5
--prefill-fixed-ms 0.5 --prefill-us-per-token 1.94`` (the work hides under the launches up to ~5,700
tokens): they differ on mixed steps, which the device run decides:

    python benchmarks/stream_schedule_sim.py --budgets default --chunked on --mixed off on \
        --concurrency 256 64 --prefill-fixed-ms 10.7 --prefill-us-per-token 0.74
    python benchmarks/stream_schedule_sim.py --budgets default --chunked on --mixed off on \
        --concurrency 256 64 --prefill-launch-ms 11.5 --prefill-fixed-ms 0.5 --prefill-us-per-token 1.94

``--graphs on`` (session 20) models piecewise prefill CUDA graphs (``RLSERVE_PREFILL_CUDA_GRAPHS``, off by
default): a prefill step of T tokens replays the smallest bucket of ``--graph-buckets`` >= T and takes
``--graph-step-ms`` at that bucket (session 19's H100 engine steps, ``benchmarks/results/s19_w1/prefill``: 16 /
512 / 2,048 / 8,192 tokens 2.79 / 2.94 / 8.51 / 26.37 ms; linear in tokens between); a mixed step takes
``max(--graph-mixed-host-ms, that + its decode rows' KV reads)`` (6.5 ms: the same run's 16 tokens + 64 decode
rows, host 6.06 ms; its attention runs eagerly between the pieces); a step above the largest bucket is eager.
``--fit s19`` sets the eager step to the same run's numbers (:data:`FITS`); s16 w1's server trace agrees at the
median (1,025-2,048-token prefill steps p50 12.0 ms, decode steps at c256 6.8 ms) but has a tail (prefill p90 17.1
ms). ``--prefill-extra-ms`` adds to every prefill / mixed step what a server's step may cost beyond the
microbenchmark (session 20's sensitivity run: 5.7 ms). The session-20 matrix (BENCHMARKS.md, "HTTP serving")::

    python benchmarks/stream_schedule_sim.py --fit s19 --budgets 512 1024 2048 --concurrency 256 64 \
        --graphs off on --mixed off on --chunked off on
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

from rlserve.engine.core.block_manager import BlockManager
from rlserve.engine.core.scheduler import Scheduler
from rlserve.engine.core.sequence import Sequence
from rlserve.engine.sampling_params import SamplingParams


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def graph_ms(args, tokens: int) -> float | None:
    """A piecewise-graph prefill step's time (ms) for ``tokens`` rows: the smallest bucket of
    ``--graph-buckets`` >= tokens, its time interpolated linearly in tokens between the measured points of
    ``--graph-step-ms`` (flat below the first); None above the largest bucket (the engine runs it eagerly)."""
    buckets = [b for b in args.graph_buckets if b >= tokens]
    if not buckets:
        return None
    tb = min(buckets)
    pts = sorted(args.graph_step_ms.items())
    if tb <= pts[0][0]:
        return pts[0][1]
    for (t0, m0), (t1, m1) in zip(pts, pts[1:]):
        if tb <= t1:
            return m0 + (m1 - m0) * (tb - t0) / (t1 - t0)
    (t0, m0), (t1, m1) = pts[-2], pts[-1]
    return m1 + (m1 - m0) * (tb - t1) / (t1 - t0)


def step_ms(args, batch, graphs: bool = False) -> float:
    """The model's time of one step (ms): a decode step, or a prefill step whose ``num_decodes`` decode
    rows (a mixed step) add their tokens and their KV reads (see the module docstring). ``graphs``:
    piecewise prefill graphs (``RLSERVE_PREFILL_CUDA_GRAPHS``): a prefill step of T tokens takes
    :func:`graph_ms`, a mixed one ``max(--graph-mixed-host-ms, graph_ms + its decode rows' KV reads)``;
    a step above the largest bucket is eager. Every prefill or mixed step adds ``--prefill-extra-ms``."""
    dec = batch.seqs[:batch.num_decodes] if batch.is_prefill else batch.seqs
    kv_ms = sum(len(s) for s in dec) * args.kv_bytes_per_token / (args.hbm_gbps * 1e6)
    if not batch.is_prefill:
        return args.decode_fixed_ms + kv_ms
    extra = getattr(args, "prefill_extra_ms", 0.0)
    g = graph_ms(args, batch.num_tokens) if graphs else None
    if g is not None:
        return extra + (max(args.graph_mixed_host_ms, g + kv_ms) if batch.num_decodes else g)
    work = args.prefill_fixed_ms + batch.num_tokens * args.prefill_us_per_token / 1e3 + kv_ms
    launch = getattr(args, "prefill_launch_ms", 0.0)
    if batch.num_decodes:
        launch += getattr(args, "mixed_launch_ms", 0.0)
    return extra + max(launch, work)


def simulate(args, budget: str, concurrency: int, chunked: bool = False, mixed: bool = False,
             graphs: bool = False) -> dict:
    """One closed-loop run; ``budget``: ``old`` (= max_num_batched_tokens), ``default`` (the scheduler's
    default) or a token count; ``chunked``: chunked prefill; ``mixed``: mixed steps; ``graphs``: piecewise
    prefill graphs (:func:`step_ms`). Returns output tok/s, wall s, inter-token gap p50/p99/max ms, TTFT mean/p99 ms, and the steps by kind."""
    fixed = None if budget == "default" else (args.max_num_batched_tokens if budget == "old" else int(budget))
    sch = Scheduler(BlockManager(args.num_kv_blocks, 16), args.max_num_seqs, args.max_num_batched_tokens,
                    getattr(args, "max_consecutive_prefill_steps", 1),
                    max_prefill_tokens_while_decoding=fixed, enable_chunked_prefill=chunked,
                    mixed_prefill_decode=mixed)
    kinds = {"decode": 0, "prefill": 0, "mixed": 0}
    now, sent, done = 0.0, 0, 0
    arrive: dict[str, float] = {}
    last: dict[str, float] = {}
    gaps: list[float] = []
    ttft: list[float] = []
    pre_ms: list[float] = []  # prefill and mixed steps' times
    pending: list[float] = [0.0] * concurrency  # times at which a client sends its next prompt
    rng = random.Random(0)
    total_out = 0

    def submit(at: float) -> None:
        nonlocal sent, total_out
        rid = f"r{sent}"
        plen, olen = ((rng.randint(*args.random_lens), rng.randint(*args.random_lens)) if args.random_lens
                      else (rng.randint(*args.prompt_lens) if getattr(args, "prompt_lens", None) else args.prompt_len,
                            args.output_len))
        total_out += olen
        ids = [(sent * 7919 + j) % 50000 + 1 for j in range(plen)]  # distinct: no prefix hits
        seq = Sequence(rid, 0, ids, SamplingParams(max_tokens=olen, ignore_eos=True), 16)
        seq.streamed = True  # vllm bench serve streams (EngineCore.add marks these)
        sch.add(seq)
        arrive[rid] = at
        sent += 1

    while done < args.num_prompts:
        for at in [t for t in pending if t <= now and sent < args.num_prompts]:
            pending.remove(at)
            submit(at)
        batch = sch.schedule()
        if batch is None:
            now = min(pending)
            continue
        dt = step_ms(args, batch, graphs)
        now += dt
        if batch.is_prefill:
            pre_ms.append(dt)
        kinds["mixed" if batch.num_decodes else "prefill" if batch.is_prefill else "decode"] += 1
        finished = []
        for s in batch.sampled:
            s.num_computed_tokens = len(s)
            s.output_token_ids.append(1)
            rid = s.request_id
            (gaps.append(now - last[rid]) if rid in last else ttft.append(now - arrive[rid]))
            last[rid] = now
            if s.num_output_tokens >= s.params.max_tokens:
                finished.append(s)
        for s in finished:
            sch.finish(s)
            done += 1
            pending.append(now + args.turnaround_ms)
    return {"budget": budget, "concurrency": concurrency, "chunked": chunked, "mixed": mixed, "graphs": graphs,
            "steps": kinds, "prefill_step_p50_ms": round(_pct(pre_ms, 0.5), 1) if pre_ms else None,
            "output_tok_s": round(total_out / now * 1e3), "wall_s": round(now / 1e3, 3),
            "gap_p50_ms": round(_pct(gaps, 0.5), 1), "gap_p99_ms": round(_pct(gaps, 0.99), 1),
            "gap_max_ms": round(max(gaps), 1), "ttft_mean_ms": round(statistics.mean(ttft)),
            "ttft_p99_ms": round(_pct(ttft, 0.99))}


#: ``--fit s19``: the eager step fitted to session 19's H100 engine steps (``benchmarks/results/s19_w1/prefill``,
#: Qwen3-0.6B shape, bf16): 16 / 512 / 2,048 / 8,192 tokens 12.07 / 12.18 / 12.68 / 26.13 ms, i.e. 12.1 ms of
#: launches hiding 2.3 ms + 2.9 us a token of GPU work; 64 decode rows (context 1,024) add ~5.3 ms of host
#: work to an eager step (wall 10.30 -> 15.65, 11.62 -> 16.94 ms)
FITS = {"s19": {"prefill_launch_ms": 12.1, "prefill_fixed_ms": 2.3, "prefill_us_per_token": 2.9,
                "mixed_launch_ms": 5.3}}


def _ms_table(text: str) -> dict[int, float]:
    return {int(k): float(v) for k, v in (kv.split(":") for kv in text.split(","))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", nargs="+", default=["old", "default", "4096", "1024"])
    p.add_argument("--concurrency", nargs="+", type=int, default=[256, 64])
    # the workload, the engine's limits (--num-kv-blocks: window 1's H100 cache) and the step-time model
    for flag, default in (("num-prompts", 768), ("prompt-len", 512), ("output-len", 256), ("max-num-seqs", 256),
                          ("max-num-batched-tokens", 8192), ("num-kv-blocks", 41190), ("turnaround-ms", 1.0),
                          ("decode-fixed-ms", 1.4), ("hbm-gbps", 3000.0), ("kv-bytes-per-token", 114688),
                          ("prefill-fixed-ms", 0.5), ("prefill-us-per-token", 2.1), ("prefill-launch-ms", 0.0),
                          ("mixed-launch-ms", 0.0), ("prefill-extra-ms", 0.0), ("graph-mixed-host-ms", 6.5),
                          ("max-consecutive-prefill-steps", 1)):
        p.add_argument(f"--{flag}", type=type(default), default=default)
    p.add_argument("--fit", choices=sorted(FITS), default=None,
                   help="set the eager prefill step's flags to a named fit (FITS: s19 = session 19's H100 steps)")
    p.add_argument("--graph-buckets", type=lambda t: [int(x) for x in t.split(",")],
                   default=[256, 512, 1024, 2048, 4096, 8192], help="piecewise graphs' token buckets")
    p.add_argument("--graph-step-ms", type=_ms_table, default=_ms_table("256:2.79,512:2.94,2048:8.51,8192:26.37"),
                   help="BUCKET:MS,...: a graph prefill step's time by bucket (s19 w1's engine steps of 16, 512, "
                        "2,048 and 8,192 tokens), interpolated between")
    p.add_argument("--random-lens", nargs=2, type=int, default=None, metavar=("LO", "HI"),
                   help="prompt and output lengths uniform in [LO, HI] (seeded) instead of --prompt-len / "
                        "--output-len; the offline nano-vllm workload: --concurrency 256 --num-prompts 256 "
                        "--random-lens 100 1024")
    p.add_argument("--prompt-lens", nargs=2, type=int, default=None, metavar=("LO", "HI"),
                   help="prompt lengths uniform in [LO, HI] (seeded), --output-len tokens out")
    for flag, what in (("chunked", "chunked prefill"), ("mixed", "mixed steps (decodes in every prefill step)"),
                       ("graphs", "piecewise prefill graphs")):
        p.add_argument(f"--{flag}", nargs="+", choices=["off", "on"], default=["off"],
                       help=f"{what} off (the default here) and/or on: one run each")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args()
    for k, v in FITS.get(args.fit, {}).items():
        setattr(args, k, v)
    rows = [simulate(args, b, c, ch == "on", m == "on", g == "on") for c in args.concurrency for b in args.budgets
            for ch in args.chunked for m in args.mixed for g in args.graphs]
    for r in rows:
        print(f"c{r['concurrency']} budget {r['budget']:>5}{' chunked' if r['chunked'] else ''}"
              f"{' mixed' if r['mixed'] else ''}{' graphs' if r['graphs'] else ''}: "
              f"{r['output_tok_s']:,} tok/s, gap p50/p99/max "
              f"{r['gap_p50_ms']}/{r['gap_p99_ms']}/{r['gap_max_ms']} ms, TTFT mean/p99 {r['ttft_mean_ms']}/"
              f"{r['ttft_p99_ms']} ms; prefill step p50 {r['prefill_step_p50_ms']} ms; steps {r['steps']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)

if __name__ == "__main__":
    main()
