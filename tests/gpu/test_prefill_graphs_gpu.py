"""Piecewise prefill CUDA graphs (``RLSERVE_PREFILL_CUDA_GRAPHS``, :mod:`rlserve.engine.worker.prefill_graphs`)
captured and replayed on a CUDA GPU with the engine's defaults there (Triton attention, CUDA-graph decode,
overlapped scheduling, chunked prefill): whole prompts, chunks and mixed steps (requests arriving while
others decode) replay the graphs of their token bucket; the float32 greedy tokens equal the eager-prefill
engine's and Hugging Face's, sampled logprobs within 1e-4 (float32: the GEMMs of a padded bucket may
sum in another order, the CPU tests' tolerance against HF); a step past the largest bucket runs eagerly."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from rlserve import LLM  # noqa: E402
from tests.gpu.test_gpu_engine import hf_greedy  # noqa: E402
from tests.gpu.test_mixed_steps_gpu import KW, _prompts, _staggered  # noqa: E402
from tests.test_prefill_graphs import count_runs  # noqa: E402


@pytest.mark.parametrize("mixed", [False, True])
def test_prefill_graphs_equal_eager_and_hf(tiny_model, monkeypatch, mixed, budget=64):
    path = tiny_model("qwen3")
    prompts = _prompts()
    kw = dict(max_num_batched_tokens=budget, enable_chunked_prefill=True, mixed_prefill_decode=mixed, **KW)
    want, want_lp, _, _ = _staggered(LLM(path, **kw), prompts)
    seen = count_runs(monkeypatch)
    llm = LLM(path, extra={"prefill_cuda_graph_sizes": "16,48"}, **kw)
    graphs = llm.engine.executor.runner.prefill_graphs
    assert graphs is not None and graphs.captured and graphs.sizes == [16, 48]
    got, got_lp, kinds, _ = _staggered(llm, prompts)
    assert seen and max(seen) <= 48 and len(seen) < kinds.count("P") + kinds.count("M")  # 64-token chunks: eager
    assert got == want == hf_greedy(path, prompts, 24)
    err = max(abs(x - y) for a, b in zip(got_lp, want_lp) for x, y in zip(a, b))
    assert err <= 1e-4, f"prefill graphs moved a logprob by {err}"
