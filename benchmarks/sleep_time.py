"""Time sleep mode's level-1 ``POST /sleep`` and ``POST /wake_up`` of ``rlserve serve``, the first and
later rounds, with and without ``--batch-invariant`` (interleaved: one server per config and rep).

Session 17 saw a first level-1 sleep take 20.1 s on a busy machine with ``--batch-invariant`` (1.4 s
on another server). Each row gives the client's seconds per call and the server's own phase lines:
the API's ``asleep (level 1): ... in X s`` (pause + abort + the cores' sleep) and the engine core's
``sleep level 1: ... released in X s`` (the workers' offload: on CUDA a page-locked host copy made
at the first sleep, then the device pages unmapped), to say where the time went.

    python3 benchmarks/sleep_time.py --device cpu --reps 2                       # tiny Llama
    python3 benchmarks/sleep_time.py --device cuda --shape qwen3-0.6b --reps 2  # dummy weights

One JSON line per server on stdout (and in ``--json``): ``{"config", "rep", "rounds": [{"sleep_s",
"wake_s"}], "server_lines", "load_avg"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402

from rlserve.server.testing import ServerProcess  # noqa: E402

#: the server's log lines that time the sleep and the wake
_PHASES = ("asleep (level", "sleep level", "wake_up(", "sleep mode:", "offload")


def model_dir(shape: str | None) -> str:
    """A dummy checkpoint: a shape of benchmarks/model_shapes.py with the tests' tokenizer, else
    the tests' tiny Llama."""
    root = tempfile.mkdtemp(prefix="rlserve-sleep-time-")
    if shape:
        from benchmarks.model_shapes import save_shape
        from tests.tiny_models import build_tokenizer

        path = save_shape(shape, root)
        build_tokenizer().save_pretrained(path)
        return path
    from tests.tiny_models import make_tiny_model

    return make_tiny_model("llama", os.path.join(root, "llama"))


def one(model: str, flags: list[str], args) -> dict:
    """Start a server, generate once, then ``--rounds`` x (sleep level 1, wake up)."""
    with ServerProcess(model, "--device", args.device, "--enable-sleep-mode", "--load-format", "dummy",
                       "--max-model-len", str(args.max_model_len), "--disable-access-log", *flags,
                       startup_timeout_s=args.start_timeout) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4}, timeout=300)
        r.raise_for_status()
        rounds = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            s = httpx.post(srv.url + "/sleep", params={"level": 1}, timeout=600)
            t1 = time.perf_counter()
            w = httpx.post(srv.url + "/wake_up", timeout=600)
            t2 = time.perf_counter()
            if s.status_code != 200 or w.status_code != 200:
                raise RuntimeError(f"sleep {s.status_code} {s.text[:200]}; wake {w.status_code} {w.text[:200]}")
            rounds.append({"sleep_s": round(t1 - t0, 3), "wake_s": round(t2 - t1, 3)})
        lines = [ln[:220] for ln in srv.log_tail(1_000_000).splitlines() if any(p in ln for p in _PHASES)]
    return {"rounds": rounds, "server_lines": lines, "load_avg": round(os.getloadavg()[0], 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default=None, help="a shape of benchmarks/model_shapes.py (default: tiny Llama)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="sleep + wake rounds per server")
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--configs", nargs="+", default=["default", "batch_invariant"],
                    choices=["default", "batch_invariant"])
    ap.add_argument("--json", default=None, help="also write the rows here (a JSON list)")
    args = ap.parse_args()
    model = model_dir(args.shape)
    rows = []
    for rep in range(args.reps):
        for config in args.configs:
            flags = ["--batch-invariant"] if config == "batch_invariant" else []
            try:
                row = {"config": config, "rep": rep, **one(model, flags, args)}
            except Exception as e:  # noqa: BLE001 - the other configs still run
                row = {"config": config, "rep": rep, "error": f"{type(e).__name__}: {e}"[:2000]}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
