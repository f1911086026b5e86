"""Start-up of ``rlserve serve --api-server-count N`` (issue 37's noticed list, session 25): for each
checkout (``--checkout DIR``, repeatable; interleaved A, B, A, B, ...), ``--reps`` times, start
``python -m rlserve serve MODEL --device cpu --port P --api-server-count N`` (its own session, output to
a file) and record, in seconds from the spawn:

* ``health``: the first ``GET /health`` that answers 200 (polled every 50 ms on the fixed port ``P``:
  whichever API process accepted the connection);
* ``ready``: the ``rlserve: serving ...`` line (every API process serves);
* ``cpu``: user + system CPU seconds of the server's process tree when the ready line came (live
  processes, their reaped children included: :func:`rlserve.server.launch.tree_cpu_seconds`);
* ``load``: the 1-minute load average just before the spawn;
* ``after_engine``: from API process 0's "engine replica 0 ready" log line to its "ready:" line (the part
  of the start-up that comes after the engine: what starting processes 1..N-1 beside the engine targets).

Then the server is stopped (SIGTERM to its group) before the next start. Wall times on a shared machine
move with its load: compare only the same run's alternating numbers, and the CPU seconds.

    python benchmarks/api_server_start.py --checkout /path/to/base --checkout . --reps 3 \\
        --model ~/.cache/rlserve/SmolLM2-135M-Instruct --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402

from rlserve.server.launch import free_port, spawn_server, stop_group, tree_cpu_seconds  # noqa: E402

_READY = re.compile(r"rlserve: serving .* on (http://\S+) ")
_STAMP = r"^(?:\(\S+ pid=\d+\) )?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO "  # (prefixed since session 25)


def after_engine(log_text: str) -> float | None:
    """Seconds from API process 0's "engine replica 0 ready in process" line to its "ready:" line (lines of
    processes 1..N-1, ``[api-server i]`` before session 25 and ``(ApiServer_i pid=P)`` since, are skipped)."""
    def stamp(pattern: str) -> float | None:
        for line in log_text.splitlines():
            m = re.match(_STAMP + pattern, line)
            if m and "[api-server " not in line and not re.match(r"\(ApiServer_[1-9]", line):
                return datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        return None

    a, b = stamp(r"rlserve\.engine\.front\.core_client: engine replica 0 ready"), stamp(r"rlserve\.serve: ready: ")
    return None if a is None or b is None else round(b - a, 2)


def one_start(checkout: str, model: str, count: int, extra: list[str], timeout_s: float) -> dict:
    """One start of ``checkout``'s server; returns its record (``error`` set when it did not get ready)."""
    port = free_port()
    fd, log_path = tempfile.mkstemp(prefix="api-server-start-", suffix=".log")
    os.close(fd)
    # run in the checkout: ``python -m`` imports from the working directory first (API process 0 starts
    # processes 1..N-1 with its own directory and PYTHONPATH)
    env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "rlserve", "serve", model, "--device", "cpu", "--port", str(port),
           "--api-server-count", str(count), *extra]
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    proc, log = spawn_server(cmd, log_path, env, cwd=os.path.abspath(checkout))
    rec = {"checkout": checkout, "count": count, "load_1min": round(load, 2), "health": None, "ready": None,
           "cpu": None, "log": log_path}
    try:
        while time.monotonic() - t0 < timeout_s:
            if proc.poll() is not None:
                rec["error"] = f"exited {proc.returncode}"
                break
            if rec["health"] is None:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                        rec["health"] = round(time.monotonic() - t0, 2)
                except httpx.HTTPError:
                    pass
            with open(log_path, errors="replace") as f:
                if _READY.search(f.read()):
                    rec["ready"] = round(time.monotonic() - t0, 2)
                    rec["cpu"] = round(tree_cpu_seconds(proc.pid) or 0.0, 2)
                    break
            time.sleep(0.05)
        else:
            rec["error"] = f"not ready within {timeout_s} s"
    finally:
        stop_group(proc)
        log.close()
    with open(log_path, errors="replace") as f:
        rec["after_engine"] = after_engine(f.read())
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkout", action="append", default=None, help="repository root to run (repeatable)")
    ap.add_argument("--reps", type=int, default=3, help="starts per checkout (interleaved)")
    ap.add_argument("--count", type=int, default=2, help="--api-server-count")
    ap.add_argument("--model", required=True, help="model directory")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one start may take")
    ap.add_argument("--json", default=None, help="write every run's record here")
    ap.add_argument("extra", nargs="*", help="more rlserve serve flags (after --)")
    args = ap.parse_args()
    checkouts = args.checkout or ["."]
    rev = {c: subprocess.run(["git", "-C", c, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip() for c in checkouts}
    runs = []
    for rep in range(args.reps):
        for c in checkouts:
            rec = one_start(c, args.model, args.count, args.extra, args.timeout)
            rec.update(rep=rep, rev=rev[c])
            runs.append(rec)
            print(json.dumps(rec), flush=True)
    for c in checkouts:
        mine = [r for r in runs if r["checkout"] == c and r["ready"] is not None]
        if mine:
            print(f"{c} ({rev[c]}): " + ", ".join(
                f"{k} median {statistics.median(r[k] for r in mine):.2f}" for k in ("health", "ready", "after_engine", "cpu"))
                + f" over {len(mine)} starts")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                       "machine": os.uname().nodename, "cpus": os.cpu_count(), "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
