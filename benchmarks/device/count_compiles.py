"""Run a benchmark script with every Triton JIT specialization miss counted: ``python
benchmarks/device/count_compiles.py SCRIPT ARGS...`` runs ``SCRIPT`` as ``__main__`` with
``triton.knobs.runtime.jit_cache_hook`` printing ``[jit] +SECONDS module.kernel`` on stderr for each
specialization a launch finds missing from the kernel's in-memory cache (a compile, or a load from
Triton's disk cache after the parallel precompile), and the INFO log of
``rlserve.engine.worker`` (the warm-up's seconds and the precompile's counts). The misses after the
warm-up's last log line are the compiles a serving user's first requests would pay. Recording
threads of :mod:`rlserve.engine.worker.triton_precompile` do not reach this hook (that module chains
to it only outside them)."""

from __future__ import annotations

import logging
import runpy
import sys
import time

T0 = time.perf_counter()


def _hook(**kw):
    fn = kw.get("fn")
    print(f"[jit] +{time.perf_counter() - T0:.2f} {getattr(fn, 'module', '?')}.{getattr(fn, 'name', '?')}",
          file=sys.stderr, flush=True)
    return None  # compile / load as usual


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="[log] %(asctime)s %(name)s %(message)s")
    logging.getLogger("rlserve.engine.worker").setLevel(logging.INFO)
    try:
        from triton import knobs

        knobs.runtime.jit_cache_hook = _hook
    except Exception as e:  # noqa: BLE001 -- no Triton (a CPU dry run): run uncounted
        print(f"[jit] not counted: {type(e).__name__}: {e}", file=sys.stderr)
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
