"""Where a streamed run's long inter-token gaps are (issue 37): by the stream's chunk index, by the time
in the run, and on which side of the socket.

Inputs:

* the client's view: ``vllm bench serve --save-result --save-detailed``'s result JSON (``start_times``,
  ``ttfts``, ``itls`` per request: one entry per SSE chunk, so a chunk's gap is the time since the
  previous chunk of its stream as the client timestamped it), or ``benchmarks/vllm_bench.py --json``'s
  file (every row's ``result``);
* optionally the server's view: ``benchmarks/stream_trace.py``'s records (``--server DIR``): per stream the
  API process's ``perf_counter`` time of every body write and the chunks in it, and the API event loop's
  late wake-ups (a 2 ms sleep that woke more than ``--lag-ms`` late).

``time.perf_counter`` is ``CLOCK_MONOTONIC`` on Linux, one clock for every process of the machine, so the
client's and the server's times compare directly. A client gap over ``--gap-ms`` is matched to its
stream's server writes (the server stream whose first write is the latest one at or before the client's
first chunk, with as many chunks): it is *server-side* when the server's own gap between the same two
chunks was also over ``--gap-ms`` (the API process or the engine held the stream), else *client-side* (the
client, or the socket, added the difference).

The same directory's ``*.jit`` files (the engine-core process's Triton JIT cache misses), ``*.gc`` files (the
server processes' garbage collections of 5 ms or more) and
``--client-gc FILE`` (``benchmarks/vllm_bench_serve.py --gc-log``: the client's full collections) are listed
for the run's time window: a compile in the middle of serving stalls every stream, a client collection
delays every stream's read.

Usage::

    python benchmarks/stream_gaps.py RESULT.json [--row NAME] [--server DIR] [--client-gc FILE] [--gap-ms 200]
        [--json out.json]

Every time is milliseconds; chunk index 1 is the gap between a stream's first and second chunk.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: chunk-index bins (upper bounds, inclusive; the last is open)
INDEX_BINS = (1, 3, 15, 63, 10 ** 9)


def _pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100.0 * (len(s) - 1))))]


def client_streams(result: dict) -> list[dict]:
    """Per successful request: ``start`` (send time, s), ``chunks`` (the client's time of each chunk, s). A result
    without ``start_times`` (an older ``vllm bench serve``) gives every request start 0: gaps and chunk indices
    hold, times in the run do not.

    Raises:
        KeyError: a result saved without ``--save-detailed`` (no ``itls``)."""
    out = []
    starts = result.get("start_times") or [0.0] * len(result["ttfts"])  # without them: times per request only
    for st, ttft, itl in zip(starts, result["ttfts"], result["itls"]):
        if not ttft:
            continue
        t = st + ttft
        chunks = [t]
        for g in itl:
            t += g
            chunks.append(t)
        out.append({"start": st, "chunks": chunks})
    return out


def server_streams(trace_dir: str) -> tuple[list[dict], list[tuple[float, float]], list[tuple[float, float]]]:
    """``benchmarks/stream_trace.py``'s records: streams (``arrival``: the request's, ``start``: the response's,
    ``chunks``: each write's time, ``n``: chunks per write), loop lags and blocked writes ``(time s, ms)``."""
    streams, lags, blocked = [], [], []
    for path in sorted(glob.glob(os.path.join(trace_dir, "*.chunks"))):
        with open(path) as f:
            for line in f:
                v = line.split()
                if not v:
                    continue
                if v[0] in ("lag", "blocked"):
                    (lags if v[0] == "lag" else blocked).append((float(v[1]), float(v[2])))
                    continue
                if v[0] == "cpu":
                    continue  # cpu_use() reads these
                nums = [float(x) for x in v]
                arrival, start, pairs = nums[0], nums[1], nums[2:]
                times, counts = pairs[0::2], [int(x) for x in pairs[1::2]]
                streams.append({"arrival": arrival, "start": start, "chunks": times, "n": counts})
    return streams, lags, blocked


def cpu_use(trace_dir: str, t0: float, t1: float) -> dict | None:
    """The API process's CPU over ``[t0, t1]`` from ``stream_trace``'s ``cpu`` lines: ``process`` (cores: CPU
    seconds a second, all threads) and ``loop`` (the event-loop thread's share of one core)."""
    rows = []
    for path in glob.glob(os.path.join(trace_dir, "*.chunks")):
        with open(path) as f:
            rows += [tuple(float(x) for x in line.split()[1:4]) for line in f if line.startswith("cpu ")]
    rows = sorted(r for r in rows if t0 <= r[0] <= t1)
    if len(rows) < 2 or rows[-1][0] <= rows[0][0]:
        return None
    dt = rows[-1][0] - rows[0][0]
    return {"process": round((rows[-1][1] - rows[0][1]) / dt, 2), "loop": round((rows[-1][2] - rows[0][2]) / dt, 2),
            "over_s": round(dt, 2)}


def _gaps(streams: list[dict]) -> list[tuple[int, float, float, int]]:
    """``(stream index, end time s, gap ms, chunk index)`` of every gap."""
    return [(k, c[i], 1e3 * (c[i] - c[i - 1]), i) for k, s in enumerate(streams)
            for c in (s["chunks"],) for i in range(1, len(c))]


def _index_bin(i: int) -> str:
    lo = 1
    for hi in INDEX_BINS:
        if i <= hi:
            return f"{lo}" if lo == hi else (f"{lo}-{hi}" if hi < 10 ** 9 else f"{lo}+")
        lo = hi + 1
    return "?"


def describe(streams: list[dict], gap_ms: float, t0: float, bin_s: float) -> dict:
    """ITL percentiles and where the gaps over ``gap_ms`` are: per chunk-index bin (their share of that
    bin's gaps too) and per ``bin_s`` of the run (from ``t0``)."""
    gaps = _gaps(streams)
    all_ms = [g for _, _, g, _ in gaps]
    long = [x for x in gaps if x[2] > gap_ms]
    by_index, n_index = collections.Counter(), collections.Counter()
    for _, _, g, i in gaps:
        n_index[_index_bin(i)] += 1
        if g > gap_ms:
            by_index[_index_bin(i)] += 1
    by_time = collections.Counter(int((t - t0) / bin_s) for _, t, _, _ in long)
    streams_hit = len({k for k, _, _, _ in long})
    return {
        "streams": len(streams), "gaps": len(gaps), "chunks_per_stream": round(len(gaps) / max(1, len(streams)) + 1, 1),
        "itl_ms": {p: round(_pct(all_ms, p) or 0.0, 1) for p in (50, 90, 99, 99.9)},
        "max_ms": round(max(all_ms), 1) if all_ms else None,
        f"over_{gap_ms:g}ms": len(long), "streams_with_one": streams_hit,
        "by_chunk_index": {b: [by_index[b], n_index[b]] for b in sorted(n_index, key=lambda s: int(s.split("-")[0].rstrip("+")))},
        "by_time_s": {f"{b * bin_s:.1f}": by_time[b] for b in sorted(by_time)},
        "ttft_ms_by_start_s": _ttft_by_time(streams, t0, bin_s),
    }


def _ttft_by_time(streams: list[dict], t0: float, bin_s: float) -> dict:
    per = collections.defaultdict(list)
    for s in streams:
        per[int((s["start"] - t0) / bin_s)].append(1e3 * (s["chunks"][0] - s["start"]))
    return {f"{b * bin_s:.1f}": [len(v), round(max(v), 1)] for b, v in sorted(per.items())}


def match(client: list[dict], server: list[dict]) -> list[int | None]:
    """For each client stream, the index of its server stream (see the module docstring), or None."""
    order = sorted(range(len(server)), key=lambda k: server[k]["chunks"][0] if server[k]["chunks"] else 0.0)
    firsts = [server[k]["chunks"][0] if server[k]["chunks"] else 0.0 for k in order]
    used, out = set(), []
    for c in client:
        n, t = len(c["chunks"]), c["chunks"][0]
        j = bisect.bisect_right(firsts, t + 1e-4)
        hit = None
        for jj in range(j - 1, max(-1, j - 1024), -1):
            k = order[jj]
            if k not in used and sum(server[k]["n"]) == n:
                hit = k
                break
        if hit is not None:
            used.add(hit)
        out.append(hit)
    return out


def attribute(client: list[dict], server: list[dict], gap_ms: float) -> dict:
    """Each client gap over ``gap_ms`` as server-side or client-side (module docstring)."""
    pairs = match(client, server)
    counts = collections.Counter()
    split = {"send_to_arrival": [], "arrival_to_first_write": [], "first_write_to_client": []}
    for c, k in zip(client, pairs):
        if k is None:
            counts["unmatched stream"] += 1
            continue
        s = server[k]
        split["send_to_arrival"].append(1e3 * (s["arrival"] - c["start"]))
        split["arrival_to_first_write"].append(1e3 * (s["chunks"][0] - s["arrival"]))
        split["first_write_to_client"].append(1e3 * (c["chunks"][0] - s["chunks"][0]))
        # the server's time of the write that carried client chunk i
        times = [t for t, n in zip(server[k]["chunks"], server[k]["n"]) for _ in range(n)]
        cc = c["chunks"]
        for i in range(1, min(len(cc), len(times))):
            g = cc[i] - cc[i - 1]
            if 1e3 * g <= gap_ms:
                continue
            sg = times[i] - times[i - 1]
            counts["server-side" if 1e3 * sg > gap_ms else "client-side"] += 1
    counts["matched streams"] = sum(k is not None for k in pairs)
    out = dict(counts)
    out["ttft_split_ms"] = {k: [round(_pct(v, 50) or 0, 1), round(_pct(v, 99) or 0, 1), round(max(v, default=0), 1)]
                            for k, v in split.items()}
    return out


def load_results(path: str) -> dict[str, dict]:
    """``{name: vLLM result}`` from a vLLM result file or ``benchmarks/vllm_bench.py --json``'s."""
    with open(path) as f:
        d = json.load(f)
    if "rows" in d:
        return {r["config"]: r["result"] for r in d["rows"] if r.get("result")}
    return {os.path.basename(path): d}


def _timed_lines(paths: list[str], t0: float, t1: float) -> list[list]:
    """``[time since t0 s, rest of the line]`` of the lines ``<perf_counter s> ...`` (or ``gc2 <s> ...``) of
    ``paths`` that fall in ``[t0 - 2, t1]``."""
    out = []
    for path in paths:
        with open(path) as f:
            for line in f:
                v = line.split(None, 2 if line.startswith("gc2 ") else 1)
                try:
                    t = float(v[1] if v[0] == "gc2" else v[0])
                except (ValueError, IndexError):
                    continue
                if t0 - 2.0 <= t <= t1:
                    out.append([round(t - t0, 3), (v[2] if v[0] == "gc2" else v[1]).strip()[:240]])
    return sorted(out)


def report(name: str, result: dict, server_dir: str | None, gap_ms: float, bin_s: float, lag_ms: float,
           client_gc: str | None = None) -> dict:
    client = client_streams(result)
    timed = bool(result.get("start_times"))
    t0 = min(s["start"] for s in client)
    t1 = max(s["chunks"][-1] for s in client)
    server_all = server_streams(server_dir) if server_dir else ([], [], [])
    if not timed and server_all[0]:  # the run's window from the server's records instead
        t0 = min(s["arrival"] for s in server_all[0])
        t1 = max(s["chunks"][-1] for s in server_all[0])
    out = {"name": name, "client": describe(client, gap_ms, t0 if timed else 0.0, bin_s), "run_s": round(t1 - t0, 3)}
    if not timed:
        out["client"]["by_time_s"], out["client"]["ttft_ms_by_start_s"] = {}, {}
        out["client"]["note"] = "no start_times in the result: times in the run and the attribution left out"
    if client_gc and os.path.exists(client_gc):
        out["client_gc2"] = _timed_lines([client_gc], t0, t1)
    if server_dir:
        server, lags, blocked = server_all
        if server:
            out["server"] = describe([s for s in server if len(s["chunks"]) > 1] or server, gap_ms, t0, bin_s)
            if timed:
                out["attribution"] = attribute(client, server, gap_ms)
        long_lags = [(t, ms) for t, ms in lags if ms > lag_ms and t >= t0 - 1.0]
        out["loop_lags"] = {"n": len(long_lags), "total_ms": round(sum(ms for _, ms in long_lags), 1),
                            "max_ms": round(max((ms for _, ms in long_lags), default=0.0), 1),
                            "worst": [[round(t - t0, 3), round(ms, 1)] for t, ms in
                                      sorted(long_lags, key=lambda x: -x[1])[:8]]}
        out["api_cpu"] = cpu_use(server_dir, t0, t1)
        from benchmarks.api_stream_probe import split_lines

        out["api_split"] = split_lines(server_dir)
        out["jit_misses"] = _timed_lines(sorted(glob.glob(os.path.join(server_dir, "*.jit"))), t0, t1)
        out["server_gcs"] = [[t, f"pid {os.path.basename(p).split('.')[0]} {x}"]
                             for p in sorted(glob.glob(os.path.join(server_dir, "*.gc")))
                             for t, x in _timed_lines([p], t0, t1)]
        blocked = [(t, ms) for t, ms in blocked if t >= t0 - 1.0]
        out["blocked_writes"] = {"n": len(blocked), "total_ms": round(sum(ms for _, ms in blocked), 1),
                                 "max_ms": round(max((ms for _, ms in blocked), default=0.0), 1)}
    return out


def lines(rep: dict, gap_ms: float) -> list[str]:
    """Summary lines of one :func:`report`."""
    out = []
    for side in ("client", "server"):
        d = rep.get(side)
        if not d:
            continue
        out.append(f"{rep['name']} {side}: {d['streams']} streams, {d['chunks_per_stream']} chunks each, ITL p50/p90/p99 "
                   f"{d['itl_ms'][50]}/{d['itl_ms'][90]}/{d['itl_ms'][99]} ms, max {d['max_ms']}; "
                   f"{d[f'over_{gap_ms:g}ms']} gaps > {gap_ms:g} ms in {d['streams_with_one']} streams")
        out.append(f"  by chunk index (long / all): " + ", ".join(f"{k}: {v[0]}/{v[1]}" for k, v in d["by_chunk_index"].items()))
        out.append(f"  by time in the run (s: long gaps): " + ", ".join(f"{k}: {v}" for k, v in d["by_time_s"].items()))
        if d.get("note"):
            out.append(f"  ({d['note']})")
        if side == "client" and d["ttft_ms_by_start_s"]:
            out.append(f"  TTFT by send time (s: requests, max ms): " + ", ".join(
                f"{k}: {v[0]}/{v[1]}" for k, v in d["ttft_ms_by_start_s"].items()))
    if "attribution" in rep:
        att = dict(rep["attribution"])
        split = att.pop("ttft_split_ms")
        out.append(f"{rep['name']} gaps > {gap_ms:g} ms: " + ", ".join(f"{k} {v}" for k, v in sorted(att.items())))
        out.append(f"{rep['name']} TTFT split p50/p99/max ms: " + ", ".join(f"{k} {v[0]}/{v[1]}/{v[2]}" for k, v in split.items()))
    if "loop_lags" in rep:
        lg = rep["loop_lags"]
        out.append(f"{rep['name']} API loop late wake-ups: {lg['n']} ({lg['total_ms']} ms, max {lg['max_ms']}); worst "
                   f"(s, ms): {lg['worst']}")
        if rep.get("api_cpu"):
            c = rep["api_cpu"]
            out.append(f"{rep['name']} API process CPU over {c['over_s']} s of the run: {c['process']} cores, its event-loop "
                       f"thread {c['loop']} of one")
        for line in rep.get("api_split", []):
            out.append(f"{rep['name']} API split timers (whole server life): {line}")
        b = rep["blocked_writes"]
        out.append(f"{rep['name']} body writes that waited > 5 ms (transport paused): {b['n']} ({b['total_ms']} ms, "
                   f"max {b['max_ms']})")
    for key, what in (("jit_misses", "Triton JIT misses in the engine core"), ("client_gc2", "client full GCs (ms, collected)"),
                      ("server_gcs", "server GCs >= 5 ms (generation, ms, collected)")):
        if key in rep:
            out.append(f"{rep['name']} {what} during the run ({rep['run_s']} s, times from its first send): "
                       f"{len(rep[key])}" + "".join(f"\n  +{t:.3f} s {x}" for t, x in rep[key][:12]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", help="vLLM's detailed result JSON, or benchmarks/vllm_bench.py --json's")
    ap.add_argument("--row", help="only this row (config name, e.g. default@c256)")
    ap.add_argument("--server", help="benchmarks/stream_trace.py's directory for this run")
    ap.add_argument("--client-gc", help="benchmarks/vllm_bench_serve.py --gc-log's file")
    ap.add_argument("--gap-ms", type=float, default=200.0)
    ap.add_argument("--bin-s", type=float, default=0.5)
    ap.add_argument("--lag-ms", type=float, default=20.0, help="loop wake-ups later than this are reported")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    reps = []
    for name, res in load_results(args.result).items():
        if args.row and name != args.row:
            continue
        if "itls" not in res:
            print(f"{name}: no per-request detail (run vllm bench serve with --save-detailed)", file=sys.stderr)
            continue
        reps.append(report(name, res, args.server, args.gap_ms, args.bin_s, args.lag_ms, args.client_gc))
        print("\n".join(lines(reps[-1], args.gap_ms)), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reps, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
