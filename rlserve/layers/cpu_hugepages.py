"""Large, long-lived CPU tensors on transparent huge pages (2 MiB) where the kernel allows it.

A CPU decode step streams every weight from memory once (SmolLM2-135M: 540 MB of float32 packed
panels, ``rlserve/layers/cpu_gemm.py``) and reads each sequence's K/V blocks from the paged
cache; on 4 KiB pages that is one TLB entry per 4 KiB, ~135,000 per step for the weights alone,
and in a virtual machine each TLB miss walks two sets of page tables. Linux backs an
anonymous range with 2 MiB pages at first touch when ``/sys/kernel/mm/transparent_hugepage/
enabled`` is ``always``, or ``madvise`` and the range was marked with ``madvise(MADV_HUGEPAGE)``
(the default of many distributions, and of the CI machines: no process had a huge page there).

:func:`empty` returns an uninitialised CPU tensor in a fresh anonymous private mapping of its own
(``mmap``; never-touched pages, unlike memory that ``malloc`` hands back after an earlier free,
which is already mapped on small pages and stays so: the first version of this module, on
``torch.empty``, got huge pages for a third of the packed weights), its storage starting on a
2 MiB boundary, with its whole 2 MiB pages (the tail past the last one stays on small pages: no
resident memory is added) marked ``MADV_HUGEPAGE`` before any of them is touched. The mapping is
up to 2 MiB longer than the tensor (address space only: the part before the aligned start is
never touched) and is unmapped when the last view of it is freed. Only with
``RLSERVE_CPU_HUGEPAGES=1`` (off by default); smaller tensors, other systems (no
``MADV_HUGEPAGE``: macOS, Windows) and the default get a plain ``torch.empty``. Values and bits
do not depend on it.

Measured on the 2-core AVX-512 Xeon KVM guest of session 23 (BENCHMARKS.md, "Issue 37 (s23)"):
SmolLM2's linears from memory and the decode attention of 30 layers ran 5-15% less CPU time, the
whole decode step in-process 1-10% less; the server's closed loop of 16 streams was not faster
(0.91-1.03x in 5 rounds at autogroup nice -10, 0.90-0.98x in 3 under SCHED_FIFO), hence off by default.

Used by :func:`rlserve.layers.cpu_gemm.pack` (fresh packs) and the CPU KV cache
(:meth:`rlserve.engine.worker.model_runner.ModelRunner.allocate_kv_cache`).
"""

from __future__ import annotations

import logging
import mmap

import torch

from rlserve import envs

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20  # bytes: x86-64's and arm64's (4 KiB granule) transparent huge page


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor of ``shape`` / ``dtype``, on 2 MiB pages where
    possible (see the module docstring); a plain ``torch.empty`` unless ``RLSERVE_CPU_HUGEPAGES=1``,
    for tensors under 2 MiB and where ``mmap.MADV_HUGEPAGE`` is missing. Write it before
    reading it, as any ``torch.empty``.

    Raises:
        OSError: the mapping cannot be made (no address space or memory left).
    """
    shape = tuple(int(s) for s in shape)
    n = 1
    for s in shape:
        n *= s
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    if not (envs.RLSERVE_CPU_HUGEPAGES and nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE")):
        return torch.empty(shape, dtype=dtype)
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = torch.frombuffer(m, dtype=torch.uint8)  # holds the mapping until its last view is freed
    start = (-buf.data_ptr()) % HUGE_PAGE
    try:
        m.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError as e:  # EINVAL where the kernel has no transparent huge pages: small pages
        logger.debug("madvise(MADV_HUGEPAGE) failed (%s): small pages", e)
    return buf[start:start + nbytes].view(dtype).view(shape)


def zeros(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`empty` filled with zeros (the pages are touched after the advice)."""
    return empty(shape, dtype).zero_()
