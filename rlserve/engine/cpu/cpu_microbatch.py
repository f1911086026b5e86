"""CPU micro-batches: one step's sequences split over threads, with no barrier inside the step.

Why: on a 2-core machine the CPU engine runs its forward passes on one intra-op thread
(:mod:`rlserve.engine.cpu.cpu_threads`): torch's second OpenMP thread made a step 1.6-1.9x faster
while the machine was otherwise idle and up to 3-6x slower when anything else wanted a core,
because every one of the step's several hundred parallel regions ends at a barrier that waits
for the preempted thread. Sequences of a decode step are independent until sampling, so the
step can instead be cut into micro-batches of whole rows that run the *entire* layer stack
(and the LM head) each on its own thread, joined once per step. A preempted micro-batch
thread then delays only its own rows; the other thread finishes its share and sleeps in the
join (no spinning), leaving its core to whatever needs one. This is the CPU analogue of
data parallelism inside one step, sharing one copy of the weights and one KV cache (each
row writes only its own slots).

Measured (SmolLM2-135M float32, ``Worker.execute`` of one decode step, contexts 128-512,
2-core Zen 5 KVM guest, load < 0.7, one process alternating one / two micro-batches step by
step, wall ms median of 12; 2026-12-02, tenth session): batch 4 30 -> 42 (a loss: each
micro-batch streams all 538 MB of weights, and the two cores together read them only ~1.4x
as fast as one), batch 16 72 -> 59, batch 32 107 -> 80, batch 64 238 -> 140 (1.7x), batch
128 359 -> 231; logits bit-equal to one micro-batch in every case (every kernel on this path
computes a row from that row alone, with the same summation order at any row count).
Hence :data:`MIN_ROWS`: steps with fewer rows run as one micro-batch.

Contention guard: a split step did worse than a whole one would have when its wall time (the
slowest micro-batch's) exceeds the CPU time of all its micro-batches divided by
:data:`SPLIT_CPU_OVERHEAD` (a whole step on one core needs about that much: splitting costs
~25% more CPU in all, each micro-batch streaming the weights). That happens when another
program shares one micro-batch thread's core: that thread runs at half speed and the step
waits for it, while a whole step would have had a core of its own. (When the scheduler
spreads three threads evenly, each micro-batch gets 2/3 of a core and the split still wins:
the rule keeps splitting then.) After such a step the next ``backoff`` splits are skipped,
``backoff`` doubling on each repeated loss up to :data:`MAX_BACKOFF` and falling back to
:data:`MIN_BACKOFF` after a winning split: a busy machine costs at most one slowed step per
backoff period, and the split comes back within a few seconds once the machine is free.

Placement: for the length of a split the calling thread stays on its CPU and the other
micro-batch threads may use only the other CPUs (:func:`_place`). Offline, the issue-22 workload
at load 2.5-3.4 (2026-12-02): 3 and 1 losing splits with it against 24 and 2 without (the A/B
switch went with the tenth session's verdict).

Count, first match wins: ``config.extra["cpu_microbatches"]``, ``RLSERVE_CPU_MICROBATCHES``
(1 turns the split off), else 2 when the engine runs one intra-op thread, is the only engine
rank on the machine and this process may use at least 2 CPUs, otherwise 1. The model runner
makes the engine's :class:`CPUMicroBatches` current for the duration of a step
(:func:`active`); the model's CPU decode path (:mod:`rlserve.models.llama_cpu`) and the
runner's LM head ask :func:`current` for it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from typing import Callable, Sequence

import torch

from rlserve import envs
from rlserve.envs import int_at_least

logger = logging.getLogger(__name__)

MIN_ROWS = 16  # below this a split loses or barely wins (module docstring: batch 4 a loss, 16 1.2x)
SPLIT_CPU_OVERHEAD = 1.25  # CPU of a split step / of the whole step, batch 64 (module docstring: 234 / 185)
MIN_BACKOFF = 4  # splits skipped after a losing split ...
MAX_BACKOFF = 64  # ... doubling up to this many (~32 decode steps: model and LM head each ask)

_local = threading.local()


def _team_rows() -> int:
    """Steps of at most this many rows run whole: the CPU team shares them over the cores
    (:mod:`rlserve.layers.cpu_gemm`, 0 when no team runs)."""
    from rlserve.layers import cpu_gemm

    return cpu_gemm.MAX_ROWS if cpu_gemm.active() else 0


def microbatch_count(config=None, threads: int = 1, ranks: int | None = None) -> int:
    """How many micro-batches a CPU engine splits its decode steps into (module docstring).

    Args:
        config: the engine config (``extra["cpu_microbatches"]``, TP / DP sizes), or None.
        threads: the engine's intra-op threads (:func:`rlserve.engine.cpu.cpu_threads.engine_cpu_threads`).
        ranks: engine ranks on this machine (default: TP size x DP size of ``config``).

    Raises:
        ValueError: an override that is not an integer >= 1.
    """
    from rlserve.engine.cpu.cpu_threads import engine_ranks, usable_cpus

    extra = getattr(config, "extra", None) or {}
    if extra.get("cpu_microbatches") is not None:
        return int_at_least(extra["cpu_microbatches"], 'extra["cpu_microbatches"]', 1)
    if envs.RLSERVE_CPU_MICROBATCHES is not None:
        return envs.RLSERVE_CPU_MICROBATCHES
    if ranks is None:
        ranks = engine_ranks(config)
    return 2 if threads == 1 and ranks == 1 and usable_cpus() >= 2 else 1


def _min_rows_from_env() -> int:
    rows = envs.RLSERVE_CPU_MICROBATCH_MIN_ROWS
    return MIN_ROWS if rows is None else rows


def check_environment(config=None) -> None:
    """Validate the micro-batch settings of ``config`` and the environment before any engine
    starts (``rlserve serve`` calls it, so a typo is one line of error, not an engine process's
    traceback after the model loaded).

    Raises:
        ValueError: ``extra["cpu_microbatches"]`` / ``RLSERVE_CPU_MICROBATCHES`` not an integer
            >= 1, or ``RLSERVE_CPU_MICROBATCH_MIN_ROWS`` not an integer.
    """
    microbatch_count(config)
    _min_rows_from_env()


class _Thread:
    """One persistent micro-batch thread: runs a submitted job, records its wall and CPU time."""

    def __init__(self, index: int, threads: int):
        self._go = threading.Event()
        self._done = threading.Event()
        self._job: Callable | None = None
        self._threads = threads
        self.result = None
        self.error: BaseException | None = None
        self.wall = self.cpu = 0.0
        self._thread = threading.Thread(target=self._main, name=f"rlserve-cpu-microbatch-{index}", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        torch.set_num_threads(self._threads)
        while True:
            self._go.wait()
            self._go.clear()
            job = self._job
            if job is None:  # close()
                return
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                self.result, self.error = job(), None
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                self.result, self.error = None, e
            self.wall, self.cpu = time.perf_counter() - w0, time.thread_time() - c0
            self._job = None
            self._done.set()

    def submit(self, job: Callable) -> None:
        self._done.clear()
        self._job = job
        self._go.set()

    def wait(self) -> None:
        self._done.wait()

    def stop(self) -> None:
        self._job = None
        self._go.set()

    @property
    def native_id(self) -> int:
        return self._thread.native_id

    def join(self, timeout_s: float) -> None:
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)


def _current_cpu() -> int | None:
    """The CPU the calling thread runs on (glibc ``sched_getcpu``), or None where unknown."""
    if "fn" not in _libc:
        try:
            import ctypes

            _libc["fn"] = ctypes.CDLL(None, use_errno=True).sched_getcpu
        except (OSError, AttributeError):
            _libc["fn"] = None
    fn = _libc["fn"]
    cpu = fn() if fn is not None else -1
    return cpu if cpu >= 0 else None


_libc: dict = {}


def _place(workers: list[_Thread]) -> set[int] | None:
    """Spread one split over CPUs: the calling thread stays on the CPU it runs on and the
    micro-batch threads may use only the others, until :func:`_unplace`. Without it the kernel
    often woke a micro-batch thread on the CPU of the thread that woke it (which keeps running
    its own micro-batch), so both shared one core while the other core ran other work: both
    at half speed (wall = 2x CPU in 9 of 16 losing splits of an offline run at load 2.5).
    Returns the calling thread's CPU mask to restore, or None (nothing changed: one usable
    CPU, a pinned engine thread, or no ``sched_getcpu`` / ``sched_setaffinity``)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    try:
        allowed = os.sched_getaffinity(0)
        cpu = _current_cpu()
        if cpu is None or cpu not in allowed or len(allowed) < 2:
            return None
        others = allowed - {cpu}
        for t in workers:
            os.sched_setaffinity(t.native_id, others)
        os.sched_setaffinity(0, {cpu})
        return allowed
    except OSError:
        return None


def _unplace(allowed: set[int] | None) -> None:
    if allowed is not None:
        try:
            os.sched_setaffinity(0, allowed)
        except OSError:
            pass


def _stop_all(threads: list[_Thread]) -> None:
    """Stop the threads and wait for them (at most 5 s each): a thread still inside a torch
    op while the interpreter shuts down aborts the process (``terminate called``)."""
    for t in threads:
        t.stop()
    for t in threads:
        t.join(5.0)


class CPUMicroBatches:
    """Runs item ranges (rows, or sequences of rows) of one CPU step on ``count`` threads (the
    caller's and ``count - 1`` persistent ones), joined once; see the module docstring.

    Args:
        count: micro-batches per split step (>= 1; 1 never splits).
        threads: torch intra-op threads of each micro-batch thread.
        min_rows: steps with fewer rows are not split (default :data:`MIN_ROWS`, or
            ``RLSERVE_CPU_MICROBATCH_MIN_ROWS``; at least 2).

    Raises:
        ValueError: ``count`` < 1, or a ``RLSERVE_CPU_MICROBATCH_MIN_ROWS`` that is not an integer.

    One split at a time (an engine's steps are sequential): a second caller of :meth:`run`
    while a split runs gets its ranges run one after the other on its own thread.

    ``stats``: ``splits`` (split steps run), ``skipped`` (splits skipped while backing off),
    ``lost`` (split steps that did worse than a whole step would have).
    """

    def __init__(self, count: int, threads: int = 1, min_rows: int | None = None):
        if count < 1:
            raise ValueError(f"micro-batch count must be >= 1, got {count}")
        self.count = count
        self.threads = threads
        self.min_rows = max(2, int(min_rows if min_rows is not None else _min_rows_from_env()))
        self._workers: list[_Thread] = []
        self._busy = threading.Lock()
        self.split_cpu_overhead = SPLIT_CPU_OVERHEAD  # the guard's threshold (tests: 0 turns it off)
        self._skip = 0
        self._backoff = MIN_BACKOFF
        self.stats = {"splits": 0, "skipped": 0, "lost": 0}

    def plan(self, costs: Sequence[float], rows: int | None = None) -> list[tuple[int, int]] | None:
        """Contiguous item ranges ``[(0, k1), (k1, k2), ...]`` of about equal total cost, one
        per micro-batch, or ``None``: run the step whole (one micro-batch configured, fewer
        than ``min_rows`` rows or 2 items, few enough rows for the CPU team, backing off after a
        losing split).

        Args:
            costs: one non-negative estimate per item (a row, or a sequence of rows; any unit,
                e.g. a decode row's context length plus a constant for its linears).
            rows: the step's token rows (default: one per item).
        """
        n = len(costs)
        rows = n if rows is None else rows
        if self.count < 2 or n < 2 or rows < self.min_rows or rows <= _team_rows():
            return None
        if self._skip > 0:
            self._skip -= 1
            self.stats["skipped"] += 1
            return None
        parts = min(self.count, n)
        costs = [max(0.0, float(c)) for c in costs]
        total = sum(costs)
        if total <= 0.0:
            costs, total = [1.0] * n, float(n)
        ranges, start, acc = [], 0, 0.0
        for i, c in enumerate(costs):
            acc += c
            later = parts - 1 - len(ranges)  # micro-batches still to open after this one
            # close this one at its share of the cost, or where each later one keeps just one item
            if later > 0 and n - (i + 1) >= later and (acc >= total * (len(ranges) + 1) / parts or n - (i + 1) == later):
                ranges.append((start, i + 1))
                start = i + 1
        ranges.append((start, n))
        return [r for r in ranges if r[1] > r[0]]

    def run(self, fn: Callable[[int, int], object], ranges: list[tuple[int, int]]) -> list:
        """``[fn(a, b) for (a, b) in ranges]``, the first range on the calling thread and each
        other on a micro-batch thread, under the caller's grad / inference mode. Returns after
        every range finished; then re-raises the first exception any of them raised (the
        threads stay usable). Records whether the split lost (:meth:`record`).
        """
        if len(ranges) == 1 or not self._busy.acquire(blocking=False):
            return [fn(a, b) for a, b in ranges]
        try:
            while len(self._workers) < self.count - 1:
                self._workers.append(_Thread(len(self._workers) + 1, self.threads))
                if len(self._workers) == 1:
                    weakref.finalize(self, _stop_all, self._workers)
            inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

            def job(a, b):
                def call():
                    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                        return fn(a, b)
                return call

            extra = ranges[1:]
            used = self._workers[:len(extra)]
            allowed = _place(used)
            for t, (a, b) in zip(used, extra):
                t.submit(job(a, b))
            w0, c0 = time.perf_counter(), time.thread_time()
            first_error = None
            try:
                first = fn(*ranges[0])
            except BaseException as e:  # noqa: BLE001 - re-raised after the join
                first, first_error = None, e
            wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
            for t in used:
                t.wait()
            _unplace(allowed)
            error = first_error or next((t.error for t in used if t.error is not None), None)
            if error is not None:
                raise error
            self.record([wall] + [t.wall for t in used], [cpu] + [t.cpu for t in used])
            return [first] + [t.result for t in used]
        finally:
            self._busy.release()

    def record(self, walls: Sequence[float], cpus: Sequence[float]) -> bool:
        """Contention guard for one split step: ``walls`` / ``cpus`` seconds of each micro-batch.
        Returns True (and schedules ``backoff`` whole steps) when the step lost: its wall time
        ``max(walls)`` exceeded ``sum(cpus) / split_cpu_overhead`` (module docstring)."""
        self.stats["splits"] += 1
        lost = self.split_cpu_overhead > 0 and max(walls) * self.split_cpu_overhead > sum(cpus)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("micro-batches: wall ms %s, CPU ms %s, %s; %s", [round(1e3 * w, 1) for w in walls],
                         [round(1e3 * c, 1) for c in cpus], "lost" if lost else "won", self.stats)
        if lost:
            self.stats["lost"] += 1
            self._skip = self._backoff
            self._backoff = min(2 * self._backoff, MAX_BACKOFF)
        else:
            self._backoff = MIN_BACKOFF
        return lost

    def close(self) -> None:
        """Stop the micro-batch threads (they also stop when this object is collected)."""
        _stop_all(self._workers)
        self._workers = []


def current() -> CPUMicroBatches | None:
    """The micro-batches of the step running on this thread (:func:`active`), or None."""
    return getattr(_local, "microbatches", None)


@contextlib.contextmanager
def active(microbatches: CPUMicroBatches | None):
    """Make ``microbatches`` :func:`current` on this thread inside the ``with`` block."""
    prev = getattr(_local, "microbatches", None)
    _local.microbatches = microbatches
    try:
        yield microbatches
    finally:
        _local.microbatches = prev


def split(fn: Callable[[int, int], torch.Tensor], costs: Sequence[float], rows: int | None = None,
          veto: Callable[[], bool] | None = None) -> torch.Tensor | None:
    """``fn(0, n)`` computed as micro-batches of items (rows, or sequences of rows) on the
    current step's threads and concatenated along dim 0, or ``None`` when there is no current
    :class:`CPUMicroBatches`, it does not split this step, or ``veto()`` (asked only for a step
    that would be split) is true; the caller then computes ``fn(0, n)`` itself. ``fn(a, b)``
    must return the result rows of items ``a:b``, computed from those items alone. ``costs`` /
    ``rows``: as for :meth:`CPUMicroBatches.plan`."""
    mb = current()
    ranges = None if mb is None else mb.plan(costs, rows)
    if ranges is None or len(ranges) < 2 or (veto is not None and veto()):
        return None
    return torch.cat(mb.run(fn, ranges))
