"""Prometheus metrics (``GET /metrics``), on a registry of their own (several servers can
live in one process, e.g. in tests).

Names (prefix ``rlserve_``): ``requests_total{endpoint}`` (finished requests, one per
prompt), ``sequences_finished_total{finish_reason}`` (one per sample),
``prompt_tokens_total``, ``generation_tokens_total`` (as vLLM's twins: per engine step, not at a
request's end: :meth:`ServerMetrics.add_tokens`), ``request_errors_total{status}``,
``e2e_request_latency_seconds`` and ``time_to_first_token_seconds`` (histograms, seconds),
``num_requests_running``, ``num_requests_waiting`` (engine queues), ``num_requests_held``
(held by a pause), ``num_requests_unfinished`` (accepted, not finished: engines + held;
live), ``kv_cache_usage_perc`` (0..1), ``is_paused``, ``weight_version_info``
(info: ``version``) and ``weight_version`` (the version as a number when it is one, else
-1), ``prefix_cache_hit_tokens_total``/``prefix_cache_query_tokens_total``.

vLLM's names too (prefix ``vllm:``, labels ``model_name`` and ``engine``), so vLLM dashboards
work unchanged: :mod:`rlserve.server.vllm_metrics` (with ``rlserve_engine_steps_total``, forward
steps, and the process collector's ``process_*``).

Weight sync (prefix ``rlserve_``): ``weight_sync_duration_seconds{backend,mode}`` (histogram,
start to commit of each successful update, ``mode`` the staging: none | device | host),
``weight_sync_bytes_total{backend,mode}``, ``weight_syncs_total{backend,mode}``,
``weight_sync_failures_total{backend,mode}``, ``generation_paused_seconds_total`` (the stall:
seconds generation was paused, by weight syncs or operators) and ``weight_version_number``.

``rlserve_api_server_info{index,count}``: which API process answered (``--api-server-count N``;
with N > 1 every other series is the N processes' aggregate: :mod:`rlserve.server.metrics_mp`).

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
from prometheus_client.core import CounterMetricFamily
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported)

from rlserve.server.vllm_metrics import VllmMetrics

prometheus_client.disable_created_metrics()  # no *_created series: they double the output

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
_SYNC_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0)


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
    """All metrics of one server. Recording methods take seconds and token counts.

    ``multiprocess_dir``: ``--api-server-count N`` > 1's shared directory (:mod:`rlserve.server.metrics_mp`:
    every process's values in files there, ``/metrics`` their aggregate); None (N = 1): in memory."""

    def __init__(self, model_name: str, max_model_len: int = 8192, multiprocess_dir: str | None = None):
        from rlserve.server import metrics_mp

        self.registry = CollectorRegistry()
        r = self.registry
        self.multiprocess = multiprocess_dir is not None
        if self.multiprocess:
            metrics_mp.enable(multiprocess_dir)
        vr = None if self.multiprocess else r  # the value metrics' registry (multiprocess: read from the files)
        lbl = ["model_name"]
        self.model_name = model_name
        self._children: dict = {}  # (metric, label values) -> its child (_child)

        def gauge(name, doc, labels=lbl, mode="mostrecent"):  # (multiprocess_mode: metrics_mp)
            return Gauge(name, doc, labels, registry=vr, multiprocess_mode=mode)

        self.requests = Counter("rlserve_requests", "Finished generation requests (one per prompt).",
                                lbl + ["endpoint"], registry=vr)
        self.sequences = Counter("rlserve_sequences_finished", "Finished samples (n per request), by finish reason.",
                                 lbl + ["finish_reason"], registry=vr)
        self.errors = Counter("rlserve_request_errors", "Requests answered with an error.", lbl + ["status"],
                              registry=vr)
        self.prompt_tokens = Counter("rlserve_prompt_tokens", "Prompt tokens, counted with each request's first "
                                     "token.", lbl, registry=vr).labels(model_name)
        self.generation_tokens = Counter("rlserve_generation_tokens", "Generated tokens, counted as they are made.",
                                         lbl, registry=vr).labels(model_name)
        self.e2e = Histogram("rlserve_e2e_request_latency_seconds", "Arrival to last token, seconds.", lbl,
                             buckets=_LATENCY_BUCKETS, registry=vr)
        self.ttft = Histogram("rlserve_time_to_first_token_seconds", "Arrival to first token, seconds.", lbl,
                              buckets=_TTFT_BUCKETS, registry=vr)
        self.running = gauge("rlserve_num_requests_running", "Sequences running in the engines.")
        self.waiting = gauge("rlserve_num_requests_waiting", "Sequences waiting in the engines.")
        self.held = gauge("rlserve_num_requests_held", "Requests held while generation is paused.", mode="livesum")
        self.unfinished = gauge("rlserve_num_requests_unfinished",
                                "Requests accepted and not finished (in the engines or held), live.", mode="livesum")
        self.kv_usage = gauge("rlserve_kv_cache_usage_perc", "KV-cache blocks in use (0..1).")
        self.paused = gauge("rlserve_is_paused", "1 while generation is paused.")
        self.prefix_hits = gauge("rlserve_prefix_cache_hit_tokens_total", "Prompt tokens served from the prefix cache.")
        self.prefix_queries = gauge("rlserve_prefix_cache_query_tokens_total",
                                    "Prompt tokens looked up in the prefix cache.")
        self.sleeping = gauge("rlserve_is_sleeping", "1 while any sleep-mode region sleeps.")
        self.sleep_level = gauge("rlserve_sleep_level", "Level of the sleep in force (0: awake).")
        self.sleep_released = gauge("rlserve_sleep_bytes_released",
                                    "Device bytes sleep mode has given back to the driver now (0 on CPU).")
        self.sleep_discarded = gauge("rlserve_sleep_bytes_discarded",
                                     "Bytes of the regions asleep now (contents offloaded or dropped).")
        self.sleep_region = gauge("rlserve_sleep_region_bytes", "Device bytes of a sleep-mode region while awake.",
                                  lbl + ["tag"])
        self.sleeps = gauge("rlserve_sleeps_total", "Sleeps since start.")
        self.wake_ups = gauge("rlserve_wake_ups_total", "wake_up calls that woke something, since start.")
        self.sleep_last = gauge("rlserve_sleep_last_seconds", "Duration of the last sleep / wake_up, seconds.",
                                lbl + ["op"])
        self.version_info = Info("rlserve_weight_version", "Weight version being served.", registry=r)
        self.api_server = Info("rlserve_api_server", "This API process: index of count (--api-server-count; "
                               "the other metrics are the N processes' aggregate).", registry=r)
        self.version_num = gauge("rlserve_weight_version_number",
                                 "Weight version as a number (-1 when it is not numeric).")
        self.vllm = VllmMetrics(r, model_name, max_model_len, multiprocess=self.multiprocess)  # vLLM's names
        self.engine_counters = _SnapshotCounters(model_name, {
            "steps": ("rlserve_engine_steps", "Forward steps run by the engines (frozen while paused in keep mode)."),
        })
        r.register(self.engine_counters)
        # weight sync
        sync = lbl + ["backend", "mode"]
        self.sync_seconds = Histogram("rlserve_weight_sync_duration_seconds",
                                      "Successful weight updates: start to commit, seconds.", sync,
                                      buckets=_SYNC_BUCKETS, registry=vr)
        self.sync_bytes = Counter("rlserve_weight_sync_bytes", "Bytes received by successful weight updates.", sync,
                                  registry=vr)
        self.syncs = Counter("rlserve_weight_syncs", "Successful weight updates.", sync, registry=vr)
        self.sync_failures = Counter("rlserve_weight_sync_failures", "Failed weight updates.", sync, registry=vr)
        self.paused_seconds = Counter("rlserve_generation_paused_seconds",
                                      "Seconds generation was paused (weight syncs, operators): the stall.", lbl,
                                      registry=vr)
        self._paused_seen = 0.0
        if self.multiprocess:
            metrics_mp.collector(r, multiprocess_dir)

    def record_request(self, endpoint: str, finish_reasons: list, prompt_tokens: int, generation_tokens: int,
                       e2e_s: float | None, ttft_s: float | None, decode_s: float | None = None,
                       sample_tokens: list[int] | None = None, n: int | None = None, max_tokens: int | None = None,
                       timing: tuple | None = None) -> None:
        """One finished request (all its samples): token counts (the per-request histograms; the token
        counters follow the engines: :meth:`add_tokens`), latencies in seconds
        (``decode_s``: first token to last token and ``sample_tokens``: tokens per sample, for
        inter-token latency), its ``n`` and ``max_tokens`` parameters, and ``timing``:
        ``(arrival, scheduled, first_token, last_token)`` ``time.monotonic()`` seconds (None where
        unknown; vLLM's request phases)."""
        m, child = self.model_name, self._child
        child(self.requests, m, endpoint).inc()
        for fr in finish_reasons:
            child(self.sequences, m, fr or "none").inc()
        if e2e_s is not None:
            child(self.e2e, m).observe(e2e_s)
        if ttft_s is not None:
            child(self.ttft, m).observe(ttft_s)
        self.vllm.record_request(finish_reasons, prompt_tokens, generation_tokens, e2e_s, ttft_s, decode_s,
                                 sample_tokens, n=n, max_tokens=max_tokens, timing=timing)

    def add_tokens(self, generation_tokens: int, prompt_tokens: int) -> None:
        """Tokens the engines made since the last call (``AsyncEngine.token_sink``: per engine step or
        core message, on a replica's delivering thread, before the outputs that hold them): generated
        tokens, and the prompts of requests whose first token came (once per request), into
        ``rlserve_`` and ``vllm:`` ``generation_tokens_total`` / ``prompt_tokens_total``. With
        ``--api-server-count`` N > 1 each process adds its own requests' tokens (its file: summed once)."""
        if generation_tokens:
            self.generation_tokens.inc(generation_tokens)
            self.vllm.gen.inc(generation_tokens)
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
            self.vllm.prompt.inc(prompt_tokens)

    def _child(self, metric, *labels):
        """``metric.labels(*labels)``, looked up once per label values (``labels()`` checks the
        values and takes a lock on every call, six times a finished request: issue 37's admission
        profile); made at first use, as ``labels()`` makes it, so a series shows once it has a value."""
        key = (metric, labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

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
        and return the exposition text (multiprocess: every API process's aggregate, metrics_mp)."""
        m = self.model_name
        if sleep is not None:
            self.set_sleep(sleep)
        stats = aengine.stats()
        self.set_live(stats.get("num_held", 0), stats.get("num_unfinished", 0))
        self.running.labels(m).set(stats.get("num_running", 0))
        self.waiting.labels(m).set(stats.get("num_waiting", 0))
        self.kv_usage.labels(m).set(stats.get("kv_cache_usage", 0.0))
        self.paused.labels(m).set(1 if aengine.is_paused() else 0)
        self.prefix_hits.labels(m).set(stats.get("prefix_cache_hit_tokens", 0))
        self.prefix_queries.labels(m).set(stats.get("prefix_cache_query_tokens", 0))
        self.vllm.refresh(stats, None)  # (the sleep state: set_sleep, above)
        if stats.get("num_kv_blocks"):
            self.vllm.set_cache_config(cache_config_info(aengine.config, stats))
        self.engine_counters.values = stats
        sync = getattr(aengine, "front_sync", None)
        paused = float(getattr(aengine, "paused_seconds", 0.0))
        if paused > self._paused_seen and not (self.multiprocess and sync is not None and sync.client_index):
            self.paused_seconds.labels(m).inc(paused - self._paused_seen)  # (multiprocess: process 0's clock)
            self._paused_seen = paused
        if sync is not None:
            self.api_server.info({"index": str(sync.client_index), "count": str(sync.count)})
        v = aengine.weight_version
        self.version_info.info({"version": v, "model_name": m})
        try:
            self.version_num.labels(m).set(float(v))
        except ValueError:
            self.version_num.labels(m).set(-1)
        return generate_latest(self.registry)

    def set_live(self, held: int, unfinished: int) -> None:
        """This process's own live counts: requests held, and unfinished (engines + held)."""
        self._child(self.held, self.model_name).set(held)
        self._child(self.unfinished, self.model_name).set(unfinished)

    def set_sleep(self, sleep: dict) -> None:
        """The sleep-mode gauges from ``sleep`` (``AsyncSleep.info()``; API process 0, which sleeps:
        at each scrape and after each sleep / wake_up, so the other processes' scrapes read it too)."""
        m = self.model_name
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
        self.vllm.set_sleep_state(bool(sleep["is_sleeping"]), int(sleep["level"]))


def cache_config_info(config, stats: dict) -> dict:
    """``vllm:cache_config_info``'s labels: the fields of vLLM's ``CacheConfig`` that rlserve
    has, as vLLM renders them (``str()``): ``num_gpu_blocks`` the KV-cache blocks of one replica
    (``stats["num_kv_blocks"]`` summed over ``num_replicas``), ``num_cpu_blocks`` "None" (no CPU
    swap space)."""
    replicas = max(int(stats.get("num_replicas", 1) or 1), 1)
    return {"block_size": str(config.block_size), "cache_dtype": str(getattr(config, "kv_cache_dtype", "auto")),
            "enable_prefix_caching": str(bool(config.enable_prefix_caching)),
            "gpu_memory_utilization": str(config.gpu_memory_utilization),
            "num_gpu_blocks": str(int(stats["num_kv_blocks"]) // replicas),
            "num_gpu_blocks_override": str(config.num_kv_blocks), "num_cpu_blocks": "None"}
