"""No Triton compile in the middle of serving (issue 37), checked on the CPU: the CUDA compile key
(``tests.triton_keys``: Triton's own binder for an sm_90 target, no driver needed) of every launch a
serving run makes is one the warm-up's launches already had.

Two levels. The kernels alone, launches skipped (only their keys are computed, so thousands of
launch shapes cost nothing), on an H100's 132 SMs: the decode attention over batch sizes 1..300,
context lengths 1..8,192 and metadata views at every 4-byte offset (a mixed step's decode rows:
``AttentionMetadata.sequences``), and the fused qkv kernel over 1..1,100 tokens and a few longer with positions and
slots at offsets; each against :func:`rlserve.engine.worker.jit_warmup.warm_decode_attention` /
:func:`rlserve.layers.fused_ops.qkv_warm_token_counts`. And the engine, in Triton's interpreter
(``TRITON_INTERPRET=1``; the interpreter's 4 SMs): a tiny Qwen3 with the Triton attention, its KV writer and
the fused norm / SiLU / sampling kernels runs the warm-up's forwards, then a varied workload (prompt lengths 1-27, mixed prefill +
decode steps, n = 2, prefix-cache hits, logprobs, a stop string); every kernel key of the workload
must be a warm-up key. Each check also asserts that the workload did reach keys an unmarked kernel
(no ``do_not_specialize`` lists) would have compiled anew, so it can fail. What the CPU cannot
check: PDL launches (CUDA only: the one-row keys with ``PDL`` / ``launch_pdl``), the CUDA graphs'
capture, the alignment the CUDA caching allocator gives (512 bytes; fresh tensors are 16-byte aligned
here too), the GEMV / small-batch GEMM / MoE / batch-invariant kernels (CUDA paths):
``tests/gpu/test_jit_misses_gpu.py`` and ``benchmarks/jit_misses.py`` count real compiles there.
"""

from __future__ import annotations

import pytest
import torch

import tests.triton_interp  # noqa: F401  (skips this module, or sets TRITON_INTERPRET=1 first)
from rlserve.engine.worker import jit_warmup  # noqa: E402
from rlserve.layers import fused_ops, triton_attention as ta, triton_attention_kernels as tk  # noqa: E402
from rlserve.layers.attention import (  # noqa: E402
    Attention,
    AttentionMetadata,
    get_attention_backend,
    set_attention_backend,
)
from tests.triton_keys import KeyRecorder  # noqa: E402

H100_SMS = 132


@pytest.fixture
def triton_backend():
    name = get_attention_backend()
    assert ta.register()
    set_attention_backend("triton")
    yield
    set_attention_backend(name)


@pytest.fixture
def fused_on_cpu():
    prev = fused_ops.set_fused_kernels(True, on_cpu=True)
    yield
    fused_ops.set_fused_kernels(*prev)


def _attention(H, Hkv, D, page, blocks, cache_dtype):
    att = Attention(H, D, D ** -0.5, Hkv)
    att.k_cache = torch.zeros(blocks, page, Hkv, D).to(cache_dtype)
    att.v_cache = torch.zeros_like(att.k_cache)
    if cache_dtype != torch.float16:  # an fp8 cache: the kernels read its scales
        att.k_scale, att.v_scale = torch.ones(1), torch.ones(1)
    return att


@pytest.mark.parametrize("Hkv", [1, 8])
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float8_e4m3fn])
def test_decode_attention_keys_are_the_warm_ups(Hkv, cache_dtype, triton_backend, monkeypatch):
    monkeypatch.setattr(ta, "num_sms", lambda device: H100_SMS)
    H, D, page = 2 * Hkv, 64, 16
    att = _attention(H, Hkv, D, page, 4, cache_dtype)
    kernels = {n: getattr(tk, n) for n in ("_decode_kernel", "_decode_reduce_kernel")}
    with KeyRecorder(kernels, launch=False) as rec:
        rec.begin("warmup")
        assert jit_warmup.warm_decode_attention(torch.nn.ModuleList([att]), torch.float16,
                                                torch.device("cpu")) == len(ta.decode_variants())
        rec.begin("serve")
        splits = set()
        for B in (1, 2, 3, 5, 8, 13, 17, 33, 64, 100, 255, 256, 300):
            for L in (1, 63, 65, 129, 700, 2049, 8192):
                for a in (0, 1, 2, 3):  # rows a.. of a step: views at 4-byte offsets
                    n = a + B
                    meta = AttentionMetadata.build([1] * n, [L] * n, [[0] * -(-L // page)] * n, page)
                    meta = meta.sequences(a, n) if a else meta
                    q = torch.zeros(B, H, D, dtype=torch.float16)
                    ta.triton_paged_attention(q, att.k_cache, att.v_cache, meta, att.scale, **att.kv_scale_kwargs())
                splits.add(ta.plan_num_splits(B, Hkv, L, torch.device("cpu")))
    assert rec.new_since("warmup") == []
    # the workload reached what the warm-up did not launch: every split count, views at other alignments
    assert {1, 2, 3, 32} <= splits and len(splits) >= 8
    assert rec.new_since("warmup", raw=True)


@pytest.mark.parametrize("H,Hkv", [(16, 8), (32, 8), (4, 2)])
@pytest.mark.parametrize("sms", [4, H100_SMS])
def test_qkv_keys_are_the_warm_ups(H, Hkv, sms, fused_on_cpu, monkeypatch):
    monkeypatch.setattr(ta, "num_sms", lambda device: sms)
    D, page, blocks = 64, 16, 4
    cpu = torch.device("cpu")
    cos = sin = torch.zeros(8192, D)
    kc = torch.zeros(blocks, page, Hkv, D, dtype=torch.float16)
    vc = torch.zeros_like(kc)
    w = torch.ones(D, dtype=torch.float16)
    pos_buf = torch.zeros(2200 + 3, dtype=torch.long)
    slot_buf = torch.full((2200 + 3,), -1, dtype=torch.long)

    def launch(T, a=0):
        qkv = torch.zeros(T, (H + 2 * Hkv) * D, dtype=torch.float16)
        fused_ops.qkv_norm_rope_write(qkv, pos_buf[a:a + T], cos, sin, H, Hkv, D, kc, vc, slot_buf[a:a + T], w, w)

    kernels = {n: getattr(fused_ops._kernels(), n)
               for n in ("_qkv_norm_rope_write_kernel", "_qkv_norm_rope_write_heads_kernel")}
    with KeyRecorder(kernels, launch=False) as rec:
        rec.begin("warmup")
        for T in fused_ops.qkv_warm_token_counts(H + Hkv, cpu):
            launch(T)
        rec.begin("serve")
        classes = set()
        for T in [*range(1, 1100), 1500, 2047, 2099]:  # the classes change below _QKV_MANY_TOKENS only
            launch(T, T % 4)
            classes.add(fused_ops.qkv_launch_class(T, H + Hkv, cpu))
    assert rec.new_since("warmup") == []
    assert len(classes) >= 3 and rec.new_since("warmup", raw=True)


def test_engine_serving_keys_are_the_warm_ups(tiny_model, triton_backend, fused_on_cpu, monkeypatch):
    from rlserve import LLM, SamplingParams
    from rlserve.engine.core import fused_sampling
    from rlserve.layers import fused_kernels
    from rlserve.models.llama import LlamaAttention

    monkeypatch.setenv("RLSERVE_ATTENTION_BACKEND", "triton")
    monkeypatch.setenv("RLSERVE_CPU_MICROBATCHES", "1")  # the interpreter's grid is global state
    # the KV write through the Triton writer instead of the fused qkv kernel: two thirds of this test's time in the
    # interpreter (one program per token and head); its keys: test_qkv_keys_are_the_warm_ups
    monkeypatch.setattr(LlamaAttention, "fused_write_ok", lambda self, qkv: False)
    path = tiny_model("qwen3")
    kernels = {n: getattr(tk, n) for n in ("_write_kv_kernel", "_decode_kernel", "_decode_reduce_kernel",
                                           "_prefill_kernel")}
    kernels.update({n: getattr(fused_kernels, n) for n in (
        "_rms_norm_kernel", "_silu_mul_kernel", "_sample_partial_kernel", "_sample_reduce_kernel")})
    kernels["copy_sum"] = _copy_sum_kernel()  # the weight sync's (test_weight_update_keys_are_the_warm_ups)
    _cpu_weight_sync_warmup(monkeypatch)
    with KeyRecorder(kernels) as rec:
        llm = LLM(path, dtype="float32", device="cpu", block_size=4, max_num_seqs=6, max_num_batched_tokens=40,
                  max_model_len=32, mixed_prefill_decode=True, enable_prefix_caching=True)
        assert get_attention_backend() == "triton"
        runner = llm.engine.executor.runner
        rec.begin("warmup")
        with torch.inference_mode():  # what ModelRunner.warm_up and the engine's sampler warm-up run on CUDA
            runner._warm_forwards(False)
            assert fused_sampling.warm_up(torch.device("cpu"), llm.engine.vocab_size, (torch.float32,))
        rec.begin("serve")
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(5, 300, (n,), generator=g).tolist() for n in (1, 3, 20, 9, 26, 14, 5)]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, logprobs=2))
        outs += llm.generate(prompts[2:4], SamplingParams(temperature=0.8, max_tokens=3, n=2, seed=1, stop=["a"]))
        outs += llm.generate([p + [7] for p in prompts[2:5]], SamplingParams(temperature=0, max_tokens=2))  # prefix hits
    assert len(outs) == 12 and all(o.outputs[0].token_ids for o in outs)
    assert len(rec.keys["copy_sum"]) == 4  # the warm-up launched the weight sync's four variants
    launched = {n for n, ks in rec.keys.items() if ks}
    assert {"_write_kv_kernel", "_decode_kernel", "_decode_reduce_kernel", "_prefill_kernel", "_rms_norm_kernel",
            "_silu_mul_kernel", "_sample_partial_kernel"} <= launched
    assert rec.new_since("warmup") == []
    assert rec.new_since("warmup", raw=True)  # unmarked kernels would have compiled in the middle of serving


def _copy_sum_kernel():
    from rlserve.transfer import multi_tensor

    return multi_tensor._kernel()


def _cpu_weight_sync_warmup(monkeypatch):
    """The start-up warm-up's copy + checksum launches on CPU tensors (the interpreter): on CUDA
    :func:`rlserve.transfer.multi_tensor.warmup` runs them as they are; on the CPU it is a no-op."""
    import functools

    from rlserve.transfer import multi_tensor

    monkeypatch.setattr(multi_tensor, "warmup", functools.partial(multi_tensor.warmup, _allow_cpu=True))


def test_weight_update_keys_are_the_warm_ups(monkeypatch):
    """Every copy + checksum launch a weight update makes (the receiver's checksums, the direct copy plan's
    copies with and without the NaN / inf test, a staged update's byte views, a bucket table moved to a new
    address, tensors with tails) has a key the start-up warm-up (jit_warmup.warm_weight_sync) launched."""
    from rlserve.transfer.multi_tensor import MultiTensorSum, tensor_checksums
    from rlserve.transfer.wire.packing import tensor_checksum

    _cpu_weight_sync_warmup(monkeypatch)
    g = torch.Generator().manual_seed(3)
    params = [torch.randn(40, 24, generator=g).to(dt) for dt in (torch.bfloat16, torch.float16, torch.float32)]
    params.append(torch.randn(7, generator=g).to(torch.bfloat16))  # 14 bytes: a tail
    with KeyRecorder({"copy_sum": _copy_sum_kernel()}) as warm:
        assert jit_warmup.warm_weight_sync(torch.device("cpu")) == 4
    with KeyRecorder({"copy_sum": _copy_sum_kernel()}) as rec:
        dsts = [torch.empty_like(p) for p in params]
        for check in (False, True):
            op = MultiTensorSum.build(params, dsts, chunk_words=64, _allow_cpu=True, check_finite=check)
            assert op.run().tolist() == [tensor_checksum(p) for p in params]
            assert all(torch.equal(d, p) for d, p in zip(dsts, params))
        u8 = [p.view(torch.uint8).reshape(-1) for p in params[:3]]  # a staged update's byte views
        op = MultiTensorSum.build(u8, check_finite=True, check_dtypes=[p.dtype for p in params[:3]],
                                  _allow_cpu=True)
        assert op.run().tolist() == [tensor_checksum(p) for p in params[:3]] and op.bad.tolist() == [0, 0, 0]
        bucket = torch.cat(u8)  # a packed bucket mapped at a new address: the table moved by one add
        moved = torch.empty_like(bucket).copy_(bucket)
        op = MultiTensorSum.build([bucket], _allow_cpu=True).relocated(moved.data_ptr() - bucket.data_ptr(), moved)
        assert op.run().tolist() == [tensor_checksum(bucket)]
        assert tensor_checksums(params) == [tensor_checksum(p) for p in params]  # (host path: no launch)
    assert sum(rec.keys["copy_sum"].values()) == 4
    assert set(rec.keys["copy_sum"]) == set(warm.keys["copy_sum"])  # the update's four variants, all warmed
