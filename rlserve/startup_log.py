"""Start-up phase lines: where the seconds of ``rlserve serve``'s start go, one INFO line per phase in
each process (API, engine core), in vLLM's style ("Loading weights took 1.23 seconds")::

    start-up: engine-core imports took 3.10 s (process age 3.41 s, CPU 2.95 s)

``process age`` is the seconds since *this* process started (the kernel's start time in
``/proc/self/stat``, 10 ms ticks), so lines of two processes compare to each other through their
log timestamps and each says how far into its own process it came; ``CPU`` is the CPU seconds the
process has used so far (all its threads, ``time.process_time``): far below its age, the process waited
(on the disk, another process, a lock) rather than computed. ``benchmarks/startup_stop.py
--show-start-log`` prints them with the seconds since ``rlserve serve`` was started.
"""

from __future__ import annotations

import logging
import os
import time

_IMPORTED = time.monotonic()


def process_age() -> float:
    """Seconds since this process started: ``CLOCK_BOOTTIME`` minus the process's start time in
    ``/proc/self/stat`` (field 22, in ``SC_CLK_TCK`` ticks: 10 ms resolution). Where there is no
    ``/proc`` (not Linux): the seconds since this module was first imported."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic() - _IMPORTED


def log_phase(logger: logging.Logger, what: str, seconds: float, detail: str = "") -> None:
    """One INFO line ``start-up: WHAT took S s (DETAIL; process age A s, CPU C s)``."""
    more = f"{detail}; " if detail else ""
    logger.info("start-up: %s took %.2f s (%sprocess age %.2f s, CPU %.2f s)", what, seconds, more, process_age(),
                time.process_time())


class Phases:
    """Times consecutive phases of one start-up: ``mark("name")`` logs the seconds since the last
    mark (or since construction) with :func:`log_phase` and returns them."""

    def __init__(self, logger: logging.Logger):
        self.logger = logger
        self.t = time.perf_counter()

    def mark(self, what: str, detail: str = "") -> float:
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        log_phase(self.logger, what, dt, detail)
        return dt


def uncached_bytecode(packages=("torch", "triton", "transformers", "sympy")) -> list[str]:
    """The imported ``packages`` whose ``__init__`` has no cached bytecode (``.pyc``, where
    ``importlib.util.cache_from_source`` puts it, ``PYTHONPYCACHEPREFIX`` honoured) that this process
    could not write either (``PYTHONDONTWRITEBYTECODE`` set, or a read-only directory): every start of
    every process compiles their Python sources again. On session 21's H100 machine torch, triton and
    sympy were such (a venv installed without bytecode and ``PYTHONDONTWRITEBYTECODE=1``): the engine
    core's imports took 12.8 s of CPU there; on the 2-core CPU machine compiling every module made the
    same imports ~2.4x slower (BENCHMARKS.md, start-up, T12)."""
    import importlib.util
    import sys

    out = []
    for name in packages:
        f = getattr(sys.modules.get(name), "__file__", None) or ""
        if not f.endswith(".py"):
            continue
        cached = importlib.util.cache_from_source(f)
        if os.path.exists(cached):
            continue
        where = os.path.dirname(cached)
        writable = os.access(where if os.path.isdir(where) else os.path.dirname(f), os.W_OK)
        if sys.dont_write_bytecode or not writable:
            out.append(name)
    return out
