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

Re-measured on a quieter 2-core Zen 5 machine (AVX-512; load 1-5 from other sessions;
BENCHMARKS.md, issue 22, ninth session), one process per setting, alternating: a batch-64
decode step took 222-278 ms of wall time with 1 thread and 133-147 ms with 2 whenever the
other work paused, but 183-859 ms with 2 when it ran; a 1,024-token prefill step 1.32-1.48 s
with 1 thread, 0.75-0.87 s with 2, and 4.3-4.5 s with 2 at load ~3.5. Shorter spinning
(``GOMP_SPINCOUNT=10000``) kept the good cases and still lost at load 3.6 (batch 1: 117 ms
against 26-28 ms with 1 thread); ``OMP_WAIT_POLICY=passive`` never spins but fell to
1-thread speed or below under load. In the server beside vLLM CPU, 2 threads with
``GOMP_SPINCOUNT=10000`` gave 113.6 and 349.3 tok/s in two rounds of the issue's 64-request
workload against 201.7 and 226.6 for 1 thread. Two threads win only while nothing else
wants a core, and lose up to 6x when something does: the default stays 1 on 2 cores. The
second core pays without a barrier per operation: :mod:`rlserve.engine.cpu.cpu_microbatch` (the
default there since the tenth session) runs each step as two micro-batches of whole
sequences on two one-thread threads joined once per step, and ``--data-parallel-size 2`` (two
engine-core processes of one thread each, no barrier between them) gave 292-369 tok/s in
six of seven rounds of the same workload against 206-246 for one engine in the same rounds
(1.2-1.8x vLLM CPU's), and 189.5 against 187.4 in a round under other load (not the
default: two copies of the weights, each replica with its own KV cache and prefix cache).

So the default follows vLLM's CPU backend, which binds one OpenMP thread per core and keeps
a core for its API server process: intra-op threads = usable CPUs (this process's affinity
mask) minus ``RLSERVE_CPU_RESERVED_CPUS`` (default 1; 0 on a 1-CPU machine), divided among
the engine ranks sharing the machine (tensor-parallel ranks x data-parallel replicas), at
least 1. On 2 cores that is 1 thread: the forward pass on one core, the HTTP server, the
engine's Python and the rest of the machine on the other, and no barrier ever waits for a
preempted sibling. Threads are not pinned to cores: on a machine shared with other work a
pinned thread cannot move off a core that something else is using, and the scheduler keeps
an unpinned busy thread on its core anyway. Pinning is available, off by default
(:func:`bind_engine_thread`, ``RLSERVE_CPU_OMP_THREADS_BIND``): measured beside vLLM's pinned
worker on the shared 2-core machine it did not give the engine a larger share of the CPU
(BENCHMARKS.md, issue 22, seventh session). The CPU team's threads (the engine thread and its
workers, :mod:`rlserve.layers.cpu_gemm`) are another matter: two threads of one step, woken
unpinned on a busy machine, were queued on one core (``RLSERVE_CPU_TEAM_BIND``, off by default:
``1`` pins them apart, ``avoid`` keeps the workers off the engine thread's CPU;
:func:`rlserve.layers.cpu_gemm.bind`, :func:`~rlserve.layers.cpu_gemm.avoid`; BENCHMARKS.md, issue 37, s20).

Overrides, first match wins: ``config.extra["cpu_threads"]``, ``RLSERVE_CPU_THREADS``, and
``OMP_NUM_THREADS`` when the user set it (torch reads it too). The choice is made by
:func:`configure_engine_threads`, which the engine calls in the thread (and process) that
runs the forward passes: torch's thread count is per calling thread under OpenMP, so it
must be set where the engine runs, whether that is an engine thread of the server process
or an engine process of its own.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile

import torch

from rlserve import envs
from rlserve.envs import int_at_least

logger = logging.getLogger(__name__)


_held_locks: list = []  # open lock files of the CPUs this process claimed (released when it exits)
_bind_allowed = False  # set by the processes that exist only to run an engine (allow_binding)


def allow_binding() -> None:
    """Let :func:`configure_engine_threads` pin this process's engine thread. Called by the
    engine-core process (``rlserve.engine.core.core_proc``), whose main thread runs the forward
    passes and starts nothing else; not by an offline ``LLM`` or an engine thread inside
    another program, where a pinned thread would narrow that program's own work (and the
    affinity of every process it starts afterwards) to the engine's cores."""
    global _bind_allowed
    _bind_allowed = True


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def engine_ranks(config=None) -> int:
    """Engine ranks of ``config`` sharing this machine: tensor-parallel size x data-parallel
    size (1 without a config)."""
    return (getattr(config, "tensor_parallel_size", 1) or 1) * (getattr(config, "data_parallel_size", 1) or 1)


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
        return int_at_least(extra["cpu_threads"], 'extra["cpu_threads"]', 1)
    if envs.RLSERVE_CPU_THREADS is not None:
        return envs.RLSERVE_CPU_THREADS
    if os.environ.get("OMP_NUM_THREADS"):
        return int_at_least(os.environ["OMP_NUM_THREADS"], "OMP_NUM_THREADS", 1)
    if ranks is None:
        ranks = engine_ranks(config)
    cpus = usable_cpus()
    reserved = envs.RLSERVE_CPU_RESERVED_CPUS
    if reserved is None:
        reserved = 1 if cpus > 1 else 0
    return max(1, (cpus - reserved) // max(1, ranks))


def engine_team_size(config=None, ranks: int | None = None, threads: int = 1) -> int:
    """The size of the CPU team (:mod:`rlserve.layers.cpu_gemm`) a CPU engine starts; 1 means
    no team. First match wins: ``config.extra["cpu_team"]``, ``RLSERVE_CPU_TEAM``, 1 when the
    engine runs ``threads`` > 1 torch threads (OpenMP shares the work then), else the usable
    CPUs divided among the engine ranks (``ranks``, default TP x DP of ``config``) when that
    leaves at least 2, else 1.

    Raises:
        ValueError: an ``extra["cpu_team"]`` that is not an integer >= 1.
    """
    extra = getattr(config, "extra", None) or {}
    if extra.get("cpu_team") is not None:
        return int_at_least(extra["cpu_team"], 'extra["cpu_team"]', 1)
    if envs.RLSERVE_CPU_TEAM is not None:
        return envs.RLSERVE_CPU_TEAM
    if threads > 1:  # torch's own threads asked for: OpenMP does the sharing
        return 1
    if ranks is None:
        ranks = engine_ranks(config)
    n = usable_cpus() // max(1, ranks)
    return n if n >= 2 else 1


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,6"`` -> ``[0, 1, 2, 3, 6]``. Raises ValueError on anything else."""
    cpus: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"RLSERVE_CPU_OMP_THREADS_BIND: not a CPU list: {text!r} (e.g. 0-3,6)")
        cpus += range(int(lo), int(hi or lo) + 1)
    return cpus


def _claim_cpus(n: int, lock_dir: str | None = None) -> list[int]:
    """Claim ``n`` of this process's usable CPUs that no other rlserve engine on the machine
    has claimed (one ``flock``-ed file per CPU in ``<tmp>/rlserve-cpu-bind``, held until this
    process exits), highest numbers first (CPU 0 is where vLLM's CPU worker binds by
    default); [] (and nothing held) when fewer than ``n`` are free."""
    lock_dir = lock_dir or os.path.join(tempfile.gettempdir(), "rlserve-cpu-bind")
    os.makedirs(lock_dir, exist_ok=True)
    got: list[tuple[int, object]] = []
    for cpu in sorted(os.sched_getaffinity(0), reverse=True):
        f = open(os.path.join(lock_dir, f"{cpu}.lock"), "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            continue
        got.append((cpu, f))
        if len(got) == n:
            _held_locks.extend(f for _, f in got)
            return [c for c, _ in got]
    for _, f in got:
        f.close()
    return []


def bind_engine_thread(n: int, config=None, ranks: int | None = None) -> list[int]:
    """Pin the calling thread (the one that runs the forward passes, and the OpenMP threads
    it starts later) to ``n`` CPUs, as vLLM's CPU worker pins its OpenMP threads; returns
    the CPUs, [] where nothing was pinned.

    Which CPUs, first match wins: ``config.extra["cpu_threads_bind"]``, then
    ``RLSERVE_CPU_OMP_THREADS_BIND`` (vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` values):
    ``"nobind"`` (the default), an explicit list (``"0-3,6"``), or ``"auto"``: ``n`` CPUs (the engine's
    torch threads or its CPU team, whichever is larger: :func:`configure_engine_threads`) of
    this process's affinity mask that no other rlserve engine on the machine holds (a lock
    file per CPU, released at exit), highest first, so that two servers on one machine never
    share a core; nothing is pinned when none are free, with several engine ranks in this
    process group (``ranks`` > 1), or where the OS has no ``sched_setaffinity``.

    Off by default because it did not pay where measured: on the shared 2-core CI machine,
    next to vLLM CPU (whose worker is pinned to CPU 0), the engine pinned to CPU 1 got
    0.61-0.74 of a core over 64-request runs against 0.48-0.72 unpinned, and pinned to CPU 0
    0.33-0.38 against 0.48-0.55 unpinned in the same alternation (BENCHMARKS.md, issue 22,
    seventh session); a pinned engine also cannot move off a core that other work, or
    another pinned program, is using.

    Raises:
        ValueError: a malformed CPU list.
    """
    extra = getattr(config, "extra", None) or {}
    mode = str(extra.get("cpu_threads_bind") or envs.RLSERVE_CPU_OMP_THREADS_BIND).strip()
    if mode == "nobind" or not hasattr(os, "sched_setaffinity"):
        return []
    if mode == "auto":
        if ranks is None:
            ranks = engine_ranks(config)
        cpus = _claim_cpus(n) if ranks == 1 else []
    else:
        cpus = parse_cpu_list(mode)
    if cpus:
        os.sched_setaffinity(0, cpus)  # Linux: the calling thread only
    return cpus


def configure_engine_threads(config=None, ranks: int | None = None, bind: bool | None = None) -> int:
    """Set torch's intra-op threads for the engine running in the calling thread (CPU
    engines only: call it from the thread that will run the forward passes, before the
    first one), start the engine's CPU team (:mod:`rlserve.layers.cpu_gemm`: current in this
    thread from now on, :func:`rlserve.layers.cpu_gemm.current`; it must start before the model
    loads, whose weight loading packs the team's copies) and, with ``bind`` (default: whether :func:`allow_binding` was called in this
    process), pin that thread to as many CPUs (:func:`bind_engine_thread`), or, where that
    pinned nothing and ``RLSERVE_CPU_TEAM_BIND`` is ``1`` (default ``0``), the team's threads one
    per CPU (:func:`rlserve.layers.cpu_gemm.bind`) on CPUs this process claims (:func:`_claim_cpus`:
    no other rlserve engine on the machine holds them; none pinned where one does), or with
    ``avoid`` the workers kept off the engine thread's CPU (:func:`rlserve.layers.cpu_gemm.avoid`).
    Returns the thread count set."""
    n = engine_cpu_threads(config, ranks)
    # ``auto`` claims as many CPUs as the engine will run threads on: its torch threads, or its CPU team,
    # sized here on this process's mask (sized after the pin, on one claimed CPU, the team was 1); the
    # team starts below, after the pin, so its threads inherit the bound CPUs. Where other engines hold
    # too many for the team, the torch threads' CPUs (the team, sized after the pin, shrinks to them)
    want = max(n, engine_team_size(config, ranks, threads=n))
    cpus = []
    if _bind_allowed if bind is None else bind:
        cpus = bind_engine_thread(want, config, ranks) or (bind_engine_thread(n, config, ranks) if want > n else [])
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    from rlserve.layers import cpu_gemm

    team = cpu_gemm.start(engine_team_size(config, ranks, threads=n))
    pinned: list[int] = []
    allowed = team.size >= 2 and not cpus and (_bind_allowed if bind is None else bind)
    mode = envs.RLSERVE_CPU_TEAM_BIND if allowed else "0"
    if mode == "1":
        claimed = _claim_cpus(team.size)  # none where another rlserve engine holds one of them
        pinned = cpu_gemm.bind(team, claimed) if claimed else []
    elif mode == "avoid":
        cpu_gemm.avoid(team)
    placed = (f", pinned (RLSERVE_CPU_TEAM_BIND): engine thread on CPU {pinned[0]} in team steps, workers on "
              f"{pinned[1:]}" if pinned else
              ", workers kept off the engine thread's CPU (RLSERVE_CPU_TEAM_BIND=avoid)" if team.avoid else "")
    logger.info("CPU engine: %d intra-op thread(s) (%d usable CPUs), %s; CPU team of %d thread(s) for linears and "
                "decode attention%s", n, usable_cpus(), f"bound to CPUs {cpus}" if cpus else "not bound", team.size,
                placed)
    return n
