"""glibc malloc thresholds for a process that runs a CPU engine: keep freed step tensors.

torch's CPU allocator takes every tensor from ``malloc`` and gives it back at once. A step's
large temporaries (a 1,024-token prefill's ``[1024, 3072]`` float32 activations are 12.6 MB,
a batch-64 logits tensor ``[64, 49152]`` 12.6 MB) sit above glibc's mmap threshold or at the
top of its heap, so glibc returns their pages to the kernel when they are freed
(``munmap``, or heap trimming above ``M_TRIM_THRESHOLD``) and the next step faults them in
again, each 4 KiB page zeroed by the kernel. Measured on the 2-core Zen 5 machine (issue 22,
ninth session; the 64-request workload of ``benchmarks/cpu_vs_vllm.py`` through the offline
``LLM``, one thread, one process per setting, alternating, load 0.9-2.8; BENCHMARKS.md):
268k-875k minor page faults and 57.1-60.2 s of CPU (4 runs, mean 58.6) with glibc's
defaults, 57-59k faults and 49.8-58.0 s (6 runs, mean 54.0) with the thresholds below, the
same greedy ids and peak RSS (2.15 GB). In the server's engine-core process (``perf``: ~2.5%
of its CPU in page faults, ~1.8% in malloc) the same workload measured within noise, 40.9 /
46.1 s with the thresholds against 41.9 / 45.4 s without; inter-token latency at concurrency
1 unchanged.

:func:`tune_malloc` sets ``M_MMAP_THRESHOLD`` to 64 MiB (allocations below it come from the
heap and are reused; fixing it also stops glibc's dynamic threshold) and
``M_TRIM_THRESHOLD`` to 256 MiB (freed memory at the top of the heap is kept up to that
much), process-wide. The engine's own memory (weights, KV cache) is allocated once and is
not affected; what the process keeps in addition is at most the trim threshold of freed
heap. ``RLSERVE_CPU_MALLOC_TUNE=0`` leaves glibc's defaults. Nothing happens where the C
library has no ``mallopt`` (musl, macOS, Windows).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

from rlserve import envs

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 64 << 20
TRIM_THRESHOLD_BYTES = 256 << 20

_done: list[bool] = []


def tune_malloc() -> bool:
    """Set the thresholds above once per process; returns True when glibc accepted both
    (also on later calls), False when switched off (``RLSERVE_CPU_MALLOC_TUNE=0``) or where
    there is no glibc ``mallopt``. Never raises."""
    if _done:
        return _done[0]
    ok = False
    if envs.RLSERVE_CPU_MALLOC_TUNE:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD,
                                                                               TRIM_THRESHOLD_BYTES) == 1
        except (OSError, AttributeError):
            ok = False
        logger.info("CPU engine: glibc malloc thresholds %s", "set (mmap 64 MiB, trim 256 MiB)" if ok else "unchanged")
    _done.append(ok)
    return ok
