"""``rlserve.layers.cpu_hugepages``: with ``RLSERVE_CPU_HUGEPAGES=1`` large CPU tensors start on a
2 MiB boundary with their whole 2 MiB pages advised ``MADV_HUGEPAGE`` (backed by huge pages where
the kernel's transparent huge pages are on); small ones, the default and ``0`` are plain tensors; the packed weights
and the CPU KV cache use it, with the same values."""

from __future__ import annotations

import re
import sys

import pytest
import torch

from rlserve.layers import cpu_gemm, cpu_hugepages

HUGE = cpu_hugepages.HUGE_PAGE
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")


def _thp_mode() -> str:
    """The bracketed word of /sys/kernel/mm/transparent_hugepage/enabled ('' where absent)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            m = re.search(r"\[(\w+)\]", f.read())
        return m.group(1) if m else ""
    except OSError:
        return ""


def _anon_huge_kb(addr: int) -> int:
    """AnonHugePages (kB) of the mapping of this process that holds ``addr`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                inside = int(m.group(1), 16) <= addr < int(m.group(2), 16)
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {addr:#x}")


@linux
def test_large_tensor_is_aligned_and_huge_where_the_kernel_allows(monkeypatch):
    monkeypatch.setenv("RLSERVE_CPU_HUGEPAGES", "1")
    shape = (3 * HUGE // 4 + 1000,)  # 3 whole 2 MiB pages and a tail
    t = cpu_hugepages.zeros(shape)
    assert t.shape == shape and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % HUGE == 0
    assert torch.count_nonzero(t) == 0
    t.fill_(1.5)  # every page written (the tail on small pages)
    assert float(t.sum()) == 1.5 * t.numel()
    if _thp_mode() in ("madvise", "always"):
        # the advised range: 3 huge pages, touched after the advice (khugepaged aside, the only
        # way a 'madvise' system gives them); at least 2 even if memory is fragmented
        assert _anon_huge_kb(t.data_ptr()) >= 2 * HUGE // 1024


@linux
@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="no transparent huge pages here")
def test_huge_after_malloc_freed_memory_of_that_size(monkeypatch):
    """Memory a freed tensor left mapped on small pages is not reused (a first version on
    torch.empty got small pages for two thirds of SmolLM2's packs this way)."""
    monkeypatch.setenv("RLSERVE_CPU_HUGEPAGES", "1")
    for _ in range(3):
        junk = torch.ones(4 * HUGE // 4)  # 4 pages' worth of malloc'd memory, touched, then freed
        del junk
        t = cpu_hugepages.empty((4 * HUGE // 4,))
        t.fill_(2.0)
        assert _anon_huge_kb(t.data_ptr()) >= 3 * HUGE // 1024


def test_small_tensor_default_and_switch_off_are_plain(monkeypatch):
    monkeypatch.delenv("RLSERVE_CPU_HUGEPAGES", raising=False)
    default = cpu_hugepages.empty((4, HUGE // 4), torch.float32)  # off by default (BENCHMARKS.md, s23)
    assert default._base is None
    monkeypatch.setenv("RLSERVE_CPU_HUGEPAGES", "1")
    small = cpu_hugepages.empty((HUGE // 4 - 1,))  # one element short of a huge page
    assert small._base is None and small.shape == (HUGE // 4 - 1,)
    monkeypatch.setenv("RLSERVE_CPU_HUGEPAGES", "0")
    off = cpu_hugepages.zeros((4, HUGE // 4), torch.float32)
    assert off._base is None and torch.count_nonzero(off) == 0


@linux
def test_other_dtypes_keep_shape_and_bytes(monkeypatch):
    monkeypatch.setenv("RLSERVE_CPU_HUGEPAGES", "1")
    for dtype in (torch.float8_e4m3fn, torch.bfloat16, torch.int64):
        n = 2 * HUGE // torch.empty((), dtype=dtype).element_size()
        t = cpu_hugepages.zeros((2, n // 2), dtype)
        assert t.dtype == dtype and t.shape == (2, n // 2) and t.data_ptr() % HUGE == 0
        assert t.numel() * t.element_size() == 2 * HUGE and t.view(torch.uint8).sum() == 0


@linux
@pytest.mark.skipif(not cpu_gemm.available(), reason="CPU team kernels not built here")
def test_fresh_pack_is_aligned_and_equals_the_reference_layout(monkeypatch):
    monkeypatch.setenv("RLSERVE_CPU_HUGEPAGES", "1")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1000, 576, generator=g)  # 32 panels, the last one 8 rows of weight + zeros
    packed = cpu_gemm.pack(w)
    assert packed.data_ptr() % HUGE == 0
    ref = torch.cat([w, w.new_zeros(24, 576)]).reshape(32, 32, 576).transpose(1, 2)
    assert torch.equal(packed, ref)
    x = torch.randn(5, 576, generator=g)
    # the team's FMA chain against float64: within 576 roundings of |x| . |w| (the usual bound)
    got, exact = cpu_gemm.linear(x, packed, 1000), (x.double() @ w.double().T)
    bound = 576 * torch.finfo(torch.float32).eps * (x.abs().double() @ w.abs().double().T)
    assert bool(((got.double() - exact).abs() <= bound).all())


@linux
def test_cpu_kv_cache_is_zeroed_on_aligned_pages(tiny_model, monkeypatch):
    from rlserve import LLM

    monkeypatch.setenv("RLSERVE_CPU_HUGEPAGES", "1")
    llm = LLM(tiny_model("llama"), dtype="float32", device="cpu", block_size=16)
    runner = llm.engine.executor.runner
    k0 = runner.kv_caches[0][0]
    per_block = k0[0].numel() * k0.element_size()
    runner.allocate_kv_cache(-(-2 * HUGE // per_block))  # every layer's K and V >= 2 MiB
    for k, v in runner.kv_caches:
        assert k.data_ptr() % HUGE == 0 and v.data_ptr() % HUGE == 0
        assert torch.count_nonzero(k) == 0 and torch.count_nonzero(v) == 0
