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
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported)

prometheus_client.disable_created_metrics()  # no *_created series: they double the output

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)


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
        self.version_info = Info("rlserve_weight_version", "Weight version being served.", registry=r)
        self.version_num = Gauge("rlserve_weight_version_number",
                                 "Weight version as a number (-1 when it is not numeric).", lbl, registry=r)

    def record_request(self, endpoint: str, finish_reasons: list, prompt_tokens: int, generation_tokens: int,
                       e2e_s: float | None, ttft_s: float | None) -> None:
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

    def record_error(self, status: int) -> None:
        self.errors.labels(self.model_name, str(status)).inc()

    def render(self, aengine) -> bytes:
        """Refresh the gauges from ``aengine`` and return the exposition text."""
        m = self.model_name
        stats = aengine.stats()
        self.running.labels(m).set(stats.get("num_running", 0))
        self.waiting.labels(m).set(stats.get("num_waiting", 0))
        self.held.labels(m).set(stats.get("num_held", 0))
        self.unfinished.labels(m).set(stats.get("num_unfinished", 0))
        self.kv_usage.labels(m).set(stats.get("kv_cache_usage", 0.0))
        self.paused.labels(m).set(1 if aengine.is_paused() else 0)
        self.prefix_hits.labels(m).set(stats.get("prefix_cache_hit_tokens", 0))
        self.prefix_queries.labels(m).set(stats.get("prefix_cache_query_tokens", 0))
        v = aengine.weight_version
        self.version_info.info({"version": v, "model_name": m})
        try:
            self.version_num.labels(m).set(float(v))
        except ValueError:
            self.version_num.labels(m).set(-1)
        return generate_latest(self.registry)
