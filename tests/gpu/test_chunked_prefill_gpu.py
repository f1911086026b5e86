"""Chunked prefill on a CUDA GPU (Triton attention, CUDA-graph decode, overlapped scheduling: the
engine's defaults there): a prompt prefilled in chunks gives the same float32 greedy tokens as the
unchunked prefill and as Hugging Face, with chunk boundaries inside a KV block and on one, with
prefix-cache hits and with requests decoding between the chunks; its sampled logprobs agree within
1e-4 (float32 both ways: the chunked prefill only splits the attention over the same keys into
more query tiles, the CPU tests' tolerance, ``tests/test_chunked_prefill.py``)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from rlserve import LLM, SamplingParams  # noqa: E402
from rlserve.layers.attention import get_attention_backend  # noqa: E402
from tests.gpu.test_gpu_engine import hf_greedy  # noqa: E402

KW = dict(device="cuda", dtype="float32", num_kv_blocks=512, max_num_seqs=16, block_size=16)
LENS = [150, 77, 45, 16, 200]  # long prompts over several chunks, one shorter than a chunk


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 300, (n,), generator=g).tolist() for n in LENS]


def _greedy(n: int = 16) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, min_tokens=n, logprobs=0)


def _run(llm, prompts, n=16):
    outs = llm.generate(prompts, _greedy(n))
    return [o.outputs[0].token_ids for o in outs], [[next(iter(d.values())) for d in o.outputs[0].logprobs]
                                                    for o in outs]


def _close(a, b, tol=1e-4):
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)) <= tol


def test_chunked_equals_unchunked_and_hf(tiny_model):
    path = tiny_model("qwen3")
    prompts = _prompts()
    ref = LLM(path, enable_chunked_prefill=False, max_num_batched_tokens=1024, **KW)
    ref_tok, ref_lp = _run(ref, prompts)
    del ref
    for budget in (24, 32):  # 24: boundaries inside 16-token blocks; 32: on block boundaries
        llm = LLM(path, enable_chunked_prefill=True, max_num_batched_tokens=budget, **KW)
        assert get_attention_backend() == "triton" and llm.engine.executor.runner.use_cuda_graphs
        steps = []
        real = llm.engine.executor.execute
        llm.engine.executor.execute = lambda step, real=real: steps.append(step.is_prefill and len(step.input_ids)) \
            or real(step)
        tok, lp = _run(llm, prompts)
        assert max(steps) == budget  # every prompt above the budget was split
        assert tok == ref_tok, f"budget {budget}: chunked prefill changed greedy tokens"
        assert _close(lp, ref_lp), f"budget {budget}: logprobs differ by more than 1e-4"
        del llm
    assert ref_tok == hf_greedy(path, prompts, 16)


def test_chunked_with_prefix_hits_and_decodes_between_chunks(tiny_model):
    """A second pass over the same prompts hits the prefix cache (chunks start past the hits);
    a short request decodes while a long prompt is prefilled chunk by chunk."""
    path = tiny_model("qwen3")
    prompts = _prompts(1)
    llm = LLM(path, enable_chunked_prefill=True, max_num_batched_tokens=40, max_consecutive_prefill_steps=1, **KW)
    ref = LLM(path, enable_chunked_prefill=False, max_num_batched_tokens=1024, enforce_eager=True, **KW)
    want, want_lp = _run(ref, prompts, 24)
    first, _ = _run(llm, prompts, 24)
    before = llm.engine.stats["prefix_cache_hit_tokens"]
    again, again_lp = _run(llm, [p + [7, 8, 9] for p in prompts[:2]] + prompts[2:], 24)
    assert llm.engine.stats["prefix_cache_hit_tokens"] > before
    assert first == want and again[2:] == want[2:] and _close(again_lp[2:], want_lp[2:])
    # a running stream-like request decodes while a long prompt arrives and is chunked
    eng = llm.engine
    eng.add_request("short", prompts[3], _greedy(40))
    for _ in range(3):
        eng.step()
    eng.add_request("long", [11] * 5 + prompts[4], _greedy(8))  # 205 tokens: 6 chunks (the model takes 256)
    done, kinds = {}, []
    real = eng.executor.execute
    eng.executor.execute = lambda step: kinds.append("P" if step.is_prefill else "D") or real(step)
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    eng.executor.execute = real
    assert "".join(kinds).startswith("PDPDPD")  # chunks and decode steps alternate (CUDA default)
    exp = ref.generate([prompts[3], [11] * 5 + prompts[4]], [_greedy(40), _greedy(8)])
    assert [done["short"], done["long"]] == [o.outputs[0].token_ids for o in exp]
