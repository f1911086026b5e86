"""Summarise what a device script's ``benchmarks/vllm_bench.py`` run wrote: one line per server
configuration and concurrency from its ``--json`` file (:func:`benchmarks.vllm_bench.summary_lines`),
and with ``--probe DIR`` the stall probe's summary (:func:`benchmarks.api_stream_probe.summarize`,
first 1,500 characters) and the output callback's split timers
(:func:`benchmarks.api_stream_probe.split_lines`).

    python3 benchmarks/device/vllm_bench_summary.py OUT_DIR/vllm_bench.json [--probe OUT_DIR/probe]

A missing or unreadable file is one line saying so (a run cut by its bound writes none); exit 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _repo_on_path() -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json")
    ap.add_argument("--probe", default=None, help="the stall probe's directory (API_STREAM_PROBE_DIR)")
    args = ap.parse_args(argv)
    _repo_on_path()
    from benchmarks.vllm_bench import summary_lines

    print("\n".join(summary_lines(args.json)))
    if args.probe:
        from benchmarks.api_stream_probe import split_lines, summarize

        try:
            print("probe:", json.dumps(summarize(args.probe, 0, 1e12))[:1500])
            print("\n".join(split_lines(args.probe)))
        except Exception as e:  # noqa: BLE001 - the probe's files are a diagnosis: never fail the script
            print(f"probe: unreadable ({type(e).__name__}: {e})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
