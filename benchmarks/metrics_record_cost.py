"""CPU cost of recording one finished request in the metrics (``ServerMetrics.record_request``: the
rlserve_ and vllm: counters and histograms), in memory (``--api-server-count 1``) against multiprocess
mode (N > 1: every value in an mmap file, rlserve/server/metrics_mp.py). Each mode runs in a fresh
process (the mode is process-wide); process CPU time (``time.process_time``), not wall time.

    python benchmarks/metrics_record_cost.py [--calls 20000] [--turns 3] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = """
import sys, time
from rlserve.server.metrics import ServerMetrics
mode, calls = sys.argv[1], int(sys.argv[2])
m = ServerMetrics("m", 4096, multiprocess_dir=sys.argv[3] if mode == "multiprocess" else None)
args = ("completions", ["length"], 40, 100, 1.2, 0.05)
kw = dict(decode_s=1.1, sample_tokens=[100], n=1, max_tokens=100, timing=(0.0, 0.01, 0.05, 1.2))
for _ in range(1000):  # warm: label children made
    m.record_request(*args, **kw)
t = time.process_time()
for _ in range(calls):
    m.record_request(*args, **kw)
print((time.process_time() - t) / calls * 1e6)
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    runs = []
    for turn in range(a.turns):
        for mode in ("memory", "multiprocess"):  # alternate A/B
            with tempfile.TemporaryDirectory() as d:
                out = subprocess.run([sys.executable, "-c", CHILD, mode, str(a.calls), d], capture_output=True,
                                     text=True, check=True).stdout
            runs.append({"turn": turn, "mode": mode, "us_per_request": round(float(out), 2)})
            print(runs[-1], flush=True)
    result = {"calls": a.calls, "load_average": os.getloadavg(), "runs": runs}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
