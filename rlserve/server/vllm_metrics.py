"""The ``vllm:`` series of ``GET /metrics``: vLLM 0.32's names, help texts, labels
(``model_name`` and ``engine``), buckets and semantics (``vllm/v1/metrics/loggers.py``'s
``PrometheusStatLogger``, buckets from ``vllm/v1/metrics/buckets.py``), so that vLLM's
dashboards read rlserve unchanged. rlserve's replicas are summed into one ``engine="0"``.

Per request (one observation per sample, as vLLM counts each of ``n`` samples as a request;
every sample of a request observes the request's times): ``request_queue_time_seconds``
(arrival to the first prefill step), ``request_prefill_time_seconds`` (first prefill step to
first token), ``request_decode_time_seconds`` (first token to last), ``request_inference_time_seconds``
(first prefill step to last token), ``request_params_max_tokens``; once per request:
``request_params_n``, ``time_to_first_token_seconds``, ``e2e_request_latency_seconds``,
``request_time_per_output_token_seconds``, ``request_prompt_tokens`` /
``request_generation_tokens``; per sample ``request_success{finished_reason}``; inter-token
latency per gap (a request's mean gap). Per engine step, as vLLM's ``iteration_stats``:
``generation_tokens_total`` (every token made, when its step's output reaches the API process;
requests that are not streamed every ``engine_core.PROGRESS_EVERY_S``), ``prompt_tokens_total`` (a
request's prompt once, with its first token: not again after a preemption's recompute, as vLLM's
``PrefillStats``), added by ``ServerMetrics.add_tokens``. From the engines' stats: ``iteration_tokens_total``
(tokens per engine step), ``prompt_tokens_cached`` (prompt tokens served from the prefix
cache), ``num_preemptions``, ``prefix_cache_queries`` / ``_hits``; gauges ``num_requests_running``,
``num_requests_waiting`` (held requests included), ``kv_cache_usage_perc``,
``engine_sleep_state{sleep_state}`` (``awake`` 1 while awake; asleep: ``weights_offloaded`` 1
at level 1, ``discard_all`` 1 at level 2), ``cache_config_info`` (1, the cache configuration in
its labels, as vLLM's ``CacheConfig.metrics_info`` renders the values: ``str()``).
Process metrics (``process_*``: CPU seconds, memory, open files) come from prometheus-client's
process collector, with its ``python_info`` and ``python_gc_*`` as on vLLM's default registry (not with
``--api-server-count`` N > 1, where ``/metrics`` is the processes' aggregate: :mod:`rlserve.server.metrics_mp`).
"""

from __future__ import annotations

import bisect
import threading

from prometheus_client import (CollectorRegistry, Counter, GCCollector, Gauge, Histogram, PlatformCollector,
                               ProcessCollector)
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from rlserve.engine.core.iteration_tokens import ITERATION_TOKENS_BUCKETS

# vLLM 0.32's buckets (vllm/v1/metrics/buckets.py)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                               20.0, 40.0, 80.0)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
ENGINE = "0"
#: vLLM 0.32's ``FinishReason`` strings (``vllm/v1/engine/__init__.py``)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


def request_tokens_buckets(max_model_len: int) -> list[int]:
    """vLLM's ``request_tokens`` family: 1, 2, 5, 10, 20, 50, ... up to ``max_model_len``."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(m * scale)
        scale *= 10


class _WeightedHistogram:
    """A one-label-set histogram whose ``observe(value, count)`` adds ``count`` observations of
    ``value`` in O(log buckets) (``count`` inter-token gaps of one request at its mean gap)."""

    def __init__(self, name: str, doc: str, labels: list[str], values: list[str], buckets: tuple):
        self.name, self.doc, self.labels, self.values = name, doc, labels, values
        self.bounds = list(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float, count: int = 1) -> None:
        i = bisect.bisect_left(self.bounds, value)
        with self._lock:
            self.counts[i] += count
            self.sum += value * count

    def collect(self):
        with self._lock:
            counts, total = list(self.counts), self.sum
        yield _histogram(self.name, self.doc, self.labels, self.values, self.bounds, counts, total)


class _FileWeightedHistogram:
    """:class:`_WeightedHistogram`'s ``observe(value, count)`` on a ``Histogram`` whose values live in
    this process's multiprocess file (``--api-server-count`` N > 1, :mod:`rlserve.server.metrics_mp`:
    a custom collector would not be aggregated). The bucket values there are per bucket (the
    collector accumulates them), so one bucket and the sum get ``count`` observations' worth."""

    def __init__(self, name: str, doc: str, labels: list[str], values: list[str], buckets: tuple):
        self.child = Histogram(name, doc, labels, buckets=buckets, registry=None).labels(*values)
        self.bounds = list(buckets)

    def observe(self, value: float, count: int = 1) -> None:
        self.child._sum.inc(value * count)
        self.child._buckets[bisect.bisect_left(self.bounds, value)].inc(count)  # (the last one: +Inf)


def _histogram(name, doc, labels, values, bounds, counts, total) -> HistogramMetricFamily:
    """A histogram family from per-bucket (not cumulative) ``counts``, the last one +Inf."""
    cum, acc = [], 0
    for bound, c in zip(list(bounds) + [float("inf")], counts):
        acc += c
        cum.append(("+Inf" if bound == float("inf") else repr(float(bound)), acc))
    fam = HistogramMetricFamily(name, doc, labels=labels)
    fam.add_metric(values, cum, sum_value=total)
    return fam


class _EngineSnapshot:
    """The series whose totals the engines keep: counters and the iteration-tokens histogram,
    read from the last ``stats()`` snapshot (numbers summed over replicas)."""

    COUNTERS = {  # stats key -> (name without _total, help)
        "num_preemptions": ("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
        "prefix_cache_query_tokens": ("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens."),
        "prefix_cache_hit_tokens": ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    }

    def __init__(self, labels: list[str], values: list[str]):
        self.labels, self.values = labels, values
        self.stats: dict = {}

    def collect(self):
        s = self.stats
        for key, (name, doc) in self.COUNTERS.items():
            fam = CounterMetricFamily(name, doc, labels=self.labels)
            fam.add_metric(self.values, float(s.get(key, 0)))
            yield fam
        fam = CounterMetricFamily("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
                                  labels=self.labels)
        fam.add_metric(self.values, float(s.get("prefix_cache_hit_tokens", 0)))
        yield fam
        counts = [s.get(f"iteration_tokens_le_{b}", 0) for b in ITERATION_TOKENS_BUCKETS] + [
            s.get("iteration_tokens_le_inf", 0)]
        yield _histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", self.labels,
                         self.values, ITERATION_TOKENS_BUCKETS, counts, float(s.get("iteration_tokens_sum", 0)))


class VllmMetrics:
    """vLLM's series on ``registry`` for one served model (see the module's docstring).
    ``multiprocess``: ``--api-server-count`` N > 1 (:mod:`rlserve.server.metrics_mp`): the value
    metrics are not registered (``registry`` reads their files), gauges have vLLM's
    ``multiprocess_mode`` ("mostrecent"), no process / platform / GC collectors (as vLLM's)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int, multiprocess: bool = False):
        r = registry
        vr = None if multiprocess else r  # where the value metrics register
        lbl = ["model_name", "engine"]
        self.values = [model_name, ENGINE]
        token_buckets = request_tokens_buckets(max_model_len)

        def hist(name, doc, buckets):
            return Histogram(name, doc, lbl, buckets=buckets, registry=vr).labels(*self.values)

        def gauge(name, doc, labels=lbl):
            return Gauge(name, doc, labels, registry=vr, multiprocess_mode="mostrecent")

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.").labels(
            *self.values)
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.").labels(
            *self.values)
        self.kv = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.").labels(*self.values)
        self.sleep_state = gauge("vllm:engine_sleep_state",
                                 "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
                                 "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level "
                                 "2.", lbl + ["sleep_state"])
        self.set_sleep_state(False, 0)
        self.cache_info = None  # made once the engines report their KV-cache size (set_cache_config)
        self._gauge = gauge
        self.prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", lbl,
                              registry=vr).labels(*self.values)
        self.gen = Counter("vllm:generation_tokens", "Number of generation tokens processed.", lbl,
                           registry=vr).labels(*self.values)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               lbl + ["finished_reason"], registry=vr)
        # vLLM creates one per FinishReason at start; {reason: child}
        self._success = {reason: self.success.labels(*self.values, reason) for reason in FINISH_REASONS}
        self.req_prompt = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.req_gen = hist("vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets)
        self.params_n = hist("vllm:request_params_n", "Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS)
        self.params_max_tokens = hist("vllm:request_params_max_tokens",
                                      "Histogram of the max_tokens request parameter.", token_buckets)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TIME_TO_FIRST_TOKEN_BUCKETS)
        itl = ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", lbl, self.values,
               INTER_TOKEN_LATENCY_BUCKETS)
        self.itl = _FileWeightedHistogram(*itl) if multiprocess else _WeightedHistogram(*itl)
        if not multiprocess:
            r.register(self.itl)
        self.tpot = hist("vllm:request_time_per_output_token_seconds",
                         "Histogram of time_per_output_token_seconds per request.", INTER_TOKEN_LATENCY_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        REQUEST_LATENCY_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                          REQUEST_LATENCY_BUCKETS)
        self.inference = hist("vllm:request_inference_time_seconds",
                              "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds",
                            "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                           REQUEST_LATENCY_BUCKETS)
        self.snapshot = _EngineSnapshot(lbl, self.values)
        r.register(self.snapshot)
        if not multiprocess:  # (per process: vLLM's multiprocess registry has none either)
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)
            GCCollector(registry=r)

    def record_request(self, finish_reasons: list, prompt_tokens: int, generation_tokens: int, e2e_s, ttft_s,
                       decode_s, sample_tokens: list[int] | None, n: int | None = None, max_tokens: int | None = None,
                       timing: tuple | None = None) -> None:
        """One finished request: see :meth:`rlserve.server.metrics.ServerMetrics.record_request` (the
        token counters: ``ServerMetrics.add_tokens``).
        ``timing``: ``(arrival, scheduled, first_token, last_token)`` ``time.monotonic()`` seconds
        (None where unknown) for the phase histograms."""
        self.req_prompt.observe(prompt_tokens)
        self.req_gen.observe(generation_tokens)
        for fr in finish_reasons:
            fr = fr or "abort"
            child = self._success.get(fr)
            if child is None:  # (looked up once per reason: labels() checks and locks on every call)
                child = self._success[fr] = self.success.labels(*self.values, fr)
            child.inc()
        if e2e_s is not None:
            self.e2e.observe(e2e_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if n is not None:
            self.params_n.observe(n)
        samples = len(finish_reasons)
        if max_tokens is not None:
            for _ in range(samples):
                self.params_max_tokens.observe(max_tokens)
        if timing is not None:
            arrival, scheduled, first, last = timing
            phases = ((self.queue, arrival, scheduled), (self.prefill, scheduled, first), (self.decode, first, last),
                      (self.inference, scheduled, last))
            for hist_, start, end in phases:
                if start is not None and end is not None:
                    for _ in range(samples):
                        hist_.observe(max(end - start, 0.0))
        longest = max(sample_tokens) if sample_tokens else 0
        if decode_s is not None and longest > 1 and decode_s >= 0:
            per_token = decode_s / (longest - 1)  # the samples of one request advance together
            self.tpot.observe(per_token)
            self.itl.observe(per_token, sum(max(k - 1, 0) for k in sample_tokens))

    def set_sleep_state(self, sleeping: bool, level: int) -> None:
        """vLLM's ``record_sleep_state``: ``awake`` 1 while awake, else ``weights_offloaded`` (level
        1) or ``discard_all`` (level 2) 1."""
        values = {"awake": 0 if sleeping else 1, "weights_offloaded": int(sleeping and level == 1),
                  "discard_all": int(sleeping and level == 2)}
        for state, v in values.items():
            self.sleep_state.labels(*self.values, state).set(v)

    def set_cache_config(self, info: dict) -> None:
        """``vllm:cache_config_info``: 1 with ``info`` (``{field: str(value)}``) and ``engine`` as
        labels; set once (vLLM sets it when the engine is initialized)."""
        if self.cache_info is None:
            labels = dict(info, engine=ENGINE)
            self.cache_info = self._gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                          list(labels))
            self.cache_info.labels(**labels).set(1)

    def refresh(self, stats: dict, sleep: dict | None) -> None:
        """The gauges and engine counters from the engines' ``stats`` snapshot and sleep mode's
        state (None without ``--enable-sleep-mode``: always awake)."""
        self.running.set(stats.get("num_running", 0))
        self.waiting.set(stats.get("num_waiting", 0) + stats.get("num_held", 0))
        self.kv.set(stats.get("kv_cache_usage", 0.0))
        self.snapshot.stats = stats
        if sleep is not None:
            self.set_sleep_state(bool(sleep["is_sleeping"]), int(sleep["level"]))
