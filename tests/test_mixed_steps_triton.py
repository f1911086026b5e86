"""Mixed steps (``--mixed-prefill-decode``) through the Triton attention kernels on CPU, in Triton's
interpreter (``TRITON_INTERPRET=1``; skipped where CUDA is present: ``tests/gpu/test_mixed_steps_gpu.py``
runs the compiled kernels there): a mixed step's leading decode rows go to the flash-decoding kernel and
its prefill rows to the varlen kernel (``AttentionMetadata.decode_split``), and the engine with the
emulated CUDA-graph decode path between mixed steps gives the torch backend's unmixed greedy tokens, logprobs
within 1e-4 (float32: the bound ``tests/test_triton_interpret.py`` holds between the two backends)."""

from __future__ import annotations

import pytest
import torch

import tests.triton_interp  # (skips this module, or sets TRITON_INTERPRET=1 first)

tests.triton_interp.rebuild("rlserve.layers.triton_attention_kernels", "rlserve.layers.triton_attention")
from rlserve.layers import triton_attention as ta  # noqa: E402
from rlserve.layers.attention import (  # noqa: E402
    ATTENTION_BACKENDS,
    Attention,
    get_attention_backend,
    set_attention_backend,
    torch_paged_attention,
)
from tests.attention_cases import make_paged_case  # noqa: E402


@pytest.fixture
def restore_backend():
    name = get_attention_backend()
    yield
    set_attention_backend(name)


def test_mixed_rows_split_between_the_kernels_match_the_reference(restore_backend):
    # 3 decode rows (contexts 9, 33, 17), then two prefill rows with cached prefixes; GQA 4 / 2 heads
    qlens, slens = [1, 1, 1, 6, 3], [9, 33, 17, 14, 3]
    q, kc, vc, meta = make_paged_case(qlens, slens, 4, 2, 16, 4, torch.float32)
    assert ta.register() and "triton" in ATTENTION_BACKENDS
    set_attention_backend("triton")
    calls = []
    real = ATTENTION_BACKENDS["triton"]
    ATTENTION_BACKENDS["triton"] = lambda q, kc, vc, m, s, **kw: calls.append(m.max_query_len) or real(q, kc, vc, m, s, **kw)
    try:
        att = Attention(4, 16, 16 ** -0.5, 2)
        att.k_cache, att.v_cache = kc, vc
        got = att._attend(q, meta, {})
    finally:
        ATTENTION_BACKENDS["triton"] = real
    assert calls == [1, 6]  # the decode kernel for rows 0..2, the varlen kernel for the rest
    want = torch_paged_attention(q, kc, vc, meta, att.scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_engine_mixed_steps_with_triton_and_emulated_graphs_match_torch(tiny_model, restore_backend, monkeypatch):
    from rlserve import LLM, SamplingParams
    from tests.test_mixed_steps import _staggered

    path = tiny_model("smollm")
    prompts = ["The capital of France is", "Hello world! Hello there, how are you", "Once upon a time there",
               "One two three four five six seven"]
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6, logprobs=2)
    kw = dict(dtype="float32", device="cpu", block_size=4, max_num_seqs=4, max_num_batched_tokens=12,
              max_consecutive_prefill_steps=1)
    set_attention_backend("torch")
    ref, _ = _staggered(LLM(path, **kw), prompts, params)
    monkeypatch.setenv("RLSERVE_ATTENTION_BACKEND", "triton")
    monkeypatch.setenv("RLSERVE_CPU_MICROBATCHES", "1")  # the interpreter's grid is global state (see there)
    llm = LLM(path, mixed_prefill_decode=True, **kw)
    assert get_attention_backend() == "triton"
    runner = llm.engine.executor.runner
    runner.use_cuda_graphs = True  # DecodeCUDAGraphs emulates replay on CPU
    outs, n_mixed = _staggered(llm, prompts, params)
    assert n_mixed >= 2 and runner.cuda_graphs is not None and runner.cuda_graphs.emulate
    for a, b in zip(outs, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for da, db in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for t in db:
                assert abs(da[t] - db[t]) < 1e-4
