"""Cold start-up: compile the Triton kernels a warm-up needs in parallel processes.

On a machine whose Triton cache is empty (a fresh GPU machine), every kernel specialization the
warm-up launches compiles when it is first launched, one after the other in the engine's thread:
9.2-12.4 s of a cold start in the seventh and eighth sessions (BENCHMARKS.md, "Start-up and stop").
Triton's compiler holds the GIL (six compiles on 1 and 2 threads of this repository's CPU machine,
2026-12-06: 1.03-1.11 s wall either way), so threads do not help; processes do.

:func:`precompile` runs a callable (the warm-up's forwards) once with every launch that would
compile *recorded instead*: Triton's ``knobs.runtime.jit_cache_hook`` sees each uncompiled
specialization before it compiles, with its serialized specialization data, and returning True
from it skips both the compilation and the launch (that call returns None). Only the calling
thread records; other threads compile and launch as usual. The specializations not already in
Triton's on-disk cache are then compiled by up to ``max_workers`` child processes (``python -c``,
this module's :func:`_child_main`), each writing into the same on-disk cache; the real warm-up
that follows loads them from there instead of compiling.

The recording pass launches no Triton kernel that was not compiled before it, so its outputs
are uninitialized memory: the callable must be one whose Triton outputs feed only floating-point
torch ops (the dense decoder's forward: norms, rotary, attention), never indices, shapes or host
decisions (a MoE model's forward is recorded with its routed experts switched off:
:func:`rlserve.engine.worker.jit_warmup.routed_experts_off`; its MoE kernels apart, with torch-built ids). A failure anywhere (recording, a child, a timeout) is logged and changes nothing else:
the real warm-up then compiles what is missing itself, as before.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time

logger = logging.getLogger(__name__)

#: child processes at most (each imports Triton, ~0.5 s, then compiles its share)
MAX_WORKERS = 8
#: seconds the parent waits for its children before it kills them and compiles what is left itself
#: (one cold compilation of the largest kernel here takes a few seconds)
CHILD_TIMEOUT_S = 60.0


def _resolvable(module: str, name: str) -> bool:
    """Whether a child can find the kernel again by ``import module; module.name`` (kernels defined
    inside functions -- ``<locals>`` in their qualified name -- cannot)."""
    return bool(module) and "<" not in name and "." not in name


def _decode(fn, data: str, target):
    """``(src, options)`` of the serialized specialization ``data`` of JIT function ``fn`` (Triton's
    ``JITFunction.preload`` decoding, with an explicit ``target`` instead of the current device's)."""
    import triton.language as tl
    from triton.compiler.compiler import ASTSource, make_backend

    obj = json.loads(data)
    constexprs = {
        tuple(k): (tl.dtype(v) if tl.dtype.is_dtype(v) else
                   tl.constexpr(v["constexpr"]) if isinstance(v, dict) and "constexpr" in v else v)
        for k, v in zip(obj["constant_keys"], obj["constant_vals"])
    }
    attrs = dict(zip(map(tuple, obj["attrs_keys"]), obj["attrs_vals"]))
    signature = {k: tuple(v) if isinstance(v, list) else v for k, v in obj["signature"].items()}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in obj["options"].items()}
    backend = make_backend(target)
    src = ASTSource(fn, signature, constexprs, attrs)
    return src, backend.parse_options(dict(options, **src.parse_options()))


def _cached(src, options, target) -> bool:
    """Whether Triton's on-disk cache already holds this compilation (the lookup of
    ``triton.compiler.compile``: same key, same metadata file name)."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.compiler.compiler import make_backend
    from triton.runtime.cache import get_cache_key, get_cache_manager

    key = get_cache_key(src, make_backend(target), options, env_vars=get_cache_invalidating_env_vars())
    name = f"{src.name[:150]}.json"
    group = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest()).get_group(name) or {}
    return group.get(name) is not None


def _kernel(module: str, name: str):
    import importlib

    return getattr(importlib.import_module(module), name)


_RECORDERS: dict[int, dict] = {}  # thread id -> {specialization data: spec} while it records
_PREV_HOOK: list = [None]  # the jit_cache_hook found when ours was installed (chained)


def _hook(**kw):
    """Triton's ``jit_cache_hook``: in a recording thread, note the specialization and return True
    (skip its compilation and launch); elsewhere defer to the hook found before (or compile)."""
    specs = _RECORDERS.get(threading.get_ident())
    if specs is None:
        prev = _PREV_HOOK[0]
        return prev(**kw) if prev is not None else None
    info = kw["fn"]
    data = kw["compile"]["specialization_data"]
    specs.setdefault(data, {"module": info.module, "name": info.name, "data": data})
    return True


def record(fn) -> list[dict]:
    """Run ``fn()`` with this thread's Triton compilations recorded instead of done (see the module
    docstring). Our hook stays installed once set (it defers to the previous one outside recording
    threads), so threads recording at the same time never undo each other's hook.

    Returns:
        one dict per distinct uncompiled specialization, in first-launch order: ``module``, ``name``
        (the kernel's module and qualified name), ``data`` (Triton's serialized specialization data).

    Raises:
        RuntimeError: this thread is already recording.
    """
    from triton import knobs

    me = threading.get_ident()
    if me in _RECORDERS:
        raise RuntimeError("this thread is already recording Triton compilations")
    if knobs.runtime.jit_cache_hook is not _hook:
        _PREV_HOOK[0] = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = _hook
    specs: dict[str, dict] = {}
    _RECORDERS[me] = specs
    try:
        fn()
    finally:
        del _RECORDERS[me]
    return list(specs.values())


class Compiling:
    """Child processes compiling specializations into Triton's on-disk cache (from
    :func:`compile_specs`); :meth:`wait` for them. ``stats``: ``{"recorded", "cached", "compiled",
    "failed", "workers", "seconds"}`` (counts; ``compiled`` / ``failed`` and ``seconds``, the wall
    time since the start, are final after :meth:`wait`)."""

    def __init__(self, stats: dict, procs: list, t0: float):
        self.stats = stats
        self._procs = procs  # (Popen, share, stderr file)
        self._t0 = t0

    def wait(self, timeout_s: float = CHILD_TIMEOUT_S) -> dict:
        """Wait for every child (one still running after ``timeout_s`` is killed: its share then
        compiles where it is first launched); returns :attr:`stats`."""
        deadline = time.monotonic() + timeout_s
        for p, share, err in self._procs:
            try:
                rc = p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                rc = None
            err.seek(0)
            text = err.read().decode(errors="replace")[-2000:].strip()
            err.close()
            if rc == 0:
                self.stats["compiled"] += len(share)
            else:
                self.stats["failed"] += len(share)
                logger.warning("Triton precompile child %s (%d kernels): %s", "timed out" if rc is None else
                               f"exit {rc}", len(share), text or "no output")
        self._procs = []
        st = self.stats
        st["seconds"] = time.perf_counter() - self._t0
        logger.info("Triton precompile: %d kernel specializations recorded in %.2fs, %d already cached, %d "
                    "compiled by %d processes in %.2fs, %d failed", st["recorded"], st.get("record_seconds", 0.0),
                    st["cached"], st["compiled"], st["workers"], st["seconds"], st["failed"])
        return st


    def kill(self) -> None:
        """Kill and reap every child still running (a start that failed while they compiled: they
        used to run on, orphaned, until their share was compiled); their shares count as failed.
        Idempotent; :meth:`wait` after it returns at once."""
        procs, self._procs = self._procs, []
        for p, share, err in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            err.close()
            self.stats["failed"] += len(share)


def compile_specs(specs: list[dict], target, max_workers: int = MAX_WORKERS) -> Compiling:
    """Start compiling ``specs`` (from :func:`record`) into Triton's on-disk cache in child processes.

    Args:
        specs: the recorded specializations; those already cached and those a child cannot import
            (kernels defined inside functions) are left out.
        target: the ``triton.backends.compiler.GPUTarget`` to compile for (the current device's).
        max_workers: child processes at most (never more than the specializations to compile, nor
            than the CPUs).

    Returns:
        the running :class:`Compiling` (no children when nothing is left to compile).
    """
    t0 = time.perf_counter()
    todo, cached = [], 0
    for s in specs:
        if not _resolvable(s["module"], s["name"]):
            continue
        try:
            src, options = _decode(_kernel(s["module"], s["name"]), s["data"], target)
            if _cached(src, options, target):
                cached += 1
                continue
        except Exception:  # noqa: BLE001 -- a Triton whose internals differ: let the child try
            logger.debug("Triton cache lookup failed for %s.%s", s["module"], s["name"], exc_info=True)
        todo.append(s)
    n = min(max_workers, len(todo), max(1, os.cpu_count() or 1))
    stats = {"recorded": len(specs), "cached": cached, "compiled": 0, "failed": 0, "workers": n, "seconds": 0.0}
    payload = {"path": [p for p in sys.path if p], "target": [target.backend, target.arch, target.warp_size]}
    running = Compiling(stats, [], t0)
    try:
        for i in range(n):
            share = todo[i::n]  # round robin: each kernel's variants spread over the children
            err = tempfile.TemporaryFile()
            try:
                p = subprocess.Popen([sys.executable, "-c", "from rlserve.engine.worker.triton_precompile import "
                                      "_child_main; _child_main()"],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err,
                                     env=dict(os.environ, PYTHONPATH=os.pathsep.join(payload["path"])))
            except BaseException:
                err.close()
                raise
            running._procs.append((p, share, err))
            p.stdin.write(json.dumps(dict(payload, specs=share)).encode())
            p.stdin.close()
    except BaseException:  # the children started so far do not outlive the failure
        running.kill()
        raise
    return running


def precompile(fn, device, max_workers: int = MAX_WORKERS, wait: bool = True):
    """:func:`record` ``fn`` and :func:`compile_specs` what it needs for ``device`` (a CUDA device).

    Returns:
        ``wait``: the stats (also logged) once the children are done; else the running
        :class:`Compiling`. None without Triton, or when anything failed (logged; the caller's real
        warm-up then compiles as before).
    """
    import importlib.util

    if importlib.util.find_spec("triton") is None:  # nothing to compile (the torch attention backend)
        return None
    try:
        from triton.backends.compiler import GPUTarget
        from triton.runtime.driver import driver

        t = driver.active.get_current_target()
        target = GPUTarget(t.backend, t.arch, t.warp_size)
        t0 = time.perf_counter()
        specs = record(fn)
        t_rec = time.perf_counter() - t0
        running = compile_specs(specs, target, max_workers=max_workers)
        running.stats["record_seconds"] = t_rec
        return running.wait() if wait else running
    except Exception:  # noqa: BLE001 -- start-up must not fail here: the warm-up compiles instead
        logger.warning("Triton precompile failed; the warm-up compiles its kernels one by one", exc_info=True)
        return None


def _child_main() -> None:
    """Child process: read ``{"path", "target", "specs"}`` (JSON) from stdin and compile each spec
    into Triton's on-disk cache; exit 1 if any failed (the others are still cached)."""
    payload = json.loads(sys.stdin.read())
    sys.path[:0] = [p for p in payload["path"] if p not in sys.path]
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as triton_compile

    target = GPUTarget(*payload["target"])
    failed = 0
    for s in payload["specs"]:
        try:
            src, options = _decode(_kernel(s["module"], s["name"]), s["data"], target)
            triton_compile(src, target=target, options=options.__dict__)
        except Exception as e:  # noqa: BLE001 -- report, go on with the others
            failed += 1
            print(f"{s['module']}.{s['name']}: {type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(1 if failed else 0)
