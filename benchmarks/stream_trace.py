"""The API process's side of a streamed run (issue 37): when it wrote each chunk of each stream, and when
its event loop woke late.

Installed at interpreter start (``sitecustomize`` in a directory put first on the server's ``PYTHONPATH``,
see :func:`site_dir`; ``STREAM_TRACE_DIR`` names the output directory), it patches uvicorn's
``RequestResponseCycle.send`` (httptools and h11 protocols: any rlserve tree, either HTTP stack) when those
modules are first imported (the API process only: no other process imports them) and writes to
``<dir>/<pid>.chunks``:

* per finished streamed response one line ``<arrival> <start> <t1> <n1> <t2> <n2> ...``:
  ``time.perf_counter()`` seconds of the request's arrival (its head parsed: uvicorn made its cycle), of the
  response's start and of each body write (taken as the app hands it to uvicorn, which
  writes it to the socket at once unless the transport is paused), with the SSE events in that write that
  carry a choice (the events ``vllm bench serve`` counts as chunks: not the usage-only chunk, not
  ``[DONE]``);
* ``lag <t> <ms>``: a 2 ms sleep of a watcher task on the API's event loop that woke ``ms`` late (over
  ``STREAM_TRACE_LAG_MS``, default 10): the loop ran something else that long (callbacks, GC, the GIL held
  by another thread);
* ``blocked <t> <ms>``: a body write whose ``send`` took over 5 ms (the transport paused: the client did
  not read);
* ``cpu <t> <process s> <loop thread s>``: every ~0.5 s, the process's CPU seconds (all threads) and the event
  loop thread's (``time.process_time`` / ``time.thread_time``): a loop thread near one CPU second a second is
  saturated, and its streams get several tokens a chunk.

In the engine-core process it logs, to ``<dir>/<pid>.jit``, every Triton JIT specialization a launch finds
missing from its kernel's in-memory cache (``knobs.runtime.jit_cache_hook``, chained with the one
:mod:`rlserve.engine.worker.triton_precompile` installs): ``<perf_counter s> <module>.<kernel> <specialization
data>``; one after the warm-up is a compile (or a disk-cache load) in the middle of serving, a stall of every
stream.

In both processes, every garbage collection of 5 ms or more goes to ``<dir>/<pid>.gc``: ``<perf_counter s at its
start> gen<generation> <ms> <objects collected>`` (a collection holds the GIL: every thread of the process waits).

``benchmarks/stream_gaps.py --server DIR`` reads them back beside ``vllm bench serve``'s per-request detail
(``perf_counter`` is ``CLOCK_MONOTONIC`` on Linux: one clock for both processes). Cost: one
``perf_counter`` and a byte count per write, one line per stream, ~500 loop wake-ups a second.
"""

from __future__ import annotations

import asyncio
import importlib.abc
import importlib.machinery
import os
import sys
import time

ENV_DIR = "STREAM_TRACE_DIR"
ENV_LAG_MS = "STREAM_TRACE_LAG_MS"
TARGETS = ("uvicorn.protocols.http.httptools_impl", "uvicorn.protocols.http.h11_impl")


def chunks_in(body: bytes) -> int:
    """SSE events of ``body`` that carry a choice (``vllm bench serve`` counts those)."""
    n = body.count(b"data: ") - body.count(b"data: [DONE]")
    return n - body.count(b'"choices":[]') - body.count(b'"choices": []')


class _Out:
    def __init__(self, out_dir: str, lag_ms: float):
        self.path = os.path.join(out_dir, f"{os.getpid()}.chunks")
        self.f = None  # opened at the first record (processes that serve nothing leave no file)
        self.lag_s = lag_ms / 1e3
        self.watching = set()

    def write(self, line: str) -> None:
        if self.f is None:
            self.f = open(self.path, "a", buffering=1 << 16)  # noqa: SIM115 - lives with the process
        self.f.write(line)
        self.f.flush()

    def watch(self, loop) -> None:
        """Start the lag watcher on ``loop`` (once per loop)."""
        if id(loop) in self.watching:
            return
        self.watching.add(id(loop))

        async def watcher():
            pc, lag, cpu_at = time.perf_counter, self.lag_s, 0.0
            while True:
                t = pc()
                if t >= cpu_at:
                    self.write(f"cpu {t:.6f} {time.process_time():.4f} {time.thread_time():.4f}\n")
                    cpu_at = t + 0.5
                await asyncio.sleep(0.002)
                late = pc() - t - 0.002
                if late > lag:
                    self.write(f"lag {t + 0.002:.6f} {1e3 * late:.2f}\n")

        loop.create_task(watcher())


def patch(module, out: _Out) -> None:
    """Wrap ``module.RequestResponseCycle.send`` (see the module docstring)."""
    cls = module.RequestResponseCycle
    original, init = cls.send, cls.__init__
    pc = time.perf_counter

    def __init__(self, *args, **kwargs):
        self._trace_in = pc()
        init(self, *args, **kwargs)

    async def send(self, message):
        kind = message.get("type")
        if kind == "http.response.start":
            out.watch(asyncio.get_running_loop())
            self._trace_rec = [getattr(self, "_trace_in", 0.0), pc()]
        elif kind == "http.response.body":
            rec = getattr(self, "_trace_rec", None)
            body = message.get("body") or b""
            t = pc()
            n = chunks_in(bytes(body)) if body and rec is not None else 0
            if n:
                rec.append(t)
                rec.append(n)
            await original(self, message)
            dt = pc() - t
            if dt > 0.005:
                out.write(f"blocked {t:.6f} {1e3 * dt:.2f}\n")
            if rec is not None and not message.get("more_body", False):
                self._trace_rec = None
                if len(rec) > 2:
                    out.write(" ".join(f"{x:.6f}" if isinstance(x, float) else str(x) for x in rec) + "\n")
            return
        await original(self, message)

    cls.send = send
    cls.__init__ = __init__


class _Finder(importlib.abc.MetaPathFinder):
    """Patches each of :data:`TARGETS` right after it is executed."""

    def __init__(self, out: _Out):
        self.out = out

    def find_spec(self, name, path, target=None):
        if name not in TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader, out = spec.loader, self.out
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            patch(module, out)

        loader.exec_module = exec_and_patch
        return spec


class _JitFinder(importlib.abc.MetaPathFinder):
    """Installs the JIT logger right after ``triton`` is executed (engine-core process)."""

    def __init__(self, path: str):
        self.path = path

    def find_spec(self, name, path, target=None):
        if name != "triton":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module, log_path = spec.loader.exec_module, self.path

        def exec_and_hook(module):
            exec_module(module)
            try:
                hook_jit(log_path)
            except Exception as e:  # noqa: BLE001 - another Triton: serve untraced
                print(f"stream_trace: no JIT log: {e}", file=sys.stderr)

        spec.loader.exec_module = exec_and_hook
        return spec


def hook_jit(path: str) -> None:
    """Log each JIT cache miss to ``path`` (see the module docstring), then defer to the hook found."""
    from triton import knobs

    f = open(path, "a", buffering=1)  # noqa: SIM115 - lives with the process
    prev = knobs.runtime.jit_cache_hook

    def hook(**kw):
        fn = kw.get("fn")
        data = (kw.get("compile") or {}).get("specialization_data", "")
        f.write(f"{time.perf_counter():.6f} {getattr(fn, 'module', '?')}.{getattr(fn, 'name', '?')} "
                f"{' '.join(str(data).split())}\n")
        return prev(**kw) if prev is not None else None

    knobs.runtime.jit_cache_hook = hook


def log_gc(path: str, min_ms: float = 5.0) -> None:
    """Log this process's garbage collections of ``min_ms`` or more to ``path`` (see the module docstring)."""
    import gc

    f, t0, pc = [None], [0.0], time.perf_counter

    def on_gc(phase, info):
        if phase == "start":
            t0[0] = pc()
            return
        ms = 1e3 * (pc() - t0[0])
        if ms >= min_ms:
            if f[0] is None:
                f[0] = open(path, "a", buffering=1)  # noqa: SIM115 - lives with the process
            f[0].write(f"{t0[0]:.6f} gen{info.get('generation')} {ms:.2f} {info.get('collected')}\n")

    gc.callbacks.append(on_gc)


def _is_core() -> bool:
    """An engine-core process (at interpreter start its ``sys.argv`` is ``['-m', '--input', ...]``, or
    ``['-m', '--prestarted', ...]`` when the API process prestarted it)."""
    return "core_proc" in " ".join(sys.argv) or bool({"--input", "--prestarted"} & set(sys.argv))


def install() -> None:
    """Patch the API process's body writes once uvicorn's protocols are imported, and log the engine-core
    process's Triton JIT misses once Triton is imported (no-op without ``STREAM_TRACE_DIR``)."""
    out_dir = os.environ.get(ENV_DIR)
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    log_gc(os.path.join(out_dir, f"{os.getpid()}.gc"))
    if _is_core():
        sys.meta_path.insert(0, _JitFinder(os.path.join(out_dir, f"{os.getpid()}.jit")))
        return
    sys.meta_path.insert(0, _Finder(_Out(out_dir, float(os.environ.get(ENV_LAG_MS, "10")))))


def site_dir(root: str) -> str:
    """A directory holding a ``sitecustomize.py`` that installs this trace, the engine's step trace
    (``benchmarks/step_trace.py``) and the API's stall probe (``benchmarks/api_stream_probe.py``: with
    ``API_STREAM_PROBE_SPLIT=1`` its timers of the engine-output callback's parts); each is a no-op without its
    directory variable or in the other process. Put it first on the server's ``PYTHONPATH`` (the repository
    after it)."""
    from benchmarks.api_stream_probe import site_dir as probe_site_dir

    return probe_site_dir(root, ("benchmarks.step_trace", "benchmarks.stream_trace", "benchmarks.api_stream_probe"))
