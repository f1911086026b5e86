"""Kill matrix, timed: how long a server takes to notice a trainer SIGKILLed mid-sync (CPU, gloo).

The same cells as the correctness matrix (``tests/kill_matrix.py``: one in-process server per
receive path -- SDK packed / unpacked, in place / staged, TRL per tensor --, a real trainer
process killed at each phase of an update by ``tests/kill_trainer.py``, the verdict checked),
plus the seconds from the trainer's death (its last message, sent right before its SIGKILL) to
the failure the server recorded (``/weight_info`` ``last_update.time``).

Usage::

    python benchmarks/kill_matrix.py                               # liveness on, timeout_s 60
    python benchmarks/kill_matrix.py --no-liveness --timeout-s 20  # the baseline: timeout_s only
    python benchmarks/kill_matrix.py --config TRL                  # only the TRL rows

Prints one markdown table; ``--out`` also writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.kill_matrix import CONFIGS, cpu_server, expected, model_meta, run_config  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout-s", type=float, default=60.0, help="init_info.timeout_s (and the server's)")
    ap.add_argument("--no-liveness", action="store_true", help='"trainer_liveness": false (the baseline)')
    ap.add_argument("--config", action="append", help="only the paths whose name contains this (repeatable)")
    ap.add_argument("--phases", nargs="+", help="only these phases (default: every phase of each path)")
    ap.add_argument("--bucket-bytes", type=int, default=64 << 10, help="packed_buffer_size_bytes (64 KiB)")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    path = make_tiny_model("llama", tempfile.mkdtemp(prefix="kill-matrix-"), vocab_size=384)
    meta = model_meta(path)
    server = functools.partial(cpu_server, liveness=not args.no_liveness)
    rows = []
    for cfg in CONFIGS:
        if args.config and not any(c in cfg.name for c in args.config):
            continue
        phases = [p for p in cfg.phases() if not args.phases or p in args.phases]
        timings: dict = {}
        verdicts = run_config(path, meta, cfg, args.timeout_s, phases=phases, bucket_bytes=args.bucket_bytes,
                              server=server, timings=timings)
        for p in phases:
            rows.append({"path": cfg.name, "phase": p, "verdict": verdicts[p], "kill_to_failure_s": timings.get(p),
                         "as_expected": verdicts[p] in expected(cfg, p)})
    print(f"\ngloo, CPU, timeout_s={args.timeout_s:.0f}, trainer_liveness={not args.no_liveness}, buckets "
          f"{args.bucket_bytes} B, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    print("| path | phase | verdict | kill -> failure (s) |")
    print("|---|---|---|---|")
    for r in rows:
        secs = "-" if r["kill_to_failure_s"] is None else f"{r['kill_to_failure_s']:.2f}"
        print(f"| {r['path']} | {r['phase']} | {r['verdict']}{'' if r['as_expected'] else ' (UNEXPECTED)'} | "
              f"{secs} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0 if all(r["as_expected"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
