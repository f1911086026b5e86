"""vLLM's ``vllm:iteration_tokens_total`` histogram: its buckets and the engine's count of one step
into them. No torch here: the API process's metrics (:mod:`rlserve.server.vllm_metrics`) read the
buckets without importing the engine's step code (:mod:`rlserve.engine.core.engine_step`, torch)."""

from __future__ import annotations

#: vLLM 0.32's ``vllm:iteration_tokens_total`` buckets (``vllm/v1/metrics/buckets.py``'s
#: ``ITERATION_TOKENS_BUCKETS``): tokens per engine step
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def count_iteration_tokens(counters: dict, n: int) -> None:
    """Count one engine step of ``n`` tokens into ``counters`` (the engine's stats, numbers
    summed over replicas): ``iteration_tokens_le_<bound>`` for the smallest bound >= ``n``
    (``iteration_tokens_le_inf`` above them all), ``iteration_tokens_sum`` and ``_count``."""
    bound = next((b for b in ITERATION_TOKENS_BUCKETS if n <= b), "inf")
    for key, add in ((f"iteration_tokens_le_{bound}", 1), ("iteration_tokens_sum", n), ("iteration_tokens_count", 1)):
        counters[key] = counters.get(key, 0) + add
