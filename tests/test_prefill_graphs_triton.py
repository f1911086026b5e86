"""Piecewise prefill graphs (:mod:`rlserve.engine.worker.prefill_graphs`, emulated: the pieces as plain
calls) on the CUDA path's kernels, run by Triton's interpreter (``TRITON_INTERPRET=1``; skipped where CUDA
is present: ``tests/gpu/test_prefill_graphs_gpu.py`` captures real graphs there): the fused add + RMSNorm,
q/k-norm + rotary + KV-write and SiLU-and-mul kernels inside the pieces on padded buckets, the Triton
attention (varlen prefill, a mixed step's decode rows in the decode kernel) between them. Greedy tokens
equal the torch backend's eager engine, logprobs within 1e-4 (float32: the bound
``tests/test_triton_interpret.py`` holds between the two backends)."""

from __future__ import annotations

import pytest

import tests.triton_interp  # (skips this module, or sets TRITON_INTERPRET=1 first)

tests.triton_interp.rebuild("rlserve.layers.triton_attention_kernels", "rlserve.layers.triton_attention")
from rlserve.layers import fused_ops  # noqa: E402
from rlserve.layers.attention import get_attention_backend, set_attention_backend  # noqa: E402
from tests.test_prefill_graphs import count_runs  # noqa: E402


@pytest.fixture
def restore():
    name = get_attention_backend()
    prev = fused_ops.set_fused_kernels(True, on_cpu=True)
    yield
    fused_ops.set_fused_kernels(*prev)
    set_attention_backend(name)


@pytest.mark.parametrize("mixed", [False, True])
def test_engine_prefill_graphs_with_triton_match_torch_eager(tiny_model, restore, monkeypatch, mixed):
    from rlserve import LLM, SamplingParams
    from tests.test_mixed_steps import _staggered

    path = tiny_model("qwen3")
    prompts = [[5, 17, 33, 2, 9, 41, 7], [8, 3], [12, 40, 6, 6, 19, 23, 31, 4, 11, 2, 29], [7, 7, 30, 2, 14]]
    params = SamplingParams(temperature=0, max_tokens=5, min_tokens=5, logprobs=2)
    kw = dict(dtype="float32", device="cpu", block_size=4, max_num_seqs=4, max_num_batched_tokens=12,
              max_consecutive_prefill_steps=1, mixed_prefill_decode=mixed, enable_chunked_prefill=True)
    set_attention_backend("torch")
    prev = fused_ops.set_fused_kernels(False)
    try:
        ref, _ = _staggered(LLM(path, **kw), prompts, params)
    finally:
        fused_ops.set_fused_kernels(*prev)
    monkeypatch.setenv("RLSERVE_ATTENTION_BACKEND", "triton")
    monkeypatch.setenv("RLSERVE_CPU_MICROBATCHES", "1")  # the interpreter's grid is global state
    seen = count_runs(monkeypatch)
    llm = LLM(path, extra={"prefill_cuda_graph_sizes": "8,16", "prefill_cuda_graphs_emulate": True}, **kw)
    assert get_attention_backend() == "triton"
    outs, n_mixed = _staggered(llm, prompts, params)
    assert llm.engine.executor.runner.prefill_graphs is not None and seen
    assert (n_mixed > 0) == mixed
    for a, b in zip(outs, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for da, db in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for t in db:
                assert abs(da[t] - db[t]) < 1e-4


def test_triton_attention_writes_into_out(restore):
    """The Triton backend takes ``out=`` (``OUT_BACKENDS``): a mixed step's decode and prefill rows written into
    their halves of one buffer, equal to the ``cat`` of two fresh results; a wrong ``out`` is refused."""
    import torch

    from rlserve.layers import triton_attention as ta
    from rlserve.layers.attention import OUT_BACKENDS, Attention
    from tests.attention_cases import make_paged_case

    assert ta.register() and "triton" in OUT_BACKENDS
    set_attention_backend("triton")
    q, kc, vc, meta = make_paged_case([1, 1, 6, 3], [9, 17, 14, 3], 4, 2, 16, 4, torch.float32)
    att = Attention(4, 16, 16 ** -0.5, 2)
    att.k_cache, att.v_cache = kc, vc
    T = q.shape[0]
    want = torch.cat([ta.triton_paged_attention(q[:2], kc, vc, meta.sequences(0, 2), att.scale),
                      ta.triton_paged_attention(q[2:], kc, vc, meta.sequences(2, 4), att.scale)]).reshape(T, 64)
    out = torch.full((T, 64), float("nan"))
    assert att.forward_cached(q.reshape(T, 64), meta, out=out) is out
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    with pytest.raises(ValueError, match="out must be"):
        ta.paged_attention(q, kc, vc, meta, att.scale, out=torch.empty(T, 4, 8))
