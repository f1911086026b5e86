"""The adversarial scripts' end check (``control_chaos.py``, ``abort_storm.py``, ``lora_churn.py``):
the request and KV-cache gauges of ``/metrics`` that must read 0 once every client is done."""

from __future__ import annotations

#: rlserve's gauges of requests in the engines / held by a pause / unfinished, and KV blocks in use
IDLE_GAUGES = ("rlserve_num_requests_running{", "rlserve_num_requests_waiting{", "rlserve_num_requests_held{",
               "rlserve_num_requests_unfinished{", "rlserve_kv_cache_usage_perc{")


def busy_gauges(metrics_text: str, show: bool = True) -> list[str]:
    """The :data:`IDLE_GAUGES` lines of a ``/metrics`` body whose value is not 0 (each printed
    first when ``show``)."""
    busy = []
    for line in metrics_text.splitlines():
        if line.startswith(IDLE_GAUGES):
            if show:
                print("  ", line)
            if float(line.rsplit(" ", 1)[1]) != 0:
                busy.append(line)
    return busy
