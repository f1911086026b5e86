"""The CPU team: float32 linears and decode attention shared by the engine's cores without
OpenMP barriers (the C code in ``csrc/cpu_team.c``; see its header for the scheme).

A CPU engine on a 2-core machine runs its forward pass on one torch thread
(:mod:`rlserve.engine.cpu.cpu_threads`): OpenMP's second thread ends every parallel region at a
barrier that waits for it, and the step stalls whenever something else preempts it. The team
is the calling thread plus ``size - 1`` persistent C worker threads; each operation is cut
into chunks (32-column panels of a linear's output, sequences of a decode attention) that
whichever thread comes first claims, so a preempted worker only ever delays a chunk it has
already started, and the caller does the rest. A decode step's linears then read half of the
weights on each of 2 cores.

Linears run on a copy of the weight packed in panels of 16 output columns (:func:`pack`,
``[ceil(N / 32), K, 32]``, rebuilt by ``process_weights_after_loading`` after every weight load, as the oneDNN copy of
:mod:`rlserve.layers.cpu_linear` it replaces). Each output element is one sequential float32
fused multiply-add chain over the input features, bias last: bit-equal whatever the row count,
the other rows of the call, the chunking or the thread (batch-invariant), and equal to
``F.linear`` up to summation order.

Team size: :func:`rlserve.engine.cpu.cpu_threads.engine_team_size` (the usable CPUs per engine
rank; ``RLSERVE_CPU_TEAM=1`` turns it off: the previous oneDNN / micro-batch path). The worker
threads are the process's; the size and the contention guard are each engine's own
(:class:`Team`): an engine's worker makes its team current around every step (:func:`use`), and
each C call passes how many threads it may use, so two engines in one process (offline ``LLM``
objects, tests) do not share a size or a back-off.
Workers spin ``RLSERVE_CPU_TEAM_SPIN_US`` (default 200) microseconds after an operation
before they sleep: a decode step's next operation follows within tens of microseconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import time

import torch

from rlserve import envs
from rlserve.layers import cpu_hugepages
from rlserve.layers.cpu_build import load_library

logger = logging.getLogger(__name__)

PANEL = 32  # output columns per packed panel (csrc/cpu_team_gemm.c: PW)
DEFAULT_SPIN_US = 200
# Steps of at most this many token rows run their linears on the team (column panels over the
# cores: every step up to twice the CPU's default --max-num-batched-tokens, a 2,048-token prompt
# that runs alone in one step included); larger ones run MKL's linears, split into micro-batches
# of whole sequences (rlserve.engine.cpu.cpu_microbatch: one sequence's step on one thread). One thread,
# CPU time, SmolLM2's 30 layers + head from memory (2026-12-06, load 13-38): this kernel / oneDNN
# 46 / 71 ms at 1 row, 70 / 83 at 16, 93 / 106 at 32, 166 / 172 at 64, 260 / 250 at 128, 533 /
# 509 at 256, 1,065 / 1,546 at 512. 1,024 until session 19: a 2,048-token prompt's prefill step
# (SmolLM2-135M, AMD EPYC Zen 3, SCHED_FIFO, load 21-35) took 9.4 s wall on one core that way,
# 4.6 s on the team with the prefill's query tiles (BENCHMARKS.md, issue 37, s19).
MAX_ROWS = 2048
# Contention guard (step_guard): a team step that averaged fewer busy cores than this (the
# calling thread's and the workers' CPU time over its wall time; ~2 on an idle 2-core machine,
# the spinning worker included) lost: another program held a core, and under the kernel's
# per-session fair share (autogroup) the team's threads then only split one share between them.
# The next `backoff` steps of its kind (GUARD_KINDS) run inline on the calling thread (no
# spinning, no waiting on a preempted worker's chunk), backoff doubling on repeated losses, as
# the micro-batches' guard.
MIN_CORES = 1.3
# Whether the workers' spin for the next operation (csrc/cpu_team.c's spin counter, wall ns) counts
# as busy CPU in the guard's measure (True, the default); False: the workers' CPU less their spin
# (at least 0) -- "a spin the guard does not count" of issue 37 (s20); measured in s22 with
# benchmarks/cpu_team_spin.py --guarded SPIN --spin-not-busy (BENCHMARKS.md, "Issue 37 (s22)").
SPIN_IS_BUSY = True
MIN_BACKOFF, MAX_BACKOFF = 4, 64

_lock = threading.Lock()
_state: dict = {}

_P, _I = ctypes.c_void_p, ctypes.c_int64


def _lib():
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                lib = load_library("cpu_team.c")
                if lib is not None:
                    lib.rlserve_team_start.argtypes = [ctypes.c_int, ctypes.c_int]
                    lib.rlserve_team_start.restype = ctypes.c_int
                    lib.rlserve_team_size.argtypes = []
                    lib.rlserve_team_size.restype = ctypes.c_int
                    lib.rlserve_gemm_f32.argtypes = [_P] * 4 + [_I] * 6 + [ctypes.c_int]
                    lib.rlserve_gemm_f32.restype = ctypes.c_int
                    for name in ("rlserve_team_paged_decode_f32", "rlserve_team_paged_prefill_f32"):
                        getattr(lib, name).argtypes = [_P] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]
                        getattr(lib, name).restype = ctypes.c_int
                    lib.rlserve_team_pin_workers.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
                    lib.rlserve_team_pin_workers.restype = ctypes.c_int
                    lib.rlserve_team_avoid_cpu.argtypes = [ctypes.c_int]
                    lib.rlserve_team_avoid_cpu.restype = ctypes.c_int
                    lib.rlserve_team_worker_cpu_ns.argtypes = []
                    lib.rlserve_team_worker_cpu_ns.restype = ctypes.c_int64
                    lib.rlserve_team_stats.argtypes = [_P]
                    lib.rlserve_team_stats.restype = None
                    lib.rlserve_team_decode_stack_f32.argtypes = ([_P] * 4 + [ctypes.c_int] + [_P] * 3 + [_I] * 2
                                                                  + [_P] * 4 + [ctypes.c_int] * 5)
                    lib.rlserve_team_decode_stack_f32.restype = ctypes.c_int
                _state["lib"] = lib
    return _state["lib"]


class _Backoff:
    """The contention guard's state for one kind of step: ``skip`` guarded steps left to run
    inline, ``backoff`` the next loss's ``skip``; with ``every_step`` the skip counts down on
    every guarded step of the team, whatever its kind."""

    def __init__(self, every_step: bool = False):
        self.skip = 0
        self.backoff = MIN_BACKOFF
        self.every_step = every_step


# Kinds of guarded step, each backing off on its own losses only (step_guard): "decode", a pure
# decode step on the fast path (llama_cpu.stack_forward: the team runs nearly all of it), and
# "other", a prefill or mixed step on the module path (the team runs its linears; attention and
# norms run on the calling thread), whose back-off counts down on every guarded step (a
# single stream's next prefill comes 60+ decode steps later; a prefill loss on an idle machine
# is a passing disturbance). Before s17 one state served both: a prefill's loss sent the next
# decode steps inline, a decode step's loss the next prefill. Quiet machine emulated (the
# servers' and the client's threads SCHED_FIFO, 2026-12-06 s17, SmolLM2-135M): a batch-1
# decode step 22.9 ms on the team against 40.5 inline, a 128-token prefill 173 against 257.
GUARD_KINDS = ("decode", "other")


class Team:
    """One engine's use of the process's CPU team: its ``size`` (threads per operation, 1: no
    team) and its contention guard's state (see :data:`MIN_CORES`), per kind of step
    (:data:`GUARD_KINDS`)."""

    def __init__(self, size: int):
        self.size = size
        self.guards = {k: _Backoff(every_step=k == "other") for k in GUARD_KINDS}
        self.steps = self.lost = self.inline = 0
        self.logged = False  # the first fallback is logged (info), later ones counted only
        self.skip_active = False  # set for the length of a backed-off (inline) step
        self.bind = None  # (engine thread's CPU, the thread's mask to restore) while pinned (bind)
        self.avoid = False  # keep the workers off the engine thread's CPU before each team step (avoid)

    def threads_now(self) -> int:
        """Threads a team call may use now: 1 while the guard backs off, else ``size``."""
        return 1 if self.skip_active else self.size


_NO_TEAM = Team(1)
_local = threading.local()


def start(size: int) -> Team:
    """Start the process's ``size - 1`` worker threads (once; a later call with a larger size
    adds workers) and return a new :class:`Team` of that size, made current in the calling
    thread and the process default (for threads that never :func:`use` one: the engine built
    last); ``size`` 1 gives a team of 1 (the workers stay, asleep). The size is 1 where the
    library is missing or packed linears are off (``RLSERVE_CPU_PACKED_LINEAR=0``)."""
    lib = _lib() if size >= 2 else None
    if lib is None or not envs.RLSERVE_CPU_PACKED_LINEAR:
        n = 1
    else:
        spin = envs.RLSERVE_CPU_TEAM_SPIN_US
        n = min(size, lib.rlserve_team_start(size - 1, DEFAULT_SPIN_US if spin is None else spin))
    team = Team(n)
    _state["default"] = team
    _local.team = team
    return team


try:
    _sched_getcpu = ctypes.CDLL(None).sched_getcpu  # glibc; the CPU the calling thread runs on
    _sched_getcpu.restype = ctypes.c_int
except (OSError, AttributeError):
    _sched_getcpu = None


def avoid(team: Team) -> bool:
    """``RLSERVE_CPU_TEAM_BIND=avoid`` (engine-core processes only): before each team step
    (:func:`step_guard`), the process's workers are kept off the CPU the engine thread runs on then
    (their mask: the engine thread's less that CPU; a syscall per worker only when it changed),
    the engine thread itself left free: the same aim as :func:`bind` without pinning the engine
    thread. Returns whether it applies (a team of 2+, the library, ``sched_getcpu``)."""
    team.avoid = team.size >= 2 and _lib() is not None and _sched_getcpu is not None
    return team.avoid


def _set_affinity(cpus) -> bool:
    try:
        os.sched_setaffinity(0, cpus)  # Linux: the calling thread only
        return True
    except OSError:
        return False


def bind(team: Team, cpus: list[int]) -> list[int]:
    """Pin ``team``'s threads one per CPU of ``cpus`` (``RLSERVE_CPU_TEAM_BIND``, engine-core
    processes only, on CPUs no other rlserve engine of the machine holds:
    :func:`rlserve.engine.cpu.cpu_threads.configure_engine_threads`): worker i to ``cpus[i + 1]``
    for good, and the calling (engine) thread to ``cpus[0]`` for the length of each team step
    (:func:`step_guard`; steps the guard runs inline, and whatever the thread does between steps,
    keep its whole mask, as do threads it starts then). Unpinned, the worker ran or waited on the
    engine thread's core in 35 of 46 samples of a closed loop (2026-12-07 s20, the 2-core AMD EPYC
    at load ~29, autogroup nice -10): the team then shares one core and the guard sends the next
    steps inline. The workers are the process's: every engine of the process shares them. Returns
    the CPUs ``[engine thread, worker 0, ...]``, ``[]`` where nothing was pinned (a team of 1,
    fewer ``cpus`` than the team's threads, no library, no ``sched_setaffinity``, a refused pin)."""
    lib = _lib()
    if team.size < 2 or lib is None or len(cpus) < team.size or not hasattr(os, "sched_setaffinity"):
        return []
    workers = [int(c) for c in cpus[1:team.size]]
    if lib.rlserve_team_pin_workers((ctypes.c_int * len(workers))(*workers), len(workers)) != len(workers):
        lib.rlserve_team_pin_workers((ctypes.c_int * len(workers))(*([-1] * len(workers))), len(workers))
        return []
    team.bind = (int(cpus[0]), tuple(sorted(os.sched_getaffinity(0))))
    return [int(cpus[0]), *workers]


def current() -> Team:
    """The calling thread's team (:func:`use`, else the one :func:`start` made there), else the
    process default (the last started), else a team of 1."""
    return getattr(_local, "team", None) or _state.get("default") or _NO_TEAM


@contextlib.contextmanager
def use(team: Team | None):
    """Make ``team`` current in this thread for the block (``None``: leave it as it is)."""
    if team is None:
        yield
        return
    prev = getattr(_local, "team", None)
    _local.team = team
    try:
        yield
    finally:
        _local.team = prev


def size() -> int:
    """The current team's size (1: no team)."""
    return current().size


def active() -> bool:
    """Whether the current team has 2 or more threads (linears and attention use it)."""
    return current().size >= 2


def available() -> bool:
    """Whether the kernels load and packed linears are on (``RLSERVE_CPU_PACKED_LINEAR``)."""
    return envs.RLSERVE_CPU_PACKED_LINEAR and _lib() is not None


def pack(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """``weight [N, K]`` (float32, CPU) -> ``[ceil(N / 32), K, 32]`` panels (zero rows pad N),
    or ``None`` where the kernels do not apply (another dtype or device, not 2-D, no library).
    The copy does not follow later writes to ``weight``: pack again after every load.

    ``out``: an earlier pack of a weight of this shape (contiguous ``[P, K, 32]`` float32 on the
    CPU): written in place and returned (the same bits as a fresh pack), so a weight sync's
    repack writes memory that is already mapped. A fresh pack is new memory each time (glibc
    maps allocations this large anew: SmolLM2's 210 linears, 425 MB, repacked in 0.48-0.61 s
    of CPU fresh vs 0.16-0.21 s in place, one thread, the loaded 2-core machine). Any other
    ``out`` is ignored (a fresh pack, from :func:`rlserve.layers.cpu_hugepages.empty`: on 2 MiB
    pages with ``RLSERVE_CPU_HUGEPAGES=1``)."""
    if (weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2 or not available()):
        return None
    N, K = weight.shape
    P = -(-N // PANEL)
    w = weight.detach()
    if out is None or out.device.type != "cpu" or out.dtype != torch.float32 or \
            tuple(out.shape) != (P, K, PANEL) or not out.is_contiguous():
        out = cpu_hugepages.empty((P, K, PANEL), torch.float32)
    full = N // PANEL
    if full:
        out[:full].copy_(w[: full * PANEL].reshape(full, PANEL, K).transpose(1, 2))
    if P > full:  # the last panel: its rows past N are zero
        tail = w.new_zeros(PANEL, K)
        tail[: N - full * PANEL] = w[full * PANEL:]
        out[full:].copy_(tail.reshape(1, PANEL, K).transpose(1, 2))
    return out


def linear(x: torch.Tensor, packed: torch.Tensor, n_out: int, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T + bias`` -> ``[M, n_out]`` float32 on the team, ``packed`` = :func:`pack` of
    ``W [n_out, K]``. ``x`` float32 CPU with unit column stride (any row stride); ``bias`` ``[n_out]``
    contiguous float32 or ``None``; ``out``: a contiguous ``[M, n_out]`` float32 to write, or None.
    Runs on the current team's threads (:func:`current`; the calling thread alone while its guard
    backs off); the bits do not depend on it.

    Raises:
        ValueError: shapes that do not match ``packed``.
    """
    M, K = x.shape
    P, Kp, _ = packed.shape
    if Kp != K or not (P - 1) * PANEL < n_out <= P * PANEL:
        raise ValueError(f"cpu_gemm.linear: x {tuple(x.shape)} does not match packed {tuple(packed.shape)} / {n_out}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty((M, n_out), dtype=torch.float32)
    rc = _lib().rlserve_gemm_f32(x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                                 out.data_ptr(), M, n_out, K, x.stride(0), out.stride(0), 0, current().threads_now())
    if rc != 0:
        raise MemoryError(f"cpu_gemm.linear: no memory for the {M} x {K} input transpose") if rc == 2 else \
            ValueError(f"cpu_gemm.linear: sizes refused: x {tuple(x.shape)}, out {tuple(out.shape)}")
    return out


def paged_decode_call(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, out: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                      scale: float, prefill: bool = False) -> int:
    """:func:`rlserve.layers.cpu_attention.call`'s kernel with one sequence per team chunk;
    same arguments (no ``nthreads``: the current team's threads), layouts and return code
    (unchecked, as there). ``prefill``: rows as per-query tables of prompt tokens
    (:func:`rlserve.batch_invariant.per_query.per_query_tables`), computed by causal query tiles
    (``csrc/paged_prefill.c``; not the decode kernel's bits; 3: no memory for the tile list)."""
    fn = _lib().rlserve_team_paged_prefill_f32 if prefill else _lib().rlserve_team_paged_decode_f32
    return fn(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
        out.data_ptr(), q.shape[0], num_heads, num_kv_heads, head_dim, k_cache.shape[1], block_tables.shape[1],
        float(scale), current().threads_now())


def decode_stack_call(fns: int, ptrs: torch.Tensor, ints: torch.Tensor, flts: torch.Tensor, x: torch.Tensor,
                      hidden_out: torch.Tensor, res_out: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, nthreads: int,
                      prefill: bool = False) -> int:
    """A decode step's decoder layers in one C call on the current team (``csrc/cpu_stack.c``,
    whose header gives the layouts): ``fns`` the address of 3 function pointers (cpu_fused.c's
    RMSNorm, SiLU-and-mul, q/k-norm + rotary + KV write); ``ptrs`` ``[L, 16]`` int64 addresses,
    ``ints`` ``[L, 6]`` int64, ``flts`` ``[L, 4]`` float32 per layer; ``x``, ``hidden_out``,
    ``res_out`` ``[T, hidden]`` contiguous float32; ``pos``, ``slots`` ``[T]`` int64;
    ``block_tables`` ``[T, max_blocks]``, ``seq_lens`` ``[T]`` int32, all contiguous; ``prefill``: the
    attention by causal query tiles (:func:`paged_decode_call`'s ``prefill``). Returns the C
    code: 0 done, 1 shapes the attention kernel does not take (nothing computed), 2 no memory.
    Unchecked beyond that, as the kernels' other callers: wrong layouts read out of bounds."""
    return _lib().rlserve_team_decode_stack_f32(
        fns, ptrs.data_ptr(), ints.data_ptr(), flts.data_ptr(), ptrs.shape[0], x.data_ptr(), hidden_out.data_ptr(),
        res_out.data_ptr(), x.shape[0], x.shape[1], pos.data_ptr(), slots.data_ptr(), block_tables.data_ptr(),
        seq_lens.data_ptr(), block_size, block_tables.shape[1], nthreads, current().threads_now(), int(prefill))


def takes(x: torch.Tensor) -> bool:
    """Whether a linear of ``x`` runs on the team: a team runs in this process and ``x`` is a 2-D
    float32 CPU tensor of 1..:data:`MAX_ROWS` rows. (``--batch-invariant`` runs this kernel at every
    row count: its layers ask :mod:`rlserve.batch_invariant` first.)"""
    if current().size < 2 or x.dim() != 2 or not 0 < x.shape[0] <= MAX_ROWS:
        return False
    return x.dtype == torch.float32 and x.device.type == "cpu"


def team_weight(layer) -> torch.Tensor | None:
    """``layer``'s packed copy for the team (:func:`pack`), or ``None`` (no team at load time)."""
    return layer.__dict__.get("_cpu_team_weight")


def build_team_weight(layer, weight: torch.Tensor) -> None:
    """(Re)build ``layer``'s team copy of ``weight`` after a load: :func:`pack` when the layer's
    first load ran under a team of 2 or more (:func:`active` then: the engine being built),
    else none (nothing kept). Later loads (weight syncs, from whatever thread) follow the first."""
    on = layer.__dict__.get("_cpu_team_on")
    if on is None:
        on = layer.__dict__["_cpu_team_on"] = active()
    # repacked into the layer's current copy (in place: generation is paused, or the commit runs
    # between engine steps, whenever weights load)
    layer.__dict__["_cpu_team_weight"] = pack(weight, out=layer.__dict__.get("_cpu_team_weight")) if on else None


def sync_stats() -> dict:
    """The process's team counters since it loaded the library (``csrc/cpu_team.c``:
    ``rlserve_team_stats``): ``jobs`` (team operations that ran on the team), ``wait_ns`` (ns the
    calling threads waited at an operation's end for chunks a worker still ran), ``spin_ns`` (ns
    the workers spun for the next operation, futex sleeps not counted) and ``sleeps`` (the
    workers' futex sleeps). All 0 without the library. Read them before and after a workload
    (benchmarks/cpu_team_spin.py)."""
    lib = _lib()
    out = (ctypes.c_int64 * 4)()
    if lib is not None:
        lib.rlserve_team_stats(out)
    return dict(zip(("jobs", "wait_ns", "spin_ns", "sleeps"), out))


def guard_stats(team: Team | None = None) -> dict:
    """The contention guard's counts of ``team`` (default: the current one): ``steps``
    measured, ``lost`` among them, ``inline`` steps run on the calling thread while backing off."""
    t = team or current()
    return {"steps": t.steps, "lost": t.lost, "inline": t.inline}


@contextlib.contextmanager
def step_guard(kind: str = "decode"):
    """Run one step of the current team (:func:`current`) under its contention guard (see
    :data:`MIN_CORES`) for steps of ``kind`` (one of :data:`GUARD_KINDS`). A losing step makes
    this team's steps of that kind run inline for its next ``backoff`` guarded steps of that kind
    ("other": of any kind) (every team operation on the calling thread, the LM head included);
    otherwise the step's wall time and the team's CPU
    time are measured. The team's first fallback is logged at info (later ones only counted:
    :func:`guard_stats`).

    Raises:
        KeyError: an unknown ``kind``.
    """
    team = current()
    g = team.guards[kind]
    for h in team.guards.values():
        if h is not g and h.every_step and h.skip > 0:
            h.skip -= 1
    if g.skip > 0:
        g.skip -= 1
        team.inline += 1
        team.skip_active = True
        try:
            yield
        finally:
            team.skip_active = False
        return
    lib = _lib()
    pin = team.bind if team.bind is not None and _set_affinity((team.bind[0],)) else None
    if team.avoid and _sched_getcpu is not None:
        lib.rlserve_team_avoid_cpu(_sched_getcpu())
    spin0 = None if SPIN_IS_BUSY else sync_stats()["spin_ns"]
    w0, c0, k0 = time.perf_counter(), time.thread_time(), lib.rlserve_team_worker_cpu_ns()
    try:
        yield
    finally:
        if pin is not None:
            _set_affinity(pin[1])
    wall = time.perf_counter() - w0
    worker_ns = lib.rlserve_team_worker_cpu_ns() - k0
    if spin0 is not None:
        worker_ns = max(0, worker_ns - (sync_stats()["spin_ns"] - spin0))
    cpu = time.thread_time() - c0 + 1e-9 * worker_ns
    team.steps += 1
    if cpu < MIN_CORES * wall:
        team.lost += 1
        g.skip = g.backoff
        if not team.logged:
            team.logged = True
            logger.info("CPU team: a step (%s) got %.2f cores (%.1f ms CPU over %.1f ms; < %.2f: another program holds a "
                        "core): the next %d such steps run on the engine thread alone, backing off up to %d steps on "
                        "each further loss (logged once; counts: cpu_gemm.guard_stats)", kind, cpu / max(wall, 1e-9),
                        1e3 * cpu, 1e3 * wall, MIN_CORES, g.backoff, MAX_BACKOFF)
        g.backoff = min(2 * g.backoff, MAX_BACKOFF)
    else:
        g.backoff = MIN_BACKOFF
