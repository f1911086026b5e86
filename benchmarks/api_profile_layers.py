"""Where the API process's CPU per streamed event goes (issue 37): py-spy samples of
``benchmarks/api_stream_load.py --profile DIR`` sorted into the layers an event passes through,
each given as a share of the API process's samples and as microseconds per event (the share times
the run's ``api_cpu_us_per_event``, the process's ``/proc`` CPU seconds over its events).

Usage (after one or more ``api_stream_load.py ... --configs new= --profile DIR_i --json RUN_i.json``
runs, optionally with ``--env PYTHONPATH=benchmarks/gc_time_site:. GC_TIME_DIR=GC_i``)::

    python benchmarks/api_profile_layers.py RUN_1.json:DIR_1/new.txt[:GC_1] ... [--json OUT]

A sample goes to the layer of the innermost frame of its stack that a rule names (:data:`RULES`,
first rule that matches that frame); ``request admission`` takes every sample under FastAPI's
request handler (``get_request_handler``: body read, JSON, pydantic, tokenization, the route up to
its ``StreamingResponse``), a per-request cost spread over the request's events. Samples whose only
frames are the event loop's ``run`` are uvloop's own C work (epoll, the ready queue, task steps,
the self-pipe of ``call_soon_threadsafe``): py-spy sees no Python frame there.

Caveats (say them with the numbers): py-spy counts a thread's sample when it is not idle, so on a
loaded 2-core machine a runnable thread waiting for a core counts too (shares, not seconds, are what
the samples give; the microseconds come from ``/proc``); time in C (msgspec, uvloop's
``transport.write`` with its ``send`` system call and the loopback TCP path run in the sender's
context) is charged to the Python line that called it; garbage collection is charged to whatever
line allocated, so its row (``gc.callbacks``, thread CPU, ``benchmarks/gc_time_site``) is already
inside the others and is not added.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ADMISSION = "request admission + per-request HTTP (body, JSON, pydantic, tokenize, headers)"
LOOP = "uvloop loop itself (C: epoll, ready queue, task steps; no Python frame)"
FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?):(?P<line>\d+)\)$")


def _source_lines(path: str, needle: str) -> set[int]:
    """1-based numbers of the lines of ``path`` that contain ``needle`` (empty if unreadable)."""
    try:
        with open(path) as f:
            return {i for i, text in enumerate(f, 1) if needle in text}
    except OSError:
        return set()


def _write_lines() -> set[int]:
    import uvicorn.protocols.http.httptools_impl as h

    return _source_lines(h.__file__, "self.transport.write(")


def _decode_lines() -> set[int]:
    import rlserve.engine.front.core_client as c

    return _source_lines(c.__file__, "self._dec.decode(")


WRITE_LINES = _write_lines()
DECODE_LINES = _decode_lines()

# (layer, test of one frame: func, file, line); the innermost frame that a rule names decides
RULES: list[tuple[str, object]] = [
    ("transport.write (uvloop: send syscall, loopback TCP)",
     lambda fn, fi, ln: (fn == "RequestResponseCycle.send" and fi.endswith("httptools_impl.py") and ln in WRITE_LINES)
     or (fn == "DirectWrite.write" and fi.endswith("server/direct_write.py"))),
    ("uvicorn RequestResponseCycle.send (framing, flow checks)",
     lambda fn, fi, ln: fn == "RequestResponseCycle.send"),
    ("msgspec decode of core messages",
     lambda fn, fi, ln: fi.endswith("front/core_client.py") and ln in DECODE_LINES),
    ("detokenizer", lambda fn, fi, ln: fi.endswith("detokenizer.py")),
    ("OutputProcessor (outputs, stop checks)", lambda fn, fi, ln: fi.endswith("front/output_processor.py")),
    ("hand-off to requests (route, Wakeup.set, futures)",
     lambda fn, fi, ln: fn in ("Replica.route", "Wakeup.set") or fi.endswith("front/replica.py")),
    ("core client (frame loop, stats, stop/abort sends)", lambda fn, fi, ln: fi.endswith("front/core_client.py")),
    ("metrics (prometheus, per request)",
     lambda fn, fi, ln: "prometheus_client/" in fi or fi.endswith(("server/metrics.py", "server/vllm_metrics.py"))),
    (ADMISSION, lambda fn, fi, ln: "h11_impl" in fi or fi.endswith(("server/openai_routes.py", "server/template_pool.py"))
     or (fi.endswith("httptools_impl.py") and not fn.startswith("RequestResponseCycle.run_asgi"))),
    ("request coroutine wake-up (AsyncEngine.generate, ServerState.generate)",
     lambda fn, fi, ln: fi.endswith(("front/async_engine.py", "front/front_request.py"))
     or fn.startswith("ServerState.generate")),
    ("route SSE encode (stream_completions, ChunkTemplate.fill)",
     lambda fn, fi, ln: (fi.endswith("server/openai_stream.py") and not fn.startswith("SSEResponse."))
     or fi.endswith(("server/sse_template.py", "server/stream_chunks.py"))),
    ("direct write (DirectSink, flow checks; issue 37)", lambda fn, fi, ln: fi.endswith("server/direct_write.py")),
    ("Starlette StreamingResponse / ASGI send wrappers (middleware, anyio)",
     lambda fn, fi, ln: fi.startswith(("starlette/", "fastapi/", "anyio/")) or fn.startswith("SSEResponse.")
     or fi.endswith(("server/limits.py", "server/text_check.py")) or fi.startswith("uvicorn/middleware/")),
    (LOOP, lambda fn, fi, ln: fn in ("Runner.run", "run") and fi.startswith(("asyncio/", "uvloop/"))),
]
READER = "reader thread (zmq recv, call_soon_threadsafe)"
OTHER = "other"


def classify(frames: list[str], thread: str) -> str:
    if "reader" in thread:
        return READER
    parsed = []
    for fr in frames:
        m = FRAME.match(fr)
        parsed.append((m["func"], m["file"], int(m["line"])) if m else (fr, "", 0))
    if not parsed:
        return LOOP  # the thread is running, in no Python frame
    if any(fn.startswith("get_request_handler") for fn, _, _ in parsed):
        return ADMISSION  # the whole handler, whatever it calls
    for fn, fi, ln in reversed(parsed):
        for layer, test in RULES:
            if test(fn, fi, ln):
                return layer
    return OTHER


def api_samples(raw: str) -> tuple[collections.Counter, collections.Counter]:
    """Samples per layer and per ``other`` leaf frame, for the API process's threads only (py-spy
    ``--subprocesses`` stacks start ``process P;thread T;...``; a child's ``process P;process C;...``)."""
    layers, other = collections.Counter(), collections.Counter()
    for line in raw.splitlines():
        stack, _, k = line.rpartition(" ")
        if not stack or not k.isdigit():
            continue
        head = re.match(r'process \d+:"(?:(?!";process ).)*?";(?=thread )', stack)  # (a command line may hold ';')
        parts = (["process"] + stack[head.end():].split(";")) if head else stack.split(";")
        if len(parts) < 2 or not parts[1].startswith("thread "):
            continue  # another process (the engine core, template workers)
        layer = classify(parts[2:], parts[1])
        layers[layer] += int(k)
        if layer == OTHER:
            other[parts[-1]] += int(k)
    return layers, other


def gc_in_window(gc_dir: str, window: list[float]) -> dict | None:
    """The API process's collections and their CPU seconds within ``window`` (unix seconds) from
    ``benchmarks/gc_time_site``'s file (the process whose first line has ``serve``)."""
    for name in sorted(os.listdir(gc_dir)):
        with open(os.path.join(gc_dir, name)) as f:
            lines = f.read().splitlines()
        if not lines or " serve " not in f" {lines[0]} ":
            continue
        rows = [[float(x) for x in ln.split()] for ln in lines[1:] if ln.strip()]
        before = [r for r in rows if r[0] <= window[0]] or [[window[0], 0, 0, 0, 0.0, 0.0, 0.0]]
        upto = [r for r in rows if r[0] <= window[1]]
        a, b = before[-1], upto[-1]
        return {"collections": [int(b[i] - a[i]) for i in (1, 2, 3)],
                "cpu_s": [round(b[i] - a[i], 4) for i in (4, 5, 6)]}
    return None


def analyse(spec: str) -> dict:
    run_json, spy, *rest = spec.split(":")
    with open(run_json) as f:
        doc = json.load(f)
    stem = os.path.splitext(os.path.basename(spy))[0]  # DIR/<config>.txt: that config's run
    run = next((r for r in doc["runs"] if r.get("config") == stem), doc["runs"][0])
    with open(spy) as f:
        layers, other = api_samples(f.read())
    total = sum(layers.values())
    events = run["events_s"] * run["duration_s"]
    out = {"run": run_json, "date": doc["meta"]["date"], "loadavg": doc["meta"]["loadavg"],
           "events_s": run["events_s"], "events": round(events), "api_cpu_s": run["api_cpu_s"],
           "api_cpu_us_per_event": run["api_cpu_us_per_event"], "p99_itl_ms": run["p99_itl_ms"],
           "api_cpu_system_us_per_event": (round(1e6 * run["api_cpu_system_s"] / events, 1)
                                           if "api_cpu_system_s" in run else None),
           "samples": total, "layers": {k: v for k, v in layers.most_common()},
           "other_top": other.most_common(12)}
    if rest and "window_unix_s" in run:
        g = gc_in_window(rest[0], run["window_unix_s"])
        if g is not None:
            g["us_per_event"] = round(1e6 * sum(g["cpu_s"]) / events, 1)
            out["gc"] = g
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="RUN.json:PYSPY.txt[:GC_DIR]")
    ap.add_argument("--json", help="write the per-run and pooled breakdowns here")
    args = ap.parse_args(argv)
    runs = [analyse(s) for s in args.runs]
    names = [layer for layer, _ in RULES] + [READER, OTHER]
    print(f"{'layer':74s}" + "".join(f" {os.path.basename(r['run']):>16s}" for r in runs) + f" {'pooled':>16s}")
    pooled = {}
    for layer in names:
        cells, us_sum, share_sum = [], 0.0, 0.0
        for r in runs:
            share = r["layers"].get(layer, 0) / r["samples"] if r["samples"] else 0.0
            us = share * r["api_cpu_us_per_event"]
            cells.append(f" {us:6.1f}us {share:6.1%}")
            us_sum += us
            share_sum += share
        pooled[layer] = {"us_per_event": round(us_sum / len(runs), 2), "share": round(share_sum / len(runs), 4)}
        print(f"{layer:74s}" + "".join(cells) + f" {us_sum / len(runs):6.1f}us {share_sum / len(runs):6.1%}")
    print(f"{'API process CPU per event (/proc)':74s}" + "".join(f" {r['api_cpu_us_per_event']:6.1f}us {'':7s}" for r in runs)
          + f" {sum(r['api_cpu_us_per_event'] for r in runs) / len(runs):6.1f}us")
    for r in runs:
        g = r.get("gc")
        print(f"{os.path.basename(r['run'])}: {r['date']}, load {[round(x, 2) for x in r['loadavg']]}, "
              f"{r['events_s']} events/s, {r['events']} events, {r['samples']} API samples, p99 ITL {r['p99_itl_ms']} ms, "
              f"API CPU {r['api_cpu_us_per_event']} us/event of which kernel {r['api_cpu_system_us_per_event']}"
              + (f"; GC (inside the rows) {g['us_per_event']} us/event: gen0/1/2 {g['collections']} "
                 f"collections, {g['cpu_s']} CPU s" if g else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "pooled": pooled, "argv": sys.argv[1:]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
