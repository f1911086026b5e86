"""No Triton kernel compiles after the engine is ready (issue 37) on a CUDA GPU: an offline engine of the
Qwen3-0.6B shape (dummy bf16 weights; the engine's CUDA defaults: Triton attention, decode CUDA graphs,
piecewise prefill graphs, overlapped scheduling) finishes its warm-up, then ``benchmarks/jit_misses.py``'s
varied workload runs at a smaller scale (bursts of 1..64 requests, prompts of 1..~1,000 tokens, one request
added per step, n > 1, logprobs, prompt logprobs, seeded sampling, stop tokens, prefix-cache hits), with
and without mixed prefill + decode steps; ``triton.knobs.runtime.jit_cache_hook`` must see no miss
(a miss is a compile, or a load from Triton's disk cache, in the middle of serving: BENCHMARKS.md H25).
Session 21's H100 run saw ~17 compiles after ready and a prefill-kernel miss mid-run; the CPU side of this
check is ``tests/test_jit_keys_triton.py`` (the same keys, computed in Triton's interpreter)."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton compiles for it)")

from benchmarks.jit_misses import JitCounter, run_workload, summary  # noqa: E402
from benchmarks.model_shapes import save_shape  # noqa: E402


def _release(llm) -> None:
    # an engine's GPU memory goes back only once nothing refers to it (rlserve's LLM has no close(), as vLLM's)
    del llm.engine
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("mixed", [False, True], ids=["default", "mixed"])
def test_no_triton_compile_after_ready(mixed, tmp_path):
    from rlserve import LLM

    # num_kv_blocks: 64 sequences of 2,048 tokens in 16-token blocks (~15 GB at this shape), set so that the
    # test does not take 90% of the GPU: the H100 run of 2026-12-08 failed the second test with "no memory left
    # for the KV cache" while the first one's engine was still held
    llm = LLM(save_shape("qwen3-0.6b", str(tmp_path)), dtype="bfloat16", device="cuda", load_format="dummy",
              skip_tokenizer_init=True, max_model_len=2048, max_num_seqs=64, mixed_prefill_decode=mixed,
              num_kv_blocks=64 * 2048 // 16)
    try:
        with JitCounter() as counter:
            work = run_workload(llm.engine, counter, llm.engine.vocab_size, scale=0.5, max_len=2000, max_seqs=64)
    finally:
        _release(llm)
    assert counter.available
    assert sum(work["requests"].values()) >= 100 and len(work["steps"]) >= 200
    assert counter.misses == [], "\n".join(summary(counter, work))


def test_weight_sync_kernel_needs_no_compile_after_ready(tiny_model):
    """The weight sync's copy + checksum kernel (rlserve.transfer.multi_tensor) is compiled by the engine's start-up
    warm-up (jit_warmup.warm_weight_sync, session 23): an update's launches over the model's parameters -- copy with
    and without the NaN / inf test, checksums only -- compile or load nothing after ready (before, the receiver's
    connect compiled them; with no receiver yet here, each variant would be a miss). The CPU side:
    tests/test_jit_keys_triton.py::test_weight_update_keys_are_the_warm_ups."""
    from rlserve import LLM
    from rlserve.transfer.multi_tensor import MultiTensorSum
    from rlserve.transfer.wire.packing import tensor_checksum

    llm = LLM(tiny_model("llama"), dtype="bfloat16", device="cuda", max_model_len=256, num_kv_blocks=256)
    params = [p.detach() for p in llm.engine.executor.model.parameters() if p.is_contiguous()]
    dsts = [torch.empty_like(p) for p in params]
    try:
        with JitCounter() as counter:
            for check in (False, True):
                op = MultiTensorSum.build(params, dsts, check_finite=check)
                assert op is not None
                got = op.run().tolist()
                only = MultiTensorSum.build(params, check_finite=check).run().tolist()
            torch.cuda.synchronize()
    finally:
        _release(llm)
    assert counter.available
    assert counter.misses == [], counter.misses
    assert got == only == [tensor_checksum(p) for p in params]
    assert all(torch.equal(d, p) for d, p in zip(dsts, params))
