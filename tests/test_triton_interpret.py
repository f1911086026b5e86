"""The Triton attention kernels on CPU, through Triton's interpreter (``TRITON_INTERPRET=1``).

Checks the kernels' logic -- paging, GQA packing, split-K merging, causal masks with a
cached prefix, padding rows -- against the pure-PyTorch reference on tiny shapes, and the
CUDA-graph input derivation and padding (``DecodeCUDAGraphs`` in its CPU emulation mode)
end to end through the engine. Skipped when Triton is not installed, and on machines
with CUDA (``tests/gpu`` runs the compiled kernels there, and the interpreter flag must
not leak into them). The interpreter has no bfloat16 matmul, so reduced precision is
covered with float16 here and bfloat16 on the GPU.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

import tests.triton_interp  # noqa: F401  (skips this module, or sets TRITON_INTERPRET=1 first)

for _name in ("rlserve.layers.triton_attention_kernels", "rlserve.layers.triton_attention"):
    if _name in sys.modules:  # built without the interpreter: rebuild (the kernels first)
        importlib.reload(sys.modules[_name])
from rlserve.layers import triton_attention as ta  # noqa: E402
from rlserve.layers.attention import (  # noqa: E402
    AttentionMetadata,
    get_attention_backend,
    set_attention_backend,
    torch_paged_attention,
    write_kv_cache,
)
from tests.attention_cases import make_paged_case  # noqa: E402


def make_case(query_lens, seq_lens, H, Hkv, D, block_size, dtype, seed=0):
    """Random q, a shuffled paged cache holding every context, and the metadata."""
    return make_paged_case(query_lens, seq_lens, H, Hkv, D, block_size, dtype, seed=seed)


def reference(q, kc, vc, meta, scale):
    return torch_paged_attention(q.float(), kc.float(), vc.float(), meta, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_cache_matches_torch_and_skips_negative_slots(dtype):
    g = torch.Generator().manual_seed(1)
    kc = torch.randn(5, 4, 2, 8, generator=g).to(dtype)
    vc = torch.randn(5, 4, 2, 8, generator=g).to(dtype)
    k = torch.randn(6, 2, 8, generator=g)  # float32 input: cast to the cache dtype
    v = torch.randn(6, 2, 8, generator=g)
    slots = torch.tensor([3, -1, 17, 0, -1, 19])
    kc2, vc2 = kc.clone(), vc.clone()
    write_kv_cache(k, v, kc, vc, slots)
    ta.triton_write_kv_cache(k, v, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


@pytest.mark.parametrize(
    "seq_lens,H,Hkv,D,bs,splits",
    [
        ([5, 40, 17], 4, 2, 16, 4, None),  # GQA 2:1, default plan
        ([5, 40, 17], 4, 2, 16, 4, 3),  # split-K with uneven and empty splits
        ([130, 3], 6, 3, 16, 16, 4),  # SmolLM2-like 2:1 with 3 KV heads
        ([70, 1], 4, 1, 24, 16, 2),  # MQA, head_dim not a power of two
        ([33], 4, 4, 16, 8, 1),  # MHA
    ],
)
def test_decode_matches_reference_fp32(seq_lens, H, Hkv, D, bs, splits):
    q, kc, vc, meta = make_case([1] * len(seq_lens), seq_lens, H, Hkv, D, bs, torch.float32)
    out = ta.triton_paged_attention(q, kc, vc, meta, D**-0.5, num_splits=splits)
    torch.testing.assert_close(out, reference(q, kc, vc, meta, D**-0.5), atol=2e-6, rtol=1e-5)


def test_decode_padding_rows_are_zero_and_harmless():
    """CUDA-graph padding: rows with context 0 produce 0 and do not disturb real rows."""
    q, kc, vc, meta = make_case([1, 1], [9, 20], 4, 2, 16, 4, torch.float32)
    ref = reference(q, kc, vc, meta, 0.25)
    padded = AttentionMetadata(
        slot_mapping=torch.tensor([-1, -1, -1, -1]),
        query_start_loc=torch.arange(5, dtype=torch.int32),
        seq_lens=torch.tensor([9, 20, 0, 0], dtype=torch.int32),
        block_tables=torch.cat([meta.block_tables, torch.zeros(2, meta.block_tables.shape[1], dtype=torch.int32)]),
        max_query_len=1, max_seq_len=64, block_size=4,
        query_start_loc_cpu=[0, 1, 2, 3, 4], seq_lens_cpu=[64] * 4,
    )
    qp = torch.cat([q, torch.randn(2, 4, 16)])
    for splits in (1, 3):
        out = ta.triton_paged_attention(qp, kc, vc, padded, 0.25, num_splits=splits)
        torch.testing.assert_close(out[:2], ref, atol=2e-6, rtol=1e-5)
        assert torch.equal(out[2:], torch.zeros_like(out[2:]))


@pytest.mark.parametrize(
    "query_lens,seq_lens,H,Hkv,D,bs",
    [
        ([7, 20, 1], [7, 20, 1], 4, 2, 16, 4),  # plain prompts
        ([7, 20, 1], [7, 33, 9], 4, 2, 16, 4),  # prefix-cache hits / chunked prefill
        ([70], [100], 4, 1, 24, 16),  # query longer than one tile, context longer still
        ([3, 18], [19, 18], 6, 3, 16, 8),
    ],
)
def test_prefill_matches_reference_fp32(query_lens, seq_lens, H, Hkv, D, bs, monkeypatch):
    monkeypatch.setattr(ta, "PREFILL_BLOCK_M", 16)
    monkeypatch.setattr(ta, "PREFILL_BLOCK_N", 16)
    q, kc, vc, meta = make_case(query_lens, seq_lens, H, Hkv, D, bs, torch.float32)
    out = ta.triton_paged_attention(q, kc, vc, meta, D**-0.5)
    torch.testing.assert_close(out, reference(q, kc, vc, meta, D**-0.5), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("decode", [True, False])
def test_fp16_close_to_reference(decode):
    ql = [1, 1] if decode else [5, 12]
    q, kc, vc, meta = make_case(ql, [50, 12], 8, 2, 16, 8, torch.float16)
    out = ta.triton_paged_attention(q, kc, vc, meta, 0.25, num_splits=2 if decode else None)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), reference(q, kc, vc, meta, 0.25), atol=3e-3, rtol=3e-3)


def test_split_plan_is_static_and_bounded():
    dev = torch.device("cpu")
    assert ta.plan_num_splits(256, 8, 8192, dev) == 1
    assert 1 <= ta.plan_num_splits(1, 2, 10, dev) <= ta._MAX_SPLITS
    assert ta.plan_num_splits(1, 1, 100_000, dev) <= ta._MAX_SPLITS
    assert ta.plan_num_splits(3, 2, 4000, dev) == ta.plan_num_splits(3, 2, 4000, dev)


def test_decode_positions_and_slots_match_metadata():
    from rlserve.engine.worker.cuda_graph import decode_positions_and_slots

    tables = [[4, 2, 7], [1], [3, 5]]
    seq_lens = [9, 1, 8]
    meta = AttentionMetadata.build([1, 1, 1], seq_lens, tables, 4)
    bt = torch.zeros(4, 5, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    pos, slot = decode_positions_and_slots(torch.tensor(seq_lens + [0], dtype=torch.int32), bt, 4)
    assert pos.tolist() == [8, 0, 7, 0]
    assert slot[:3].tolist() == meta.slot_mapping.tolist() and slot[3].item() == -1


@pytest.fixture
def restore_backend():
    name = get_attention_backend()
    yield
    set_attention_backend(name)


def test_engine_triton_backend_with_emulated_graphs_matches_torch(tiny_model, restore_backend, monkeypatch):
    """Greedy decoding through the Triton kernels and the CUDA-graph input path (padding
    to the captured ladder, device-side positions/slots) equals the torch backend."""
    from rlserve import LLM, SamplingParams

    path = tiny_model("smollm")
    prompts = ["The capital of France is", "Hello world! Hello there, how are you", "Once"]
    params = SamplingParams(temperature=0, max_tokens=4, min_tokens=4, logprobs=2)
    set_attention_backend("torch")
    ref = LLM(path, dtype="float32", device="cpu", block_size=4).generate(prompts, params)

    monkeypatch.setenv("RLSERVE_ATTENTION_BACKEND", "triton")
    # one micro-batch: Triton's interpreter keeps the launch grid in one global (set_grid_dim), so
    # two CPU micro-batch threads launching kernels at once corrupt each other's grid
    # ("y >= grid_dim[1]"); a compiled GPU launch has no such state
    monkeypatch.setenv("RLSERVE_CPU_MICROBATCHES", "1")
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, max_num_seqs=4)
    assert get_attention_backend() == "triton"
    runner = llm.engine.executor.runner
    runner.use_cuda_graphs = True  # DecodeCUDAGraphs emulates replay on CPU
    outs = llm.generate(prompts, params)
    assert runner.cuda_graphs is not None and runner.cuda_graphs.emulate
    assert runner.cuda_graphs.sizes == [1, 2, 4]
    for a, b in zip(outs, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for da, db in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for t in db:
                assert abs(da[t] - db[t]) < 1e-4


# --------------------------------------------------------------------------- multi-tensor checksum
def _multi_tensor_cases():
    g = torch.Generator().manual_seed(7)
    return [
        torch.randint(-2**62, 2**62, (1000,), dtype=torch.int64, generator=g),  # wraps when summed
        torch.randn(33, 17, generator=g),  # 2244 bytes: a 4-byte tail
        torch.randn(13, generator=g).to(torch.float16),  # 26 bytes: 3 words + 2 tail bytes
        torch.randn(3, generator=g).to(torch.bfloat16),  # 6 bytes: no whole word
        torch.randn(64, 48, generator=g).double(),
    ]


@pytest.mark.parametrize("copy", [False, True])
def test_multi_tensor_sum_equals_per_tensor_s64sum(copy):
    """One launch over a chunk table (chunks of 7 words: several per tensor) gives each
    tensor's s64sum exactly, tails included, and copies every byte when destinations are given."""
    from rlserve.transfer.multi_tensor import MultiTensorSum
    from rlserve.transfer.wire.packing import as_bytes, tensor_checksum

    srcs = _multi_tensor_cases()
    dsts = [torch.full_like(s, 0) for s in srcs] if copy else None
    op = MultiTensorSum.build(srcs, dsts, chunk_words=7, _allow_cpu=True)
    assert op is not None and op.n == len(srcs)
    sums = op.run().tolist()
    assert sums == [tensor_checksum(s) for s in srcs]
    assert op.run().tolist() == sums  # the table is reusable
    if copy:
        for s, d in zip(srcs, dsts):
            assert torch.equal(as_bytes(s), as_bytes(d))


def test_multi_tensor_sum_refuses_unaligned_or_mismatched():
    from rlserve.transfer.multi_tensor import MultiTensorSum

    base = torch.zeros(100, dtype=torch.uint8)
    assert MultiTensorSum.build([base[1:41]], _allow_cpu=True) is None  # not 8-byte aligned
    assert MultiTensorSum.build([base[:40]], [torch.zeros(48, dtype=torch.uint8)], _allow_cpu=True) is None
    assert MultiTensorSum.build([torch.zeros(4, 4).t()], _allow_cpu=True) is None  # not contiguous
    assert MultiTensorSum.build([torch.zeros(8)]) is None  # CPU tensors without the test flag


def test_prefill_kernel_compiles_one_variant_whatever_its_metadata_views_alignment():
    """The per-step metadata (block tables, sequence lengths, query starts; the cache scales alias the lengths
    without an fp8 cache) are views at offsets that follow the batch: a variant per 16-byte alignment class of
    them compiled in the middle of serving on the H100 (session 21: 675-891 ms with 42-86 streams running)."""
    from rlserve.layers import triton_attention_kernels as k

    kern = k._prefill_kernel
    if hasattr(kern, "params"):  # a JITFunction
        marked = {p.name for p in kern.params if p.do_not_specialize_on_alignment}
    else:  # this module runs Triton's interpreter: the decorator's arguments are kept as given
        marked = set(kern.kwargs["do_not_specialize_on_alignment"])
    assert {"BT", "SEQ_LENS", "QSL", "K_SCALE", "V_SCALE"} <= marked
    assert not {"Q", "KC", "VC", "OUT"} & marked  # the big operands keep their alignment specialization
