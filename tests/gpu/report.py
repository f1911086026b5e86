"""The GPU tests' measurement reports: printed, and written as JSON under ``$RLSERVE_GPU_REPORT``
when that is set (one ``<name>.json`` per report: ``transfer``, ``liveness``, ``sleep``, ``fp8``,
``bf16_agreement``; the numbers BENCHMARKS.md quotes)."""

from __future__ import annotations

import json
import os

#: report name -> {key: value}, as reported so far in this process
REPORTS: dict[str, dict] = {}


def write_report(name: str, report: dict) -> None:
    """Rewrite ``$RLSERVE_GPU_REPORT/<name>.json`` with ``report`` (values that JSON cannot hold
    as their ``str``); nothing when the variable is not set."""
    out = os.environ.get("RLSERVE_GPU_REPORT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)


def gpu_report(name: str, key: str, value) -> None:
    """Print ``[<name>-gpu] key: value`` and add it to report ``name`` (:func:`write_report`)."""
    report = REPORTS.setdefault(name, {})
    report[key] = value
    print(f"[{name}-gpu] {key}: {value}", flush=True)
    write_report(name, report)
