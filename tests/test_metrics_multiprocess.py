"""``/metrics`` aggregated over API processes (``--api-server-count`` N > 1, rlserve/server/metrics_mp.py):
two writer processes record known requests and gauges into one directory, a third (a scrape) reads the
aggregate: counters and histograms summed (``vllm:inter_token_latency_seconds`` too, a weighted histogram
written into a multiprocess ``Histogram``'s values), ``livesum`` gauges summed, ``mostrecent`` gauges the
newest write, no per-process ``process_*`` series. Each process is a fresh interpreter: switching
prometheus_client to multiprocess values is process-wide, so it is never done in the test process.
The real server (both processes answering the same sums) is ``tests/test_api_server_count.py``."""

from __future__ import annotations

import subprocess
import sys

from prometheus_client.parser import text_string_to_metric_families

WRITER = """
import sys
from rlserve.server.metrics import ServerMetrics
d, i = sys.argv[1], int(sys.argv[2])
m = ServerMetrics("m", 128, multiprocess_dir=d)
for _ in range(i + 1):  # process i: i + 1 requests of 3 generated tokens, 0.5 s end to end, 0.2 s of decode
    m.add_tokens(1, 4)  # the token counters as the engine steps (ServerMetrics.add_tokens): first token + prompt,
    m.add_tokens(2, 0)  # then two more
    m.record_request("completions", ["length"], 4, 3, 0.5, 0.1, decode_s=0.2, sample_tokens=[3], n=1, max_tokens=3,
                     timing=(0.0, 0.1, 0.2, 0.4))
m.set_live(i, 2 * i + 1)  # held, unfinished: this process's own
m.running.labels("m").set(10 + i)  # an engine gauge (mostrecent): process 1 writes after process 0
"""
READER = """
import sys
from prometheus_client import generate_latest
from rlserve.server.metrics import ServerMetrics
m = ServerMetrics("m", 128, multiprocess_dir=sys.argv[1])
sys.stdout.write(generate_latest(m.registry).decode())
"""


def _run(code: str, *args: str) -> str:
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_processes_values_are_aggregated(tmp_path):
    for i in (0, 1):  # one after the other: process 1's gauge write is the most recent
        _run(WRITER, str(tmp_path), str(i))
    samples = {}
    for fam in text_string_to_metric_families(_run(READER, str(tmp_path))):
        for s in fam.samples:
            key = s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items()) if k in ("le", "finished_reason"))
            samples[key] = s.value
    # 1 + 2 requests of 3 tokens
    assert samples["rlserve_requests_total"] == 3 and samples["vllm:request_success_total,finished_reason=length"] == 3
    assert samples["rlserve_generation_tokens_total"] == samples["vllm:generation_tokens_total"] == 9
    assert samples["rlserve_prompt_tokens_total"] == samples["vllm:prompt_tokens_total"] == 12
    assert samples["vllm:request_generation_tokens_count"] == 3 and samples["vllm:request_generation_tokens_sum"] == 9
    assert samples["vllm:e2e_request_latency_seconds_count"] == 3 and samples["vllm:e2e_request_latency_seconds_sum"] == 1.5
    assert samples["vllm:e2e_request_latency_seconds_bucket,le=0.5"] == 3  # (cumulative: 0.5 <= 0.5)
    assert samples["vllm:e2e_request_latency_seconds_bucket,le=0.3"] == 0
    # inter-token latency: each request 2 gaps of 0.2 / 2 s
    assert samples["vllm:inter_token_latency_seconds_count"] == 6
    assert abs(samples["vllm:inter_token_latency_seconds_sum"] - 0.6) < 1e-12  # (float sum of 0.2 three times)
    assert samples["vllm:inter_token_latency_seconds_bucket,le=0.1"] == 6
    assert samples["vllm:inter_token_latency_seconds_bucket,le=0.075"] == 0
    # livesum: each process's own; mostrecent: the newest write
    assert samples["rlserve_num_requests_held"] == 0 + 1 and samples["rlserve_num_requests_unfinished"] == 1 + 3
    assert samples["rlserve_num_requests_running"] == 11
    # per-process collectors are left out (as vLLM's multiprocess registry)
    assert not any(k.startswith(("process_", "python_")) for k in samples), sorted(samples)
