"""Start-up and Ctrl-C stop time of ``rlserve serve`` on a tiny dummy model (issue 21.11).

For each checkout given (``--checkout DIR``, repeatable; default: this one), interleaved, ``--reps``
times: start ``python -m rlserve serve TINY --load-format dummy --device cpu --port 0`` and time
(a) process start -> the ready line, (b) the server's own "loading" log line -> "engine ready",
(c) SIGINT -> process exit. Prints the median of each per checkout.

    python benchmarks/startup_stop.py --reps 3 --checkout /path/to/baseline --checkout .
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.tiny_models import make_tiny_model  # noqa: E402

_TS = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO \S+: (loading|engine ready)", re.M)


def one(checkout: str, model: str) -> dict:
    fd, log = tempfile.mkstemp(suffix=".log")
    os.close(fd)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.path.abspath(checkout))
    t0 = time.monotonic()
    with open(log, "w") as out:
        p = subprocess.Popen([sys.executable, "-m", "rlserve", "serve", model, "--port", "0", "--device", "cpu",
                              "--load-format", "dummy"], stdout=out, stderr=subprocess.STDOUT, env=env,
                             cwd=os.path.abspath(checkout))
        while True:
            text = open(log).read()
            if "rlserve: serving" in text:
                break
            if p.poll() is not None or time.monotonic() - t0 > 600:
                p.kill()
                raise RuntimeError(f"server did not start:\n{text[-3000:]}")
            time.sleep(0.02)
        ready = time.monotonic() - t0
        t1 = time.monotonic()
        p.send_signal(signal.SIGINT)
        p.wait(120)
        stop = time.monotonic() - t1
    stamps = {k: datetime.datetime.strptime(v, "%Y-%m-%d %H:%M:%S,%f") for v, k in _TS.findall(open(log).read())}
    os.remove(log)
    load = (stamps["engine ready"] - stamps["loading"]).total_seconds() if len(stamps) == 2 else float("nan")
    return {"ready_s": ready, "load_s": load, "stop_s": stop, "rc": p.returncode}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkout", action="append", default=None, help="repository root to run (repeatable)")
    ap.add_argument("--reps", type=int, default=3, help="runs per checkout (interleaved)")
    args = ap.parse_args()
    checkouts = args.checkout or ["."]
    model = make_tiny_model("llama", os.path.join(tempfile.gettempdir(), "rlserve-bench-tiny-llama"))
    res: dict[str, list] = {c: [] for c in checkouts}
    for _ in range(args.reps):
        for c in checkouts:
            r = one(c, model)
            res[c].append(r)
            print(f"{c}: ready {r['ready_s']:.1f}s (load {r['load_s']:.1f}s), stop {r['stop_s']:.1f}s, rc {r['rc']}",
                  flush=True)
    for c, rs in res.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("ready_s", "load_s", "stop_s")}
        print(f"median {c}: ready {med['ready_s']:.1f}s, loading->engine ready {med['load_s']:.1f}s, "
              f"Ctrl-C->exit {med['stop_s']:.1f}s ({len(rs)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
