"""Mixed steps (``--mixed-prefill-decode``) on a CUDA GPU with the engine's defaults there (Triton
attention, CUDA-graph decode, overlapped scheduling, chunked prefill): requests that arrive while others
decode are prefilled in steps that also decode every running request; the float32 greedy tokens equal
the unmixed eager engine's and Hugging Face's, sampled logprobs within 1e-4 (float32 both ways: a decode
row in the varlen prefill attention reads the same keys as the decode kernel; the CPU tests' tolerance,
``tests/test_mixed_steps.py``), and the pure decode steps between mixed ones still replay CUDA graphs."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from rlserve import LLM, SamplingParams  # noqa: E402
from rlserve.layers.attention import get_attention_backend  # noqa: E402
from tests.gpu.test_gpu_engine import hf_greedy  # noqa: E402

KW = dict(device="cuda", dtype="float32", num_kv_blocks=512, max_num_seqs=16, block_size=16)
LENS = [150, 77, 45, 16, 200, 9]


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 300, (n,), generator=g).tolist() for n in LENS]


def _staggered(llm, prompts, n=24):
    """One request added per step; returns per request (tokens, sampled logprobs), the steps' kinds
    ("M" mixed, "P" prefill, "D" decode) and the decode steps that replayed a graph."""
    eng = llm.engine
    kinds, graphs = [], []
    sched, runner = eng.scheduler.schedule, eng.executor.runner
    real_graph = runner._decode_with_graph

    def schedule():
        b = sched()
        if b is not None:
            kinds.append("M" if b.num_decodes else "P" if b.is_prefill else "D")
        return b

    def graph(step, lora=None):
        h = real_graph(step, lora)
        graphs.append(h is not None)
        return h

    eng.scheduler.schedule, runner._decode_with_graph = schedule, graph
    params = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, logprobs=0)
    done, i = {}, 0
    while i < len(prompts) or eng.has_unfinished_requests():
        if i < len(prompts):
            eng.add_request(f"r{i}", prompts[i], params)
            i += 1
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0]
    outs = [done[f"r{j}"] for j in range(len(prompts))]
    return ([o.token_ids for o in outs], [[next(iter(d.values())) for d in o.logprobs] for o in outs],
            "".join(kinds), graphs)


def test_mixed_equals_unmixed_eager_and_hf(tiny_model, budget=64):  # 64: the long prompts in chunks next to decodes
    path = tiny_model("qwen3")
    prompts = _prompts()
    ref = LLM(path, max_num_batched_tokens=budget, enforce_eager=True, enable_chunked_prefill=True, **KW)
    want, want_lp, _, _ = _staggered(ref, prompts)
    del ref
    llm = LLM(path, max_num_batched_tokens=budget, mixed_prefill_decode=True, enable_chunked_prefill=True, **KW)
    assert get_attention_backend() == "triton" and llm.engine.executor.runner.use_cuda_graphs
    assert llm.engine._overlap is not None
    got, got_lp, kinds, graphs = _staggered(llm, prompts)
    assert kinds.count("M") >= 3 and "MD" in kinds  # mixed steps, a pure decode step after each
    assert any(graphs)  # the pure decode steps replayed graphs
    assert got == want == hf_greedy(path, prompts, 24)
    err = max(abs(x - y) for a, b in zip(got_lp, want_lp) for x, y in zip(a, b))
    assert err <= 1e-4, f"mixed steps moved a logprob by {err}"
