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


@pytest.mark.parametrize("mixed", [False, True])
def test_decode_after_prefill_launched_early_on_gpu(tiny_model, mixed, monkeypatch):
    # prompts arrive one per step while others decode: the decode step after each prefill step is
    # launched before the prefill is read (its new rows' ids gathered on the device inside the graph
    # replay); float32 greedy tokens equal the plain loop's and the old rule's
    from tests.test_mixed_steps import _staggered

    path = tiny_model("qwen3")
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
    kw = dict(KW, max_consecutive_prefill_steps=1, mixed_prefill_decode=mixed)
    res = {}
    for name, overlap, after in (("plain", False, "1"), ("old", True, "0"), ("new", True, "1")):
        monkeypatch.setenv("RLSERVE_OVERLAP_AFTER_PREFILL", after)
        llm = LLM(path, dtype="float32", extra={"async_scheduling": overlap}, **kw)
        outs, _ = _staggered(llm, PROMPTS, params)
        res[name] = [o.outputs[0].token_ids for o in outs]
        if overlap:
            counts = dict(llm.engine._overlap.counts)
            assert llm.engine.executor.runner.cuda_graphs.num_replays > 0
            if name == "new":
                assert counts["after_read"] == 0 and (mixed or counts["early_host_rows"] > 0), counts
        del llm
        torch.cuda.empty_cache()
    assert res["new"] == res["plain"] == res["old"]
