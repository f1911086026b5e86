"""Event-loop stall probe for ``benchmarks/api_stream_load.py --probe`` (issue 37): what holds a
server process's thread so long that no stream writes meanwhile.

Installed at interpreter start in every process of the server (``sitecustomize`` in a directory
put first on the server's ``PYTHONPATH``, see :func:`site_dir`), it records, as lines of
``<unix time s> <kind> <ms> <name>`` in ``<dir>/<pid>.txt``:

* ``gc2``: every full (generation-2) garbage collection, its duration (``gc.callbacks``);
* ``slow``: every asyncio callback or task step that ran longer than ``slow_ms`` (default 20 ms),
  named by its callback (and the task's coroutine): ``asyncio.events.Handle._run`` is wrapped,
  which costs ~0.5 us per callback, so compare probed runs with probed runs only. Only the stdlib
  loop's callbacks: uvloop's handles are C (``api_stream_load --probe`` runs its servers with
  ``RLSERVE_HTTP_IMPL=h11`` unless a config sets it).

With ``API_STREAM_PROBE_SPLIT=1`` the API process also sums the time of the engine-output
callback's parts (:func:`_time_parts`, ``<dir>/<pid>.split``). (A sampler of the main thread's
stack from another thread crashed CPython 3.11 with SIGSEGV: not used.) Each ``.txt`` file's first
line names the process: ``api`` or ``core`` (``sys.argv[0]`` once the program
runs). :func:`summarize` reads them back for a time window (the measured run).
"""

from __future__ import annotations

import collections
import os
import sys
import time

ENV_DIR = "API_STREAM_PROBE_DIR"
ENV_SLOW_MS = "API_STREAM_PROBE_SLOW_MS"
ENV_SPLIT = "API_STREAM_PROBE_SPLIT"


def _label() -> str:
    """``core`` for an engine-core process (``-m rlserve.engine.core.core_proc --input ...``;
    at interpreter start ``sys.argv`` is ``['-m', '--input', ...]``), else ``api``."""
    return "core" if "core_proc" in " ".join(sys.argv) or "--input" in sys.argv else "api"


def install() -> None:
    """Start recording into ``$API_STREAM_PROBE_DIR`` (no-op when unset)."""
    out_dir = os.environ.get(ENV_DIR)
    if not out_dir:
        return
    import asyncio.events
    import gc

    slow_s = float(os.environ.get(ENV_SLOW_MS, "20")) / 1e3
    f = open(os.path.join(out_dir, f"{os.getpid()}.txt"), "a", buffering=1)  # noqa: SIM115 - lives with the process
    named = []
    gc_start = [0.0]

    def write(kind: str, seconds: float, name: str) -> None:
        if not named:
            named.append(True)
            f.write(f"0 process 0 {_label()}\n")
        f.write(f"{time.time():.3f} {kind} {1e3 * seconds:.2f} {name}\n")

    def on_gc(phase, info):
        if info.get("generation") != 2:
            return
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            write("gc2", time.perf_counter() - gc_start[0], f"collected={info.get('collected')}")

    gc.callbacks.append(on_gc)
    run = asyncio.events.Handle._run

    def timed_run(self):
        t = time.perf_counter()
        run(self)
        d = time.perf_counter() - t
        if d > slow_s:
            cb = self._callback
            name = getattr(cb, "__qualname__", None) or type(cb).__name__
            task = getattr(cb, "__self__", None)
            if task is not None and hasattr(task, "get_coro"):
                name += ":" + getattr(task.get_coro(), "__qualname__", "?")
            write("slow", d, name.replace(" ", "_"))

    asyncio.events.Handle._run = timed_run
    if os.environ.get(ENV_SPLIT) == "1" and "serve" in sys.argv[:3]:  # rlserve serve, not its engine core
        _time_parts(os.path.join(out_dir, f"{os.getpid()}.split"))


#: (module, class or None, function): the parts of the engine-output callback timed by ENV_SPLIT
SPLIT = [("rlserve.engine.front.core_client", "CoreProcReplica", "_handle_pending"),
         ("rlserve.engine.front.output_processor", "OutputProcessor", "process"),
         ("rlserve.engine.front.output_processor", "OutputProcessor", "_output"),
         ("rlserve.engine.detokenizer", "BaseIncrementalDetokenizer", "add_tokens"),
         ("rlserve.engine.front.replica", "Replica", "route"),
         ("rlserve.server.openai_stream", None, "sse_bytes")]  # a stream's chunks (sse: its other events)


def _time_parts(path: str) -> None:
    """Wrap each function of :data:`SPLIT` to sum its calls and seconds (~0.3 us a call), and
    rewrite ``path`` (JSON: name -> [calls, seconds]) at most once a second, from a wrapped call.
    Only the API process (``rlserve serve``); the modules are imported here, at start-up."""
    import functools
    import importlib
    import inspect
    import json

    sums: dict = {}
    last = [time.monotonic()]

    def wrap(name, fn):
        acc = sums.setdefault(name, [0, 0.0])

        @functools.wraps(fn)
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[0] += 1
                acc[1] += time.perf_counter() - t
                if time.monotonic() - last[0] > 1.0:
                    last[0] = time.monotonic()
                    try:
                        with open(path + ".tmp", "w") as f:
                            json.dump({"time": time.time(), "sums": sums}, f)
                        os.replace(path + ".tmp", path)
                    except OSError:
                        pass
        return timed

    for mod_name, cls_name, fn_name in SPLIT:
        try:
            mod = importlib.import_module(mod_name)
            owner = getattr(mod, cls_name) if cls_name else mod
            timed = wrap(f"{cls_name or mod_name}.{fn_name}", getattr(owner, fn_name))
            if isinstance(inspect.getattr_static(owner, fn_name), staticmethod):
                timed = staticmethod(timed)
            setattr(owner, fn_name, timed)
        except Exception as e:  # noqa: BLE001 - a moved function: the others are still timed
            print(f"api_stream_probe: cannot time {mod_name}.{fn_name}: {e}", file=sys.stderr)


def site_dir(root: str, module: str | tuple[str, ...] = "benchmarks.api_stream_probe") -> str:
    """A directory holding a ``sitecustomize.py`` that calls ``module``'s ``install()`` (this one's
    :func:`install` by default; a tuple: each module's, in order, each on its own); put it first on the
    server's ``PYTHONPATH`` (with the repository after it) and set ``API_STREAM_PROBE_DIR`` (or ``module``'s
    variable)."""
    d = os.path.join(root, "site")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "sitecustomize.py"), "w") as f:
        for mod in (module,) if isinstance(module, str) else module:
            f.write(f"try:\n    from {mod} import install\n    install()\n"
                    "except Exception as e:  # a broken probe must not stop the server\n"
                    f"    import sys; print('{mod}:', e, file=sys.stderr)\n")
    return d


def summarize(out_dir: str, t0: float, t1: float, top: int = 5) -> dict:
    """Per process label (``api``, ``core``) the records between unix times ``t0`` and ``t1``:
    ``{"gc2": {"n", "total_ms", "max_ms"}, "slow": {"n", "total_ms", "max_ms", "top": [[name, n,
    total_ms, max_ms], ...]}}`` (``top``: the names with the most stalled time)."""
    out: dict = {}
    for fn in sorted(os.listdir(out_dir)):
        if not fn.endswith(".txt"):
            continue
        label, rows = "?", []
        with open(os.path.join(out_dir, fn)) as f:
            for line in f:
                parts = line.split(" ", 3)
                if len(parts) != 4:
                    continue
                if parts[1] == "process":
                    label = parts[3].strip()
                elif t0 <= float(parts[0]) <= t1:
                    rows.append((parts[1], float(parts[2]), parts[3].strip()))
        dst = out.setdefault(label, {})
        for kind in ("gc2", "slow"):
            ms = [r[1] for r in rows if r[0] == kind]
            s = dst.setdefault(kind, {"n": 0, "total_ms": 0.0, "max_ms": 0.0})
            s["n"] += len(ms)
            s["total_ms"] = round(s["total_ms"] + sum(ms), 1)
            s["max_ms"] = max(s["max_ms"], max(ms, default=0.0))
        by_name: dict = collections.defaultdict(list)
        for kind, ms, name in rows:
            if kind == "slow":
                by_name[name].append(ms)
        ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
        dst["slow"].setdefault("top", []).extend(
            [name, len(v), round(sum(v), 1), round(max(v), 1)] for name, v in ranked)
    return out


def split_lines(out_dir: str) -> list[str]:
    """One line per API process of ``out_dir``'s split timers (``<pid>.split``, ``API_STREAM_PROBE_SPLIT=1``):
    each timed part's calls and seconds."""
    import glob
    import json

    out = []
    for path in sorted(glob.glob(os.path.join(out_dir, "*.split"))):
        with open(path) as f:
            sums = json.load(f)["sums"]
        out.append(os.path.basename(path) + ": " + ", ".join(f"{k} {n} calls {t:.2f} s" for k, (n, t) in sums.items()))
    return out
