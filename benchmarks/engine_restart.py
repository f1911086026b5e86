"""Engine-core restart time of ``rlserve serve`` (issue 33): ``kill -9`` of the engine-core
process -> ``/health`` no longer reporting the engine dead (the new core loaded; the server
answers 200, or 503 ``weights_lost`` when trained weights were lost), and -> the first 200
generation. Baseline of the same run: a cold start of the whole server (process start ->
``/health`` 200).

    python benchmarks/engine_restart.py --reps 5
    python benchmarks/engine_restart.py --reps 3 --model ~/.cache/rlserve/SmolLM2-135M-Instruct --no-dummy

Default model: the tests' tiny Llama with ``--load-format dummy`` (CPU). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402

from rlserve.server.testing import ServerProcess  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402


def _core_pid(url: str) -> int:
    return httpx.get(url + "/server_info", timeout=60).json()["engine_core_pids"][0]


def one_restart(url: str, timeout_s: float = 600.0) -> dict:
    """Kill the core; poll ``/health`` every 5 ms. Seconds to: health not dead; a 200 generation."""
    pid = _core_pid(url)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    saw_dead = False
    while True:
        r = httpx.get(url + "/health", timeout=60)
        dead = r.status_code == 503 and r.json().get("status") == "dead"
        saw_dead = saw_dead or dead
        if saw_dead and not dead:
            break
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"no restart within {timeout_s} s: {r.text}")
        time.sleep(0.005)
    health_s = time.monotonic() - t0
    body = {"prompt": [5, 6, 7], "max_tokens": 1, "temperature": 0}
    while httpx.post(url + "/v1/completions", json=body, timeout=60).status_code != 200:
        time.sleep(0.005)
    return {"health_s": round(health_s, 3), "first_200_s": round(time.monotonic() - t0, 3),
            "health_status": r.status_code}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-dummy", action="store_true", help="load the model's real weights")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    model = args.model or make_tiny_model("llama", tempfile.mkdtemp(prefix="rlserve-restart-"))
    extra = ["--device", args.device, "--disable-access-log", "--max-engine-restarts", str(args.reps + 1),
             "--engine-restart-window", "3600"] + ([] if args.no_dummy else ["--load-format", "dummy"])
    t0 = time.monotonic()
    with ServerProcess(model, *extra, startup_timeout_s=900) as srv:
        cold = time.monotonic() - t0
        runs = [one_restart(srv.url) for _ in range(args.reps)]
    out = {"model": model, "device": args.device, "reps": args.reps, "cold_start_s": round(cold, 3),
           "restart_health_s": [r["health_s"] for r in runs], "restart_first_200_s": [r["first_200_s"] for r in runs],
           "median_health_s": statistics.median(r["health_s"] for r in runs),
           "load_average": os.getloadavg()[0], "machine": platform.node(), "cpus": os.cpu_count(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
