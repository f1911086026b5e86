"""GPU kernel tables from a ``torch.profiler`` run (shared by the benchmark scripts).

:func:`profile_kernels` runs a function under the profiler (CUDA activity only: kernels
launched one by one and from CUDA-graph replays both appear) and :func:`kernel_table`
prints each kernel's call count, total GPU time, mean time and share of the total, so a
step's time can be attributed kernel by kernel.
"""

from __future__ import annotations

import torch


def profile_kernels(fn, label: str, top: int = 30) -> list[dict]:
    """Run ``fn()`` under ``torch.profiler`` (CUDA kernels only), synchronise, print the
    :func:`kernel_table` of its top ``top`` kernels under ``label``; returns the rows."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return kernel_table(prof, label, top)


def kernel_table(prof, label: str, top: int = 30) -> list[dict]:
    """Rows ``{name, count, total_ms, mean_us, share}`` of the GPU kernels in ``prof``
    (largest total first; ``share`` of the summed kernel time), printed as a table."""
    rows = []
    for e in prof.key_averages():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = e.self_cuda_time_total
        if t > 0:
            rows.append({"name": e.key, "count": e.count, "total_ms": t / 1e3})
    total = sum(r["total_ms"] for r in rows) or 1.0
    rows.sort(key=lambda r: -r["total_ms"])
    for r in rows:
        r["mean_us"] = r["total_ms"] * 1e3 / r["count"]
        r["share"] = r["total_ms"] / total
    print(f"--- GPU kernels: {label} (total {total:.1f} ms in {sum(r['count'] for r in rows)} kernels) ---")
    for r in rows[:top]:
        print(f"  {r['total_ms']:9.2f} ms {100 * r['share']:5.1f}% {r['count']:7d} x {r['mean_us']:8.2f} us  "
              f"{r['name'][:110]}")
    return rows
