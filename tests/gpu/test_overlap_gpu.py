"""Overlapped decode (``rlserve.engine.core.overlap``) on a CUDA GPU: with CUDA graphs and the
device-side input ids, float32 greedy tokens and seeded samples equal the plain loop's."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from rlserve import LLM, SamplingParams  # noqa: E402
from tests.gpu.test_gpu_engine import KW, PROMPTS  # noqa: E402


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_overlap_equals_plain_loop_on_gpu(arch, tiny_model):
    path = tiny_model(arch)
    params = [SamplingParams(temperature=0, max_tokens=8 + 3 * i) if i % 2 else
              SamplingParams(temperature=0.8, seed=i, max_tokens=30 - i) for i in range(len(PROMPTS))]
    res = {}
    for overlap in (False, True):
        llm = LLM(path, dtype="float32", extra={"async_scheduling": overlap}, **KW)
        assert (llm.engine._overlap is not None) == overlap and llm.engine.executor.runner.cuda_graphs is not None
        res[overlap] = llm.generate(PROMPTS, params)
        del llm
        torch.cuda.empty_cache()
    for a, b in zip(res[True], res[False]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
