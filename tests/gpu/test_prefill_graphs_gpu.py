"""Piecewise prefill CUDA graphs (``rlserve.engine.worker.prefill_graphs``) captured and replayed on a CUDA GPU,
float32, with the engine's defaults there (Triton attention, CUDA-graph decode, overlapped scheduling): the CPU
tests' schedules (tests/test_prefill_graphs.py: whole prompts whose steps fit a bucket or not, 20-token chunks,
mixed steps with a prefix-cache hit) on the real capture. Greedy tokens equal the eager-prefill engine's and
Hugging Face's; logprobs within the CPU tests' ``LP_ATOL``.

Session 19's version of this test ran a staggered schedule that packs every step to the 64-token budget, past its
largest bucket (48), so no step could replay (found in session 20 on the CPU's emulated graphs: steps of 64 x 7 and
one of 49); these schedules have steps below and above the buckets by construction."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from tests.test_prefill_graphs import check_greedy_equals_hf_and_eager, check_mixed_steps_and_prefix_hits  # noqa: E402


@pytest.mark.parametrize("chunked", [False, True])
def test_prefill_graphs_equal_eager_and_hf(tiny_model, monkeypatch, chunked):
    check_greedy_equals_hf_and_eager(tiny_model("qwen3"), chunked, monkeypatch, device="cuda")


def test_prefill_graphs_mixed_steps_and_prefix_hits(tiny_model, monkeypatch):
    check_mixed_steps_and_prefix_hits(tiny_model("qwen3"), monkeypatch, device="cuda")
