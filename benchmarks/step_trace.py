"""Engine step trace for streaming runs (issue 37): which steps stall the decoding streams.

Installed at interpreter start in the engine-core process (``sitecustomize`` in a directory put first
on the server's ``PYTHONPATH``, see :func:`site_dir`; ``STEP_TRACE_DIR`` names the output directory),
it wraps :meth:`rlserve.engine.core.scheduler.Scheduler.schedule` and writes one line per scheduled
step to ``<dir>/<pid>.steps``: ``<unix time s> <P|D> <tokens> <sequences> <running>`` (``P``: a
prefill step and its prompt tokens to compute; ``D``: a decode step, one token per sequence;
``running``: sequences running after the step was scheduled; ``M``: a mixed step,
``--mixed-prefill-decode``: its prefill tokens and its decode rows). Cost: one line write per step (~2 us;
a batch-256 decode step takes ~7 ms on an H100), nothing in the API process.

:func:`summarize` reads the lines back: a step's time is the interval to the next schedule call (with
overlapped decode the next step is scheduled while this one runs, so the interval is the step's
share of the pipeline, not its kernel time); an interval after which the engine had emptied (the next step
holds only new sequences) is idle time, not a step.
What a decoding stream sees is the interval from one decode step to the next: :func:`summarize`
groups those gaps by the prefill tokens scheduled between the two decode steps.
"""

from __future__ import annotations

import os
import sys
import time

ENV_DIR = "STEP_TRACE_DIR"
#: an interval this long between two schedule calls cuts the trace into benchmark runs (``vllm bench serve``
#: pauses 2.5-3 s between its runs; session 21's window 1 had an 891 ms eager prefill step inside a run, which
#: the old 0.5 s cut made a run boundary, dropping that run's first 41 steps and the stall from the summary)
RUN_GAP_S = 1.5
#: step intervals at least this long are listed one by one (:func:`summarize`'s ``stalls``)
STALL_S = 0.1
#: prefill-token buckets of :func:`summarize` (upper bounds; the last is open)
BUCKETS = (0, 1024, 2048, 4096, 8192)


def install() -> None:
    """Start tracing into ``$STEP_TRACE_DIR`` (no-op when unset or outside an engine-core process)."""
    out_dir = os.environ.get(ENV_DIR)
    # at interpreter start an engine core's sys.argv is ['-m', '--input', ...] or, prestarted by the
    # API process (core_client), ['-m', '--prestarted']
    if not out_dir or not ("core_proc" in " ".join(sys.argv) or {"--input", "--prestarted"} & set(sys.argv)):
        return
    from rlserve.engine.core.scheduler import Scheduler

    f = open(os.path.join(out_dir, f"{os.getpid()}.steps"), "a", buffering=1)  # noqa: SIM115 - lives with the process
    schedule = Scheduler.schedule

    def traced(self):
        batch = schedule(self)
        if batch is not None:
            n, d = batch.num_tokens, getattr(batch, "num_decodes", 0)
            kind, n, seqs = ("M", n - d, d) if d else ("P" if batch.is_prefill else "D", n, len(batch.seqs))
            f.write(f"{time.time():.6f} {kind} {n} {seqs} {len(self.running)}\n")
        return batch

    Scheduler.schedule = traced


def site_dir(root: str) -> str:
    """A directory holding a ``sitecustomize.py`` that calls :func:`install`; put it first on the
    server's ``PYTHONPATH`` (the repository after it) and set ``STEP_TRACE_DIR``."""
    from benchmarks.api_stream_probe import site_dir as probe_site_dir

    return probe_site_dir(root, "benchmarks.step_trace")


def read_steps(out_dir: str) -> list[tuple[float, str, int, int, int]]:
    """Every ``.steps`` line of ``out_dir``, by time: ``(unix s, kind, tokens, seqs, running)``."""
    rows = []
    for fn in sorted(os.listdir(out_dir)):
        if fn.endswith(".steps"):
            with open(os.path.join(out_dir, fn)) as f:
                for line in f:
                    p = line.split()
                    if len(p) == 5:
                        rows.append((float(p[0]), p[1], int(p[2]), int(p[3]), int(p[4])))
    rows.sort()
    return rows


def _bucket(tokens: int) -> str:
    lo = 0
    for hi in BUCKETS:
        if tokens <= hi:
            return "0" if hi == 0 else f"{lo + 1}-{hi}"
        lo = hi
    return f">{BUCKETS[-1]}"


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def _fresh(row) -> bool:
    """Whether a step scheduled nothing that ran before it: a prefill (or mixed) step whose running count is
    its own sequences (the engine had emptied: every earlier sequence finished, so it waited for requests)."""
    return row[1] in "PM" and row[4] == row[3]


def summarize(rows: list[tuple[float, str, int, int, int]]) -> dict:
    """Step-time histograms of one run (times in ms).

    Returns ``{"steps": {kind bucket: {n, p50, p90, max, tokens}}, "decode_gaps": {bucket: {n, p50,
    p90, p99, max, streams}}, "idle": {n, p50, max, ms}, "stalls": [[t s, kind, tokens, seqs, ms], ...]}``:
    ``steps`` by kind and the step's tokens (the interval to the next step); ``decode_gaps``: intervals
    between consecutive decode steps (a mixed step ``M`` is one), by the prefill tokens scheduled from the
    earlier one (a mixed step's own included: the interval holds it) to the later (``streams``: the earlier
    decode step's sequences, summed: each is one inter-token gap of a stream, before the API process adds its
    own delay). ``idle``: intervals after which the engine had emptied (:func:`_fresh`: the step's sequences
    all finished and it waited for the next requests: not a step, and no stream waited it out; session 21's
    "decode steps" of 235-436 ms at each wave's end were these); ``stalls``: every other interval of at least
    :data:`STALL_S` (``t``: seconds from the run's first step), sequences running through it.
    """
    steps: dict = {}
    gaps: dict = {}
    idle: list = []
    stalls: list = []
    for (t, kind, tokens, seqs, _run), nxt in zip(rows, rows[1:]):
        dt = nxt[0] - t
        if _fresh(nxt):
            idle.append(1e3 * dt)
            continue
        steps.setdefault(f"{kind} {_bucket(tokens)}", []).append((1e3 * dt, tokens))
        if dt >= STALL_S:
            stalls.append([round(t - rows[0][0], 3), kind, tokens, seqs, round(1e3 * dt, 1)])
    last_decode, between = None, 0
    for row in rows:
        t, kind, tokens, seqs, _run = row
        if _fresh(row):
            last_decode = None  # no stream spans an emptied engine
        if kind == "P":
            between += tokens
            continue
        if last_decode is not None:
            gaps.setdefault(_bucket(between), []).append((1e3 * (t - last_decode[0]), last_decode[1]))
        last_decode, between = (t, seqs), (tokens if kind == "M" else 0)
    out_steps = {k: {"n": len(v), "p50": round(_pct([x for x, _ in v], 0.5), 2),
                     "p90": round(_pct([x for x, _ in v], 0.9), 2), "max": round(max(x for x, _ in v), 2),
                     "tokens": sum(n for _, n in v)} for k, v in sorted(steps.items())}
    out_gaps = {k: {"n": len(v), "p50": round(_pct([x for x, _ in v], 0.5), 2),
                    "p90": round(_pct([x for x, _ in v], 0.9), 2), "p99": round(_pct([x for x, _ in v], 0.99), 2),
                    "max": round(max(x for x, _ in v), 2), "streams": sum(n for _, n in v)}
                for k, v in sorted(gaps.items())}
    out_idle = {"n": len(idle), "p50": round(_pct(idle, 0.5), 2), "max": round(max(idle, default=0.0), 2),
                "ms": round(sum(idle), 1)}
    return {"steps": out_steps, "decode_gaps": out_gaps, "idle": out_idle, "stalls": stalls}


def segments(rows: list, min_steps: int = 50) -> list[list]:
    """``rows`` cut at idle intervals (over :data:`RUN_GAP_S`): one segment per benchmark run of a server
    (``vllm bench serve`` pauses between its runs); segments under ``min_steps`` steps (its warm-up
    request) are left out."""
    out, cur = [], []
    for r in rows:
        if cur and r[0] - cur[-1][0] > RUN_GAP_S:
            out.append(cur)
            cur = []
        cur.append(r)
    out.append(cur)
    return [seg for seg in out if len(seg) >= min_steps]


def summary_lines(out_dir: str, label: str = "", min_steps: int = 50) -> list[str]:
    """Readable lines of :func:`summarize`, one block per run (:func:`segments`) of ``out_dir``, each
    labelled with its length, steps and most sequences running at once (which run it was)."""
    lines = []
    for i, seg in enumerate(segments(read_steps(out_dir), min_steps)):
        head = f"{label}run {i} ({seg[-1][0] - seg[0][0]:.1f} s, {len(seg)} steps, max running {max(r[4] for r in seg)}) "
        lines += _lines(summarize(seg), head)
    return lines


def _lines(s: dict, label: str) -> list[str]:
    lines = [f"{label}step {k}: n {v['n']}, ms p50 {v['p50']} p90 {v['p90']} max {v['max']}, tokens {v['tokens']}"
             for k, v in s["steps"].items()]
    lines += [f"{label}decode gap, prefill tokens between {k}: n {v['n']}, ms p50 {v['p50']} p90 {v['p90']} "
              f"p99 {v['p99']} max {v['max']}, stream gaps {v['streams']}" for k, v in s["decode_gaps"].items()]
    if s["idle"]["n"]:
        lines.append(f"{label}idle (every sequence finished, waiting for requests): n {s['idle']['n']}, ms p50 "
                     f"{s['idle']['p50']} max {s['idle']['max']}, {s['idle']['ms']} ms in all")
    if s["stalls"]:
        lines.append(f"{label}steps of {1e3 * STALL_S:g} ms or more with sequences running (s into the run, kind, "
                     f"tokens, seqs, ms): " + "; ".join(" ".join(str(x) for x in st) for st in s["stalls"][:12]))
    return lines


if __name__ == "__main__":
    import json

    if len(sys.argv) < 2:
        sys.exit("usage: python -m benchmarks.step_trace DIR [--json]")
    if "--json" in sys.argv:
        print(json.dumps([summarize(seg) for seg in segments(read_steps(sys.argv[1]))]))
    else:
        print("\n".join(summary_lines(sys.argv[1])))
