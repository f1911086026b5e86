"""Where the CPU team's extra CPU goes in a decode step: the real SmolLM2-135M's batch-B decode step
(``Worker.execute``, contexts 128-512, as ``cpu_decode_step.py``) inline on the engine thread and on
the team at several worker spin budgets (``RLSERVE_CPU_TEAM_SPIN_US``: ``rlserve_team_start``
resets it in place), alternating arm by arm every step (the order reversed every other step),
in one process, the contention guard held off (``cpu_gemm.MIN_CORES = 0``: the arms decide).

Per arm, medians per step: wall ms, process CPU ms (``time.process_time``: the worker included),
the worker's CPU ms, and the team counters (:func:`rlserve.layers.cpu_gemm.sync_stats`): jobs,
the caller's end-of-job wait ms, the worker's spin ms, its futex sleeps. Checks that every arm's
logits are bit-equal to the first arm's (the team splits whole output columns / sequences).

``--guarded SPIN``: instead, one spin budget for the whole process with the contention guard on
(as an engine runs): ms per step (wall, CPU), guarded / lost / inline steps; run processes alternating.
``--spin-not-busy``: with ``--guarded``, the guard does not count the workers' spin as busy CPU
(``cpu_gemm.SPIN_IS_BUSY = False``).

Usage (SCHED_FIFO keeps the other helpers' load off the two threads):
    chrt -f 10 python benchmarks/cpu_team_spin.py --arms inline,200,30,0 --steps 12 --batch 16
    for s in 200 30 200 30; do python benchmarks/cpu_team_spin.py --guarded $s --steps 60; done
    for f in "" --spin-not-busy "" --spin-not-busy; do python benchmarks/cpu_team_spin.py --guarded 200 $f; done
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", default="inline,200,0", help="comma list: 'inline' or a worker spin in microseconds")
    p.add_argument("--steps", type=int, default=12, help="steps per arm")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--guarded", type=int, default=None, metavar="SPIN_US",
                   help="one spin budget, the contention guard on, --steps steps in a row")
    p.add_argument("--spin-not-busy", action="store_true",
                   help="with --guarded: the guard does not count the workers' spin as busy (cpu_gemm.SPIN_IS_BUSY)")
    args = p.parse_args(argv)
    import torch
    from cpu_decode_step import _decode_step, _worker

    from rlserve.layers import cpu_gemm

    arms = args.arms.split(",")
    w = _worker(1)
    lib = cpu_gemm._lib()
    team = w.runner.cpu_team or cpu_gemm.current()
    if team.size < 2 or lib is None:
        raise SystemExit("no CPU team here (one usable CPU, or no C compiler)")
    if args.guarded is not None:
        return _guarded(w, team, lib, args)
    cpu_gemm.MIN_CORES = 0.0

    def arm(a: str) -> None:
        team.skip_active = a == "inline"
        if a != "inline":
            lib.rlserve_team_start(team.size - 1, int(a))

    step = _decode_step(args.batch)
    ref, equal = None, {}
    for a in arms:
        arm(a)
        out = w.execute(step).clone()
        ref = out if ref is None else ref
        equal[a] = torch.equal(ref, out)
    for _ in range(3):
        w.execute(step)
    keys = ("wall_ms", "cpu_ms", "worker_cpu_ms", "jobs", "wait_ms", "spin_ms", "sleeps")
    res = {a: {k: [] for k in keys} for a in arms}
    load0 = os.getloadavg()[0]
    for i in range(args.steps):
        for a in arms if i % 2 == 0 else arms[::-1]:
            arm(a)
            s0, k0 = cpu_gemm.sync_stats(), lib.rlserve_team_worker_cpu_ns()
            c0, w0 = time.process_time(), time.perf_counter()
            w.execute(step)
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            s1, r = cpu_gemm.sync_stats(), res[a]
            for k, v in zip(keys, (1e3 * wall, 1e3 * cpu, 1e-6 * (lib.rlserve_team_worker_cpu_ns() - k0),
                                   s1["jobs"] - s0["jobs"], 1e-6 * (s1["wait_ns"] - s0["wait_ns"]),
                                   1e-6 * (s1["spin_ns"] - s0["spin_ns"]), s1["sleeps"] - s0["sleeps"])):
                r[k].append(v)
    arm(arms[-1])
    print(json.dumps({"batch": args.batch, "steps_each": args.steps, "team": team.size, "bit_equal": equal,
                      **{a: {k: round(statistics.median(v), 2) for k, v in r.items()} for a, r in res.items()},
                      "load_before_after": [round(load0, 2), round(os.getloadavg()[0], 2)]}), flush=True)
    return 0


def _guarded(w, team, lib, args) -> int:
    """``--guarded``: the whole process at one spin budget, the guard deciding per step."""
    from cpu_decode_step import _decode_step

    from rlserve.layers import cpu_gemm

    lib.rlserve_team_start(team.size - 1, args.guarded)
    cpu_gemm.SPIN_IS_BUSY = not args.spin_not_busy
    step = _decode_step(args.batch)
    for _ in range(3):
        w.execute(step)
    g0, s0, load0 = dict(cpu_gemm.guard_stats(team)), cpu_gemm.sync_stats(), os.getloadavg()[0]
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(args.steps):
        w.execute(step)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    g1, s1 = cpu_gemm.guard_stats(team), cpu_gemm.sync_stats()
    print(json.dumps({"spin_us": args.guarded, "spin_is_busy": cpu_gemm.SPIN_IS_BUSY, "batch": args.batch,
                      "steps": args.steps,
                      "wall_ms_per_step": round(1e3 * wall / args.steps, 2), "cpu_ms_per_step": round(1e3 * cpu / args.steps, 2),
                      "guarded_steps": g1["steps"] - g0["steps"], "lost": g1["lost"] - g0["lost"], "inline": g1["inline"] - g0["inline"],
                      "team_jobs_per_step": (s1["jobs"] - s0["jobs"]) / args.steps,
                      "spin_ms_per_step": round(1e-6 * (s1["spin_ns"] - s0["spin_ns"]) / args.steps, 2),
                      "wait_ms_per_step": round(1e-6 * (s1["wait_ns"] - s0["wait_ns"]) / args.steps, 2),
                      "load_before_after": [round(load0, 2), round(os.getloadavg()[0], 2)]}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
