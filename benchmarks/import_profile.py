"""What ``rlserve serve``'s two processes import before they can serve, and what it costs (issue 37:
start-up to ready; the engine-core process spent 10.6-13.8 s in its imports on the H100 machine).

Each run is a fresh ``python -X importtime`` process that does one process's start-up imports:

- ``core``: a prestarted engine-core process's (:func:`rlserve.engine.core.core_proc.warm_up_imports`,
  with ``--device``: ``cuda`` adds the CUDA driver init and Triton's source hash where
  ``RLSERVE_GPU_START_OVERLAP=1``, as ``rlserve serve`` runs it); with ``--build`` also the engine's
  construction as ``core_proc.main`` does it (``--model``; session 22: the core's tokenizer, and with it
  transformers' tokenizer classes, loads after ready, so a tree's imports alone no longer compare);
- ``api``: the API process's, as ``rlserve serve`` does them on a GPU with the overlap on: the app's
  modules, the generation defaults and the tokenizer's load (transformers) on three threads beside each
  other, after the CLI and the async engine's modules (``--model DIR``: its config and tokenizer; default
  the tests' tiny Llama).

It prints, per run: wall seconds, the process's CPU seconds (all threads; far below the wall: it waited on
the disk or on locks), whether the big packages' bytecode is cached (``.pyc``: a read-only install without
it compiles the sources at every start), and the ``--top`` modules by cumulative import time among the first ``--depth``
levels of the import tree, and by self time; ``--checkout DIR`` (repeatable) compares trees, interleaved,
``--rounds`` times each (PYTHONPATH puts the checkout first). ``--json`` writes every run.

    python benchmarks/import_profile.py --side core --side api --rounds 3 --checkout /tmp/main --checkout .
    python3 benchmarks/import_profile.py --side core --side api --device cuda --parallel   # the GPU machine

``--parallel`` starts the sides of one round at the same time (as ``rlserve serve`` starts them). The API side
imports on three threads: its modules' times are wall-clock and include the other threads' turns on the GIL
(read its CPU seconds).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CORE = """
import contextlib, sys, time
t = time.perf_counter()
from rlserve.engine.core.core_proc import warm_up_imports
try:  # as prestarted_main runs it (session 21: collections off)
    from rlserve.gc_heap import no_collections_while_importing as gc_off
except ImportError:
    gc_off = contextlib.nullcontext
with gc_off():
    parts = warm_up_imports(sys.argv[1])
if sys.argv[3:4] == ["build"]:  # --build: then the engine, as core_proc.main builds it (the model: sys.argv[2])
    import inspect
    from rlserve.config import EngineConfig
    from rlserve.engine.core.engine_core import EngineCore
    from rlserve.engine.core.llm_engine import LLMEngine
    kw = {"defer_tokenizer": True} if "defer_tokenizer" in inspect.signature(LLMEngine).parameters else {}
    t_build, c_build = time.perf_counter(), time.process_time()
    config = EngineConfig(model=sys.argv[2], device=sys.argv[1], max_model_len=256, max_num_seqs=8)
    EngineCore(LLMEngine(config, **kw), 0, "0", deltas=True)
    parts = [p for p in parts if p[0] != "CPU"] + [("engine build", time.perf_counter() - t_build),
                                                     ("build CPU", time.process_time() - c_build),
                                                     ("CPU", time.process_time())]
print("RESULT", time.perf_counter() - t, time.process_time(), repr(parts), flush=True)
""" + """
import importlib.util, os
pyc = []
for name in ("torch", "transformers", "triton", "sympy", "rlserve"):
    m = sys.modules.get(name)
    f = getattr(m, "__file__", None) or ""
    if f.endswith(".py"):
        cached = importlib.util.cache_from_source(f)
        where = os.path.dirname(cached) if os.path.isdir(os.path.dirname(cached)) else os.path.dirname(f)
        pyc.append((name, os.path.exists(cached), os.access(where, os.W_OK)))
print("PYC", repr((sys.flags.dont_write_bytecode, sys.pycache_prefix, pyc)), flush=True)
"""

_API = """
import sys, time
t0 = time.perf_counter()
model = sys.argv[2]
import rlserve.cli.serve as serve
from rlserve.cli.vllm_compat import generation_defaults
from rlserve.engine.front.async_engine import AsyncEngine  # noqa: F401
from rlserve.engine.front import core_client  # noqa: F401
from rlserve.engine.front.replica_setup import TokenizerOnce
from types import SimpleNamespace
done = {"cli + engine front": time.perf_counter() - t0}
def timed(name, fn, *args):
    def run():
        try:
            fn(*args)
            done[name] = time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - reported in the result
            done[f"{name} FAILED: {type(e).__name__}: {e}"[:300]] = time.perf_counter() - t0
    return run
# as rlserve serve on a GPU with the overlap on: serve's own _beside threads (the tokenizer's prefetch is
# CoreProcReplica.start's thread there; its error is reported here, not swallowed)
tok = TokenizerOnce(SimpleNamespace(model=model, tokenizer=None, skip_tokenizer_init=False))
futs = [serve._beside(timed("app", serve._import_app)), serve._beside(timed("generation defaults", generation_defaults,
        "auto", model)), serve._beside(timed("tokenizer", tok))]
for f in futs:
    f.result()
parts = [(k, round(v, 3)) for k, v in sorted(done.items(), key=lambda kv: kv[1])]
print("RESULT", time.perf_counter() - t0, time.process_time(), repr(parts), flush=True)
"""


def parse_importtime(text: str) -> list[tuple[int, int, int, str]]:
    """``-X importtime`` lines as ``(self_us, cumulative_us, depth, module)``, in the order printed."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        head, cum, name = line.split("|", 2)
        raw = name.rstrip("\n")[1:]
        rows.append((int(head.split(":")[1]), int(cum), (len(raw) - len(raw.lstrip(" "))) // 2, raw.strip()))
    return rows


def top(rows, n: int, depth: int) -> dict[str, list[tuple[str, float]]]:
    """The ``n`` largest by cumulative ms among depths ``<= depth``, by self ms (any depth), and the top-level
    packages by their modules' self ms summed (where the import time goes, package by package)."""
    cum = sorted((r for r in rows if r[2] <= depth), key=lambda r: -r[1])[:n]
    own = sorted(rows, key=lambda r: -r[0])[:n]
    packages: dict[str, int] = {}
    for r in rows:
        packages[r[3].split(".")[0]] = packages.get(r[3].split(".")[0], 0) + r[0]
    by_package = sorted(packages.items(), key=lambda kv: -kv[1])[:n]
    return {"cumulative_ms": [(r[3], round(r[1] / 1000, 1)) for r in cum],
            "self_ms": [(r[3], round(r[0] / 1000, 1)) for r in own],
            "package_self_ms": [(k, round(v / 1000, 1)) for k, v in by_package]}


def start(checkout: str, side: str, args) -> tuple[subprocess.Popen, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.path.abspath(checkout), REPO,
                                                                    os.environ.get("PYTHONPATH", "")) if p))
    if args.device != "cpu":
        env.setdefault("RLSERVE_GPU_START_OVERLAP", "1")
    code, extra = (_CORE, [args.device, args.model, "build" if args.build else "imports"]) if side == "core" \
        else (_API, [args.device, args.model])
    p = subprocess.Popen([sys.executable, "-X", "importtime", "-c", code, *extra], env=env, cwd=checkout,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return p, time.perf_counter()


def finish(p: subprocess.Popen, t0: float, checkout: str, side: str, args) -> dict:
    out, err = p.communicate(timeout=args.timeout)
    wall = time.perf_counter() - t0
    res = next((ln.split(" ", 3) for ln in out.splitlines() if ln.startswith("RESULT ")), None)
    run = {"checkout": checkout, "side": side, "rc": p.returncode, "process_wall_s": round(wall, 3)}
    if res is None:
        run["error"] = err[-2000:]
        return run
    run.update(imports_s=round(float(res[1]), 3), cpu_s=round(float(res[2]), 3), parts=ast.literal_eval(res[3]) or [])
    run.update(top(parse_importtime(err), args.top, args.depth))
    pyc = next((ln.split(" ", 1)[1] for ln in out.splitlines() if ln.startswith("PYC ")), None)
    if pyc is not None:  # (dont_write_bytecode, pycache_prefix, [(package, its __init__'s .pyc exists, writable)])
        run["pyc"] = ast.literal_eval(pyc)
    return run


def show(run: dict) -> None:
    head = f"{run['checkout']} {run['side']}:"
    if "error" in run:
        print(f"{head} FAILED rc {run['rc']}: {run['error'][-600:]}")
        return
    parts = ", ".join(f"{k} {v:.2f}" for k, v in run["parts"])
    print(f"{head} imports {run['imports_s']:.2f} s wall, {run['cpu_s']:.2f} s CPU "
          f"(process {run['process_wall_s']:.2f} s)"
          f" [{parts}]")
    if "pyc" in run:  # a package without its .pyc compiles its sources at every start (a read-only install)
        dont, prefix, pkgs = run["pyc"]
        print(f"   bytecode: dont_write {dont}, prefix {prefix}; " + ", ".join(
            f"{n} {'cached' if c else 'NOT cached'}{'' if w else ' (read-only)'}" for n, c, w in pkgs))
    print("   by package (self ms summed): " + ", ".join(f"{m} {v:.0f}" for m, v in run["package_self_ms"]))
    print("   cumulative ms: " + ", ".join(f"{m} {v:.0f}" for m, v in run["cumulative_ms"]))
    print("   self ms: " + ", ".join(f"{m} {v:.0f}" for m, v in run["self_ms"]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", action="append", choices=("core", "api"), help="default: both")
    ap.add_argument("--checkout", action="append", help="a tree to import from (default: this one)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="the server's --device (core: cuda adds CUDA init + Triton key)")
    ap.add_argument("--model", default=None, help="api: the model directory (config, tokenizer); default tiny Llama")
    ap.add_argument("--parallel", action="store_true", help="start a round's sides at the same time")
    ap.add_argument("--build", action="store_true",
                    help="core: then build the engine as the engine-core process does (--model, max_model_len 256): "
                         "imports + build = the core's start to ready (a tree whose core loads its tokenizer at "
                         "construction pays that here)")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--depth", type=int, default=2, help="import-tree levels ranked by cumulative time")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take (catches a hang)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sides = args.side or ["core", "api"]
    checkouts = args.checkout or [REPO]
    if args.model is None:
        sys.path.insert(0, REPO)
        from tests.tiny_models import make_tiny_model

        tmp = os.environ.get("TMPDIR", "/tmp")
        args.model = make_tiny_model("llama", os.path.join(tmp, "rlserve-bench-tiny-llama"))
    runs = []
    for r in range(args.rounds):
        order = checkouts if r % 2 == 0 else checkouts[::-1]  # interleaved, the order swapped every round
        for c in order:
            if args.parallel:
                started = [(start(c, s, args), s) for s in sides]
                done = [finish(p, t0, c, s, args) for (p, t0), s in started]
            else:
                done = [finish(*start(c, s, args), c, s, args) for s in sides]
            for run in done:
                run["round"] = r
                show(run)
            runs.extend(done)
    by = {}
    for run in runs:
        if "error" not in run:
            by.setdefault((run["checkout"], run["side"]), []).append(run)
    for (c, s), rs in by.items():
        print(f"summary {c} {s}: imports wall " + ", ".join(f"{x['imports_s']:.2f}" for x in rs)
              + " s; CPU " + ", ".join(f"{x['cpu_s']:.2f}" for x in rs) + " s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "model": args.model, "runs": runs}, f, indent=1)
    return 0 if all("error" not in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
