"""Large, long-lived CPU tensors on transparent huge pages (2 MiB) where the kernel allows it.

A CPU decode step streams every weight from memory once (SmolLM2-135M: 540 MB of float32 packed
panels, ``rlserve/layers/cpu_gemm.py``) and reads each sequence's K/V blocks from the paged
cache; on 4 KiB pages that is one TLB entry per 4 KiB, ~135,000 per step for the weights alone,
and in a virtual machine each TLB miss walks two sets of page tables. Linux backs an
anonymous range with 2 MiB pages at first touch when ``/sys/kernel/mm/transparent_hugepage/
enabled`` is ``always``, or ``madvise`` and the range was marked with ``madvise(MADV_HUGEPAGE)``
(the default of many distributions, and of the CI machines: no process had a huge page there).

:func:`empty` returns an uninitialised CPU tensor whose storage starts on a 2 MiB boundary, with
its whole 2 MiB pages (the tail past the last one stays on small pages: no resident memory is
added) marked ``MADV_HUGEPAGE`` before any of them is touched. The tensor is a view of a
``uint8`` buffer up to 2 MiB larger (address space only: the part before the aligned start is
never touched). Smaller tensors, other systems (no ``madvise``: macOS, Windows, musl without it)
and ``RLSERVE_CPU_HUGEPAGES=0`` get a plain ``torch.empty``. Values and bits do not depend on it.

Measured: SmolLM2's linears from memory and the decode attention of 30 layers ran 4-13% less CPU
time on the 2-core AVX-512 Xeon KVM guest of session 23 (BENCHMARKS.md, "Issue 37 (s23)").

Used by :func:`rlserve.layers.cpu_gemm.pack` (fresh packs) and the CPU KV cache
(:meth:`rlserve.engine.worker.model_runner.ModelRunner.allocate_kv_cache`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

import torch

from rlserve import envs

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20  # bytes: x86-64's and arm64's (4 KiB granule) transparent huge page
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux

_madvise = None  # ctypes libc.madvise, False where there is none


def _libc_madvise():
    global _madvise
    if _madvise is None:
        _madvise = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
                fn = libc.madvise
                fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                fn.restype = ctypes.c_int
                _madvise = fn
            except (OSError, AttributeError):
                pass
    return _madvise


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor of ``shape`` / ``dtype``, on 2 MiB pages where
    possible (see the module docstring); a plain ``torch.empty`` for tensors under 2 MiB, where
    ``madvise`` is missing, or with
    ``RLSERVE_CPU_HUGEPAGES=0``. Write it before reading it, as any ``torch.empty``."""
    shape = tuple(int(s) for s in shape)
    n = 1
    for s in shape:
        n *= s
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    madvise = _libc_madvise() if envs.RLSERVE_CPU_HUGEPAGES and nbytes >= HUGE_PAGE else False
    if not madvise:
        return torch.empty(shape, dtype=dtype)
    buf = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = (-buf.data_ptr()) % HUGE_PAGE
    out = buf[start:start + nbytes].view(dtype).view(shape)
    if madvise(buf.data_ptr() + start, nbytes // HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE) != 0:
        # EINVAL where the kernel has no transparent huge pages: the range keeps small pages
        logger.debug("madvise(MADV_HUGEPAGE) failed (errno %d): small pages", ctypes.get_errno())
    return out


def zeros(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`empty` filled with zeros (the pages are touched after the advice)."""
    return empty(shape, dtype).zero_()
