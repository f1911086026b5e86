"""Prometheus metrics (``GET /metrics``), on a registry of their own (several servers can
live in one process, e.g. in tests).

Names (prefix ``rlserve_``): ``requests_total{endpoint}`` (finished requests, one per
prompt), ``sequences_finished_total{finish_reason}`` (one per sample),
``prompt_tokens_total``, ``generation_tokens_total``, ``request_errors_total{status}``,
``e2e_request_latency_seconds`` and ``time_to_first_token_seconds`` (histograms, seconds),
``num_requests_running``, ``num_requests_waiting`` (engine queues), ``num_requests_held``
(held by a pause), ``num_requests_unfinished`` (accepted, not finished: engines + held;
live), ``kv_cache_usage_perc`` (0..1), ``is_paused``, ``weight_version_info``
(info: ``version``) and ``weight_version`` (the version as a number when it is one, else
-1), ``prefix_cache_hit_tokens_total``/``prefix_cache_query_tokens_total``.

vLLM's names too (prefix ``vllm:``, label ``model_name``), so vLLM dashboards work unchanged:
``num_requests_running``, ``num_requests_waiting``, ``kv_cache_usage_perc`` (gauges),
``prompt_tokens_total``, ``generation_tokens_total``, ``request_success_total{finished_reason}``,
``num_preemptions_total``, ``prefix_cache_queries_total``, ``prefix_cache_hits_total``
(counters, tokens; and ``rlserve_engine_steps_total``, forward steps), ``time_to_first_token_seconds``, ``e2e_request_latency_seconds``,
``inter_token_latency_seconds``, ``request_time_per_output_token_seconds``,
``request_prompt_tokens``, ``request_generation_tokens`` (histograms). Inter-token latency is
measured per request as (last token - first token) / (tokens - 1) and observed once per gap.

Weight sync (prefix ``rlserve_``): ``weight_sync_duration_seconds{backend,mode}`` (histogram,
start to commit of each successful update, ``mode`` the staging: none | device | host),
``weight_sync_bytes_total{backend,mode}``, ``weight_syncs_total{backend,mode}``,
``weight_sync_failures_total{backend,mode}``, ``generation_paused_seconds_total`` (the stall:
seconds generation was paused, by weight syncs or operators) and ``weight_version_number``.

Sleep mode (``--enable-sleep-mode``; gauges, prefix ``rlserve_``): ``is_sleeping`` (1 while any
region sleeps), ``sleep_level`` (0 awake, 1, 2), ``sleep_bytes_discarded`` (bytes of the
sleeping regions, their contents offloaded or dropped, all replicas and TP ranks),
``sleep_bytes_released`` (of those, the device bytes given back to the driver now; 0 on the CPU,
where the memory stays allocated), ``sleep_region_bytes{tag}`` (bytes of the
``weights`` / ``kv_cache`` regions while awake), ``sleeps_total``, ``wake_ups_total``,
``sleep_last_seconds{op}`` (``sleep`` / ``wake_up``: the last one's duration).
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
import bisect
import threading

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported)

prometheus_client.disable_created_metrics()  # no *_created series: they double the output

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
# vLLM's buckets for inter-token latency / time per output token (seconds)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_SYNC_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0)


class _WeightedHistogram:
    """A one-label-set histogram whose ``observe(value, count)`` adds ``count`` observations of
    ``value`` in O(log buckets) (``count`` inter-token gaps of one request at its mean gap)."""

    def __init__(self, name: str, doc: str, model_name: str, buckets: tuple):
        self.name, self.doc, self.model_name = name, doc, model_name
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
            cum, acc = [], 0
            for bound, c in zip(self.bounds + [float("inf")], self.counts):
                acc += c
                cum.append(("+Inf" if bound == float("inf") else repr(float(bound)), acc))
            total = self.sum
        fam = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        fam.add_metric([self.model_name], cum, sum_value=total)
        yield fam


class _SnapshotCounters:
    """Counters whose totals the engines keep (read from the last ``stats()`` snapshot)."""

    def __init__(self, model_name: str, names: dict[str, tuple[str, str]]):
        self.model_name = model_name
        self.names = names  # stats key -> (metric name without _total, help)
        self.values: dict[str, float] = {}

    def collect(self):
        for key, (name, doc) in self.names.items():
            fam = CounterMetricFamily(name, doc, labels=["model_name"])
            fam.add_metric([self.model_name], float(self.values.get(key, 0)))
            yield fam


class ServerMetrics:
    """All metrics of one server. Recording methods take seconds and token counts."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r = self.registry
        lbl = ["model_name"]
        self.model_name = model_name
        self.requests = Counter("rlserve_requests", "Finished generation requests (one per prompt).",
                                lbl + ["endpoint"], registry=r)
        self.sequences = Counter("rlserve_sequences_finished", "Finished samples (n per request), by finish reason.",
                                 lbl + ["finish_reason"], registry=r)
        self.errors = Counter("rlserve_request_errors", "Requests answered with an error.", lbl + ["status"],
                              registry=r)
        self.prompt_tokens = Counter("rlserve_prompt_tokens", "Prompt tokens of finished requests.", lbl,
                                     registry=r)
        self.generation_tokens = Counter("rlserve_generation_tokens", "Generated tokens.", lbl, registry=r)
        self.e2e = Histogram("rlserve_e2e_request_latency_seconds", "Arrival to last token, seconds.", lbl,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("rlserve_time_to_first_token_seconds", "Arrival to first token, seconds.", lbl,
                              buckets=_TTFT_BUCKETS, registry=r)
        self.running = Gauge("rlserve_num_requests_running", "Sequences running in the engines.", lbl, registry=r)
        self.waiting = Gauge("rlserve_num_requests_waiting", "Sequences waiting in the engines.", lbl, registry=r)
        self.held = Gauge("rlserve_num_requests_held", "Requests held while generation is paused.", lbl,
                          registry=r)
        self.unfinished = Gauge("rlserve_num_requests_unfinished",
                                "Requests accepted and not finished (in the engines or held), live.", lbl, registry=r)
        self.kv_usage = Gauge("rlserve_kv_cache_usage_perc", "KV-cache blocks in use (0..1).", lbl, registry=r)
        self.paused = Gauge("rlserve_is_paused", "1 while generation is paused.", lbl, registry=r)
        self.prefix_hits = Gauge("rlserve_prefix_cache_hit_tokens_total", "Prompt tokens served from the prefix cache.",
                                 lbl, registry=r)
        self.prefix_queries = Gauge("rlserve_prefix_cache_query_tokens_total",
                                    "Prompt tokens looked up in the prefix cache.", lbl, registry=r)
        self.sleeping = Gauge("rlserve_is_sleeping", "1 while any sleep-mode region sleeps.", lbl, registry=r)
        self.sleep_level = Gauge("rlserve_sleep_level", "Level of the sleep in force (0: awake).", lbl, registry=r)
        self.sleep_released = Gauge("rlserve_sleep_bytes_released",
                                    "Device bytes sleep mode has given back to the driver now (0 on CPU).", lbl,
                                    registry=r)
        self.sleep_discarded = Gauge("rlserve_sleep_bytes_discarded",
                                     "Bytes of the regions asleep now (contents offloaded or dropped).", lbl,
                                     registry=r)
        self.sleep_region = Gauge("rlserve_sleep_region_bytes", "Device bytes of a sleep-mode region while awake.",
                                  lbl + ["tag"], registry=r)
        self.sleeps = Gauge("rlserve_sleeps_total", "Sleeps since start.", lbl, registry=r)
        self.wake_ups = Gauge("rlserve_wake_ups_total", "wake_up calls that woke something, since start.", lbl,
                              registry=r)
        self.sleep_last = Gauge("rlserve_sleep_last_seconds", "Duration of the last sleep / wake_up, seconds.",
                                lbl + ["op"], registry=r)
        self.version_info = Info("rlserve_weight_version", "Weight version being served.", registry=r)
        self.version_num = Gauge("rlserve_weight_version_number",
                                 "Weight version as a number (-1 when it is not numeric).", lbl, registry=r)
        # vLLM's names
        self.v_running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", lbl,
                               registry=r)
        self.v_waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", lbl,
                               registry=r)
        self.v_kv = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lbl, registry=r)
        self.v_prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", lbl, registry=r)
        self.v_gen = Counter("vllm:generation_tokens", "Number of generation tokens processed.", lbl, registry=r)
        self.v_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                 lbl + ["finished_reason"], registry=r)
        self.v_ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                lbl, buckets=_TTFT_BUCKETS, registry=r)
        self.v_e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                               lbl, buckets=_LATENCY_BUCKETS, registry=r)
        self.v_itl = _WeightedHistogram("vllm:inter_token_latency_seconds",
                                        "Histogram of inter-token latency in seconds.", model_name, _ITL_BUCKETS)
        r.register(self.v_itl)
        self.v_tpot = Histogram("vllm:request_time_per_output_token_seconds",
                                "Histogram of time_per_output_token_seconds per request.", lbl, buckets=_ITL_BUCKETS,
                                registry=r)
        self.v_req_prompt = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", lbl,
                                      buckets=_TOKEN_BUCKETS, registry=r)
        self.v_req_gen = Histogram("vllm:request_generation_tokens", "Number of generation tokens processed.", lbl,
                                   buckets=_TOKEN_BUCKETS, registry=r)
        self.v_engine_counters = _SnapshotCounters(model_name, {
            "num_preemptions": ("vllm:num_preemptions", "Cumulative number of preemptions from the engine."),
            "prefix_cache_query_tokens": ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                                                                       "queried tokens."),
            "prefix_cache_hit_tokens": ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                                                                  "tokens."),
            "steps": ("rlserve_engine_steps", "Forward steps run by the engines (frozen while paused in keep mode)."),
        })
        r.register(self.v_engine_counters)
        # weight sync
        sync = lbl + ["backend", "mode"]
        self.sync_seconds = Histogram("rlserve_weight_sync_duration_seconds",
                                      "Successful weight updates: start to commit, seconds.", sync,
                                      buckets=_SYNC_BUCKETS, registry=r)
        self.sync_bytes = Counter("rlserve_weight_sync_bytes", "Bytes received by successful weight updates.", sync,
                                  registry=r)
        self.syncs = Counter("rlserve_weight_syncs", "Successful weight updates.", sync, registry=r)
        self.sync_failures = Counter("rlserve_weight_sync_failures", "Failed weight updates.", sync, registry=r)
        self.paused_seconds = Counter("rlserve_generation_paused_seconds",
                                      "Seconds generation was paused (weight syncs, operators): the stall.", lbl,
                                      registry=r)
        self._paused_seen = 0.0

    def record_request(self, endpoint: str, finish_reasons: list, prompt_tokens: int, generation_tokens: int,
                       e2e_s: float | None, ttft_s: float | None, decode_s: float | None = None,
                       sample_tokens: list[int] | None = None) -> None:
        """One finished request (all its samples): token counts, latencies in seconds
        (``decode_s``: first token to last token and ``sample_tokens``: tokens per sample, for
        inter-token latency)."""
        m = self.model_name
        self.requests.labels(m, endpoint).inc()
        for fr in finish_reasons:
            self.sequences.labels(m, fr or "none").inc()
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(generation_tokens)
        if e2e_s is not None:
            self.e2e.labels(m).observe(e2e_s)
        if ttft_s is not None:
            self.ttft.labels(m).observe(ttft_s)
        self.v_prompt.labels(m).inc(prompt_tokens)
        self.v_gen.labels(m).inc(generation_tokens)
        self.v_req_prompt.labels(m).observe(prompt_tokens)
        self.v_req_gen.labels(m).observe(generation_tokens)
        for fr in finish_reasons:
            self.v_success.labels(m, fr or "abort").inc()
        if e2e_s is not None:
            self.v_e2e.labels(m).observe(e2e_s)
        if ttft_s is not None:
            self.v_ttft.labels(m).observe(ttft_s)
        longest = max(sample_tokens) if sample_tokens else 0
        if decode_s is not None and longest > 1 and decode_s >= 0:
            per_token = decode_s / (longest - 1)  # the samples of one request advance together
            self.v_tpot.labels(m).observe(per_token)
            self.v_itl.observe(per_token, sum(max(k - 1, 0) for k in sample_tokens))

    def record_weight_sync(self, entry: dict) -> None:
        """One recorded weight update (``WeightTransferManager.last_update``'s dict: ``ok``,
        ``backend``, ``staging``, ``total_seconds``, ``bytes``)."""
        labels = (self.model_name, str(entry.get("backend") or "unknown"), str(entry.get("staging") or "none"))
        if not entry.get("ok"):
            self.sync_failures.labels(*labels).inc()
            return
        self.syncs.labels(*labels).inc()
        if entry.get("total_seconds") is not None:
            self.sync_seconds.labels(*labels).observe(float(entry["total_seconds"]))
        if entry.get("bytes"):
            self.sync_bytes.labels(*labels).inc(float(entry["bytes"]))

    def record_error(self, status: int) -> None:
        self.errors.labels(self.model_name, str(status)).inc()

    def render(self, aengine, sleep: dict | None = None) -> bytes:
        """Refresh the gauges from ``aengine`` (and ``sleep``, sleep mode's state: AsyncSleep.info)
        and return the exposition text."""
        m = self.model_name
        if sleep is not None:
            self.sleeping.labels(m).set(1 if sleep["is_sleeping"] else 0)
            self.sleep_level.labels(m).set(sleep["level"])
            self.sleep_released.labels(m).set(sleep["bytes_released"])
            self.sleep_discarded.labels(m).set(sleep["bytes_discarded"])
            for tag, n in sleep["bytes"].items():
                self.sleep_region.labels(m, tag).set(n)
            self.sleeps.labels(m).set(sleep["sleeps"])
            self.wake_ups.labels(m).set(sleep["wake_ups"])
            for op in ("sleep", "wake_up"):
                if sleep.get(f"last_{op}_s") is not None:
                    self.sleep_last.labels(m, op).set(sleep[f"last_{op}_s"])
        stats = aengine.stats()
        self.running.labels(m).set(stats.get("num_running", 0))
        self.waiting.labels(m).set(stats.get("num_waiting", 0))
        self.held.labels(m).set(stats.get("num_held", 0))
        self.unfinished.labels(m).set(stats.get("num_unfinished", 0))
        self.kv_usage.labels(m).set(stats.get("kv_cache_usage", 0.0))
        self.paused.labels(m).set(1 if aengine.is_paused() else 0)
        self.prefix_hits.labels(m).set(stats.get("prefix_cache_hit_tokens", 0))
        self.prefix_queries.labels(m).set(stats.get("prefix_cache_query_tokens", 0))
        self.v_running.labels(m).set(stats.get("num_running", 0))
        self.v_waiting.labels(m).set(stats.get("num_waiting", 0) + stats.get("num_held", 0))
        self.v_kv.labels(m).set(stats.get("kv_cache_usage", 0.0))
        self.v_engine_counters.values = stats
        paused = float(getattr(aengine, "paused_seconds", 0.0))
        if paused > self._paused_seen:
            self.paused_seconds.labels(m).inc(paused - self._paused_seen)
            self._paused_seen = paused
        v = aengine.weight_version
        self.version_info.info({"version": v, "model_name": m})
        try:
            self.version_num.labels(m).set(float(v))
        except ValueError:
            self.version_num.labels(m).set(-1)
        return generate_latest(self.registry)
