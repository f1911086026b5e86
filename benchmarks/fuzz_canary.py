"""The issue-33 pass of ``benchmarks/fuzz_http.py``: the cases of ``benchmarks/fuzz_cases.py``
sent one after another to a server while a canary client sends a small completion beside
them; it counts 5xx answers, engine-core deaths (a PID change, or an answer saying
``engine_dead``), hangs and dropped connections, and measures the canary's latency (with the
same canary alone first as the peer)."""

from __future__ import annotations

import collections
import math
import shutil
import threading
import time

import httpx

from benchmarks.fuzz_cases import CLASSES, encode


def engine_core_pids(server_pid: int) -> set[int]:
    """The PIDs of the server's engine-core processes (children running ``core_proc``)."""
    from rlserve.proc_state import child_processes

    return {p for p, argv in child_processes(server_pid) if any(b"core_proc" in a for a in argv)}


class Canary:
    """A thread that sends ``{"prompt": "hi", "max_tokens": 4}`` completions back to back
    (20 ms apart) and keeps their latencies (seconds) and failures. While :attr:`paused` is set
    (the server restarts) it sends nothing and a failure does not count; :attr:`url` may change."""

    def __init__(self, url: str, headers: dict):
        self.url, self.headers = url, headers
        self.latencies: list[float] = []
        self.started: list[float] = []  # time.monotonic() at each latency's request
        self.failures: list[str] = []
        self.paused = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.paused.is_set():
                self._stop.wait(0.1)
                continue
            url = self.url
            t0 = time.monotonic()
            try:
                r = httpx.post(url + "/v1/completions", headers=self.headers, timeout=60,
                               json={"prompt": "hi", "max_tokens": 4, "temperature": 0})
                if r.status_code == 200:
                    self.latencies.append(time.monotonic() - t0)
                    self.started.append(t0)
                elif not self.paused.is_set():
                    self.failures.append(f"{r.status_code} {r.text[:200]}")
            except httpx.HTTPError as e:
                if not self.paused.is_set():
                    self.failures.append(type(e).__name__)
            self._stop.wait(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(120)

    def percentile(self, q: float) -> float | None:
        """The ``q`` quantile (0..1, nearest rank) of the latencies, seconds."""
        if not self.latencies:
            return None
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def _latency(c: Canary) -> dict:
    ms = lambda x: None if x is None else round(1000 * x, 1)  # noqa: E731
    return {"p50_ms": ms(c.percentile(0.5)), "p99_ms": ms(c.percentile(0.99)), "max_ms": ms(max(c.latencies, default=None)),
            "n": len(c.latencies), "failures": c.failures[:20]}


def issue33_pass(srv, model: str, classes: list[str] | list[tuple], headers: dict, timeout: float,
                 log_prefix: str, baseline_s: float = 15.0, max_restarts: int = 15, server_pid: int | None = None) -> dict:
    """Send every case of ``classes`` (``benchmarks/fuzz_cases.py``) to ``srv`` (a
    :class:`~rlserve.server.testing.ServerProcess`, or any object with ``url``) beside a
    :class:`Canary` (first ``baseline_s`` seconds of the canary alone: its latency without the
    fuzz; ``classes`` may also be the cases themselves). ``server_pid``: the process whose
    engine-core children are watched (default ``srv.proc.pid``; an in-process server passes its
    own). After an engine death, or a hang with ``/health`` unanswered, the server is
    restarted and the cases go on (at most ``max_restarts`` times, then the pass stops); the
    log of each server life that ended so is kept as ``<log_prefix>-life-<n>.log``.
    Returns {"sent", "statuses", "5xx", "deaths", "hangs", "dropped" (connections closed without
    an answer), "restarts", "not_sent", "canary": {p50_ms, p99_ms, max_ms, n, failures},
    "canary_alone": the same, "slowest": [(seconds, case), ...], "canary_slowest": [(ms, the case in
    flight), ...]}."""
    statuses: collections.Counter = collections.Counter()
    fivexx, deaths, hangs, took, dropped = [], [], [], [], []
    spans = []  # (start, end, case) of every case sent
    server_pid = server_pid or srv.proc.pid
    pids = engine_core_pids(server_pid)
    cases = [c for name in classes for c in CLASSES[name](model)] if classes and isinstance(classes[0], str) \
        else list(classes)
    restarts, not_sent = 0, 0
    with Canary(srv.url, headers) as alone:  # the peer: the same canary with no fuzz beside it
        time.sleep(baseline_s)
    with Canary(srv.url, headers) as canary:
        for k, (cls, method, path, body) in enumerate(cases):
            what = f"[{cls}] {method} {path} {repr(body)[:160]}"
            h = dict(headers)
            raw = encode(body)
            if raw is not None:
                h["content-type"] = "application/json"
            t0 = time.monotonic()
            broken = False
            try:
                r = httpx.request(method, srv.url + path, headers=h, content=raw, timeout=timeout)
            except httpx.TimeoutException:
                hangs.append(f"{what}: no answer within {timeout:.0f} s")
                try:
                    broken = httpx.get(srv.url + "/health", timeout=5).status_code != 200
                except httpx.HTTPError:
                    broken = True
                r = None
            except httpx.HTTPError as e:  # the server closed the connection without an answer
                statuses[type(e).__name__] += 1
                dropped.append(f"{what}: {type(e).__name__}")
                r = None
            spans.append((t0, time.monotonic(), what))
            if r is not None:
                took.append((time.monotonic() - t0, what))
                statuses[r.status_code] += 1
                if r.status_code >= 500:
                    fivexx.append(f"{what} -> {r.status_code} {r.text[:300]}")
                now = engine_core_pids(server_pid)
                if now != pids or "engine_dead" in r.text:
                    deaths.append(f"{what}: engine-core PIDs {sorted(pids)} -> {sorted(now)}; {r.text[:200]}")
                    broken = True
            if broken:
                if restarts == max_restarts:
                    not_sent = len(cases) - k - 1
                    break
                restarts += 1
                canary.paused.set()
                srv.stop()
                shutil.copy(srv.log_path, f"{log_prefix}-life-{restarts}.log")
                srv.start()
                canary.url = srv.url
                server_pid = srv.proc.pid
                pids = engine_core_pids(server_pid)
                canary.paused.clear()
    return {"sent": sum(statuses.values()), "statuses": dict(statuses), "5xx": fivexx, "deaths": deaths,
            "hangs": hangs, "dropped": dropped, "restarts": restarts, "not_sent": not_sent,
            "canary": _latency(canary), "canary_alone": _latency(alone),
            "slowest": [(round(t, 2), w) for t, w in sorted(took, reverse=True)[:10]],
            "canary_slowest": _slowest_canaries(canary, spans)}


def _slowest_canaries(canary: Canary, spans: list, n: int = 8) -> list[tuple[float, str]]:
    """The ``n`` slowest canary requests (ms) with the fuzz case that was in flight when each
    started (or ``-`` between cases)."""
    out = []
    for lat, t0 in sorted(zip(canary.latencies, canary.started), reverse=True)[:n]:
        case = next((w for a, b, w in spans if a <= t0 <= b), "-")
        out.append((round(1000 * lat, 1), case))
    return out
