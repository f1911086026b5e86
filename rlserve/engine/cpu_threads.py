"""How many threads a CPU engine gives torch, decided in the thread that runs the engine.

A CPU rlserve server runs three kinds of work: torch's intra-op (OpenMP) threads doing the
forward pass, the engine's own Python between forward passes (scheduling, sampling,
detokenizing, outputs), and the HTTP server (parsing, tokenizing prompts, answering). torch
starts one OpenMP thread per CPU by default, so on a 2-core machine the forward pass takes
both cores and the HTTP server and any other process on the machine preempt one of its two
threads; every parallel region (several hundred per decode step) then waits at its barrier
for the thread that was preempted, and OpenMP threads spin while they wait, taking CPU from
the very threads they wait for. Measured on the 2-core CI machine under other load (issue
22, 64 concurrent requests on SmolLM2-135M): torch's 2 threads 8-12 tok/s, 1 thread 25-40
tok/s (before the native decode kernel; see BENCHMARKS.md for the current runs).

So the default follows vLLM's CPU backend, which binds one OpenMP thread per core and keeps
a core for its API server process: intra-op threads = usable CPUs (this process's affinity
mask) minus ``RLSERVE_CPU_RESERVED_CPUS`` (default 1; 0 on a 1-CPU machine), divided among
the engine ranks sharing the machine (tensor-parallel ranks x data-parallel replicas), at
least 1. On 2 cores that is 1 thread: the forward pass on one core, the HTTP server, the
engine's Python and the rest of the machine on the other, and no barrier ever waits for a
preempted sibling. Threads are not pinned to cores: on a machine shared with other work a
pinned thread cannot move off a core that something else is using, and the scheduler keeps
an unpinned busy thread on its core anyway.

Overrides, first match wins: ``config.extra["cpu_threads"]``, ``RLSERVE_CPU_THREADS``, and
``OMP_NUM_THREADS`` when the user set it (torch reads it too). The choice is made by
:func:`configure_engine_threads`, which the engine calls in the thread (and process) that
runs the forward passes: torch's thread count is per calling thread under OpenMP, so it
must be set where the engine runs, whether that is an engine thread of the server process
or an engine process of its own.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

THREADS_ENV = "RLSERVE_CPU_THREADS"
RESERVED_ENV = "RLSERVE_CPU_RESERVED_CPUS"


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _int_at_least(value, what: str, low: int) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = low - 1
    if n < low:
        raise ValueError(f"{what} must be an integer >= {low}, got {value!r}")
    return n


def engine_cpu_threads(config=None, ranks: int | None = None) -> int:
    """Intra-op threads for one CPU engine rank (see the module docstring for the rule).

    Args:
        config: the engine config (``extra["cpu_threads"]``, ``tensor_parallel_size``,
            ``data_parallel_size``), or None.
        ranks: engine ranks sharing this machine (default: TP size x DP size of ``config``).

    Raises:
        ValueError: an override that is not a positive integer (a negative reserve).
    """
    extra = getattr(config, "extra", None) or {}
    if extra.get("cpu_threads") is not None:
        return _int_at_least(extra["cpu_threads"], 'extra["cpu_threads"]', 1)
    for env in (THREADS_ENV, "OMP_NUM_THREADS"):
        if os.environ.get(env):
            return _int_at_least(os.environ[env], env, 1)
    if ranks is None:
        ranks = (getattr(config, "tensor_parallel_size", 1) or 1) * (getattr(config, "data_parallel_size", 1) or 1)
    cpus = usable_cpus()
    raw = os.environ.get(RESERVED_ENV, "")
    reserved = _int_at_least(raw, RESERVED_ENV, 0) if raw else (1 if cpus > 1 else 0)
    return max(1, (cpus - reserved) // max(1, ranks))


def configure_engine_threads(config=None, ranks: int | None = None) -> int:
    """Set torch's intra-op threads for the engine running in the calling thread (CPU
    engines only: call it from the thread that will run the forward passes, before the
    first one). Returns the thread count set."""
    n = engine_cpu_threads(config, ranks)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    logger.info("CPU engine: %d intra-op thread(s) (%d usable CPUs)", n, usable_cpus())
    return n
