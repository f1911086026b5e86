"""What the steps right after prefill steps cost, from step traces (``benchmarks/throughput.py --floor
--step-trace``: one JSON line per launched step, ``t`` its launch in seconds from the first, ``kind``
"P" / "D"; ``benchmarks/workload_floor.py``). Issue 37, session 18: the decode step after a prefill step
used to be launched only after the prefill's tokens were read (``RLSERVE_OVERLAP_AFTER_PREFILL=0``), so the
GPU idled between the two; now it is launched first (``rlserve/engine/core/overlap.py``).

For every prefill step ``i`` followed by a decode step: ``p_to_d`` = launch of ``i + 1`` minus launch of
``i`` (the old rule: the prefill's GPU time plus the host's read, schedule and build; the new: host work
only) and ``window`` = launch of ``i + 2`` minus launch of ``i`` (prefill + decode + whatever gap lies
between them, under either rule). The same workload schedules the same batches under both rules, so the
difference of the ``window`` sums is the time the new rule saved around prefill steps; ``dd`` is the
median launch-to-launch interval of decode steps between decode steps (steady decode), for scale.

    python3 benchmarks/device/prefill_gaps.py LABEL=TRACE.jsonl [LABEL=TRACE.jsonl ...]

prints one line per trace (milliseconds) and, with two or more, each one's window sum minus the first's.
"""

from __future__ import annotations

import json
import statistics
import sys


def summarize(path: str) -> dict:
    """The numbers above for one trace file (times in ms, ``run_s`` the last entry's time in s)."""
    with open(path) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    t, k = [s["t"] for s in steps], [s["kind"] for s in steps]
    pd = [i for i in range(len(steps) - 2) if k[i] == "P" and k[i + 1] == "D"]
    p_to_d = [(t[i + 1] - t[i]) * 1e3 for i in pd]
    window = [(t[i + 2] - t[i]) * 1e3 for i in pd]
    dd = [(t[i + 1] - t[i]) * 1e3 for i in range(1, len(steps) - 1) if k[i - 1] == k[i] == k[i + 1] == "D"]
    med = lambda xs: statistics.median(xs) if xs else 0.0  # noqa: E731
    return {"steps": sum(x in ("P", "D") for x in k), "prefill_steps": k.count("P"), "p_then_d": len(pd),
            "p_to_d_median_ms": med(p_to_d), "p_to_d_sum_ms": sum(p_to_d), "window_median_ms": med(window),
            "window_sum_ms": sum(window), "dd_median_ms": med(dd), "run_s": t[-1] if t else 0.0}


def main(argv: list[str]) -> int:
    rows = []
    for spec in argv:
        label, _, path = spec.partition("=")
        try:
            rows.append((label, summarize(path)))
        except (OSError, ValueError, KeyError) as e:
            print(f"{label}: no trace ({type(e).__name__}: {e})")
    for label, r in rows:
        print(f"{label}: {r['steps']} steps ({r['prefill_steps']} prefill, {r['p_then_d']} followed by a decode step), "
              f"run {r['run_s']:.3f} s; prefill->decode launch median {r['p_to_d_median_ms']:.2f} ms "
              f"(sum {r['p_to_d_sum_ms']:.1f}); prefill+decode window median {r['window_median_ms']:.2f} ms "
              f"(sum {r['window_sum_ms']:.1f}); steady decode step {r['dd_median_ms']:.2f} ms")
    for label, r in rows[1:]:
        print(f"{label} - {rows[0][0]}: window sum {r['window_sum_ms'] - rows[0][1]['window_sum_ms']:+.1f} ms, "
              f"run {r['run_s'] - rows[0][1]['run_s']:+.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
