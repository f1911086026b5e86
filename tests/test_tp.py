"""Tensor parallelism on CPU (gloo): TP=2 greedy outputs equal TP=1 and Hugging Face."""

import pytest

from rlserve import LLM, SamplingParams
from tests.test_engine import PROMPTS, hf_greedy

NEW = 24


@pytest.mark.parametrize("arch", ["opt", "qwen3"])
def test_tp2_greedy_equals_tp1_and_hf(arch, tiny_model):
    path = tiny_model(arch)
    params = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW, logprobs=2)
    tp2 = LLM(path, dtype="float32", device="cpu", tensor_parallel_size=2)
    try:
        out2 = tp2.generate(PROMPTS, params)
    finally:
        tp2.engine.executor.shutdown()
    out1 = LLM(path, dtype="float32", device="cpu").generate(PROMPTS, params)
    ref = hf_greedy(path, [o.prompt_token_ids for o in out1], NEW)
    for a, b, r in zip(out2, out1, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == r
        for da, db in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for t in db:
                assert abs(da[t] - db[t]) < 1e-4
