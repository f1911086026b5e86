"""Summarise what a device script's ``benchmarks/vllm_bench.py`` run wrote: one line per server
configuration and concurrency from its ``--json`` file (``vllm bench serve``'s result: completed
requests, output tok/s, mean / p99 TTFT, median / p99 ITL in ms, peak output tok/s, the client's wall
time where recorded), and with ``--probe DIR`` the stall probe's summary
(:func:`benchmarks.api_stream_probe.summarize`, first 1,500 characters) and the output callback's
split timers (``DIR/*.split``: calls and seconds per part).

    python3 benchmarks/device/vllm_bench_summary.py OUT_DIR/vllm_bench.json [--probe OUT_DIR/probe]

A missing or unreadable file is one line saying so (a run cut by its bound writes none); exit 0.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys


def rows(path: str) -> None:
    try:
        with open(path) as f:
            results = json.load(f)["rows"]
    except Exception as e:  # noqa: BLE001 - a run killed before or while writing
        print(f"no results in {path}: {e}")
        return
    for r in results:
        x = r["result"]
        wall = f", client {x['client_wall_s']:.0f} s" if "client_wall_s" in x else ""
        print(f"{r['config']}: {x['completed']} ok, {x['output_throughput']:,.0f} tok/s, TTFT mean/p99 "
              f"{x['mean_ttft_ms']:.0f}/{x['p99_ttft_ms']:.0f} ms, ITL median/p99 {x['median_itl_ms']:.1f}/"
              f"{x['p99_itl_ms']:.1f} ms, peak {x.get('max_output_tokens_per_s', 0):,.0f}/s{wall}")


def probe(directory: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from benchmarks.api_stream_probe import summarize

    print("probe:", json.dumps(summarize(directory, 0, 1e12))[:1500])
    for path in sorted(glob.glob(os.path.join(directory, "*.split"))):
        with open(path) as f:
            sums = json.load(f)["sums"]
        print(os.path.basename(path) + ": " + ", ".join(f"{k} {n} calls {t:.2f} s" for k, (n, t) in sums.items()))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json")
    ap.add_argument("--probe", default=None, help="the stall probe's directory (API_STREAM_PROBE_DIR)")
    args = ap.parse_args(argv)
    rows(args.json)
    if args.probe:
        try:
            probe(args.probe)
        except Exception as e:  # noqa: BLE001 - the probe's files are a diagnosis: never fail the script
            print(f"probe: unreadable ({type(e).__name__}: {e})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
