"""Triton paged-attention kernels against the float64 torch reference, on a CUDA GPU.

Covers decode (one query token per sequence; default split plan and forced splits;
CUDA-graph padding rows), prefill (plain prompts, prefix-cache hits / chunked prefill,
single-token queries in a prefill batch), GQA / MQA / MHA, head dims 64 and 128 (and a
non-power-of-two one), float32 and bfloat16, and the fused KV write.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ta = pytest.importorskip("rlserve.layers.triton_attention")
if not ta.HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

from rlserve.layers.attention import AttentionMetadata, torch_paged_attention, write_kv_cache  # noqa: E402
from tests.attention_cases import make_paged_case  # noqa: E402

DEV = torch.device("cuda")
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def make_case(query_lens, seq_lens, H, Hkv, D, block_size, dtype, seed=0):
    return make_paged_case(query_lens, seq_lens, H, Hkv, D, block_size, dtype, DEV, spare_blocks=7, seed=seed)


def ref(q, kc, vc, meta, scale):
    return torch_paged_attention(q.double(), kc.double(), vc.double(), meta, scale)


SHAPES = [  # (H, Hkv, D): Qwen3 (16/8/128), SmolLM2 (9/3/64), Qwen3-8B (32/8/128), MHA, odd head_dim
    (16, 8, 128), (9, 3, 64), (32, 8, 128), (4, 4, 64), (8, 2, 80),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,Hkv,D", SHAPES)
@pytest.mark.parametrize("B", [1, 7, 64])
def test_decode(B, H, Hkv, D, dtype):
    rng = random.Random(B * 1000 + H)
    seq_lens = [rng.randint(1, 1500) for _ in range(B)]
    q, kc, vc, meta = make_case([1] * B, seq_lens, H, Hkv, D, 16, dtype, seed=B)
    expect = ref(q, kc, vc, meta, D**-0.5)
    for splits in (None, 1, 5):
        out = ta.triton_paged_attention(q, kc, vc, meta, D**-0.5, num_splits=splits)
        torch.testing.assert_close(out.double(), expect, **TOL[dtype], msg=f"splits={splits}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_static_upper_bound_and_padding_rows(dtype):
    """The CUDA-graph form: max_seq_len = a static bound, rows with context 0."""
    q, kc, vc, meta = make_case([1, 1, 1], [300, 17, 1], 16, 8, 128, 16, dtype)
    expect = ref(q, kc, vc, meta, 0.1)
    pad = 5
    bt = torch.cat([meta.block_tables, torch.zeros(pad, meta.block_tables.shape[1], dtype=torch.int32, device=DEV)])
    padded = AttentionMetadata(
        slot_mapping=torch.full((3 + pad,), -1, device=DEV),
        query_start_loc=torch.arange(4 + pad, dtype=torch.int32, device=DEV),
        seq_lens=torch.cat([meta.seq_lens, torch.zeros(pad, dtype=torch.int32, device=DEV)]),
        block_tables=bt, max_query_len=1, max_seq_len=4096, block_size=16,
        query_start_loc_cpu=list(range(4 + pad)), seq_lens_cpu=[4096] * (3 + pad),
    )
    qp = torch.cat([q, torch.randn(pad, 16, 128, device=DEV).to(dtype)])
    out = ta.triton_paged_attention(qp, kc, vc, padded, 0.1)
    torch.testing.assert_close(out[:3].double(), expect, **TOL[dtype])
    assert torch.count_nonzero(out[3:]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,Hkv,D", [(16, 8, 128), (9, 3, 64), (8, 2, 80)])
@pytest.mark.parametrize(
    "query_lens,seq_lens",
    [
        ([300], [300]),  # one prompt
        ([17, 128, 1, 513, 64], [17, 128, 1, 513, 64]),  # varlen batch
        ([5, 100, 1, 250], [261, 100, 49, 1000]),  # prefix-cache hits / chunked prefill
    ],
)
def test_prefill(query_lens, seq_lens, H, Hkv, D, dtype):
    q, kc, vc, meta = make_case(query_lens, seq_lens, H, Hkv, D, 16, dtype, seed=len(query_lens))
    out = ta.triton_paged_attention(q, kc, vc, meta, D**-0.5)
    torch.testing.assert_close(out.double(), ref(q, kc, vc, meta, D**-0.5), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache(dtype):
    g = torch.Generator().manual_seed(3)
    kc = torch.randn(40, 16, 8, 128, generator=g).to(DEV, dtype)
    vc = torch.randn(40, 16, 8, 128, generator=g).to(DEV, dtype)
    # a strided view, as the model's qkv split produces
    qkv = torch.randn(100, (16 + 8 + 8) * 128, generator=g).to(DEV, dtype)
    k = qkv[:, 16 * 128 : 24 * 128].view(100, 8, 128)
    v = qkv[:, 24 * 128 :].view(100, 8, 128)
    slots = torch.randperm(40 * 16, generator=g)[:100].to(DEV)
    slots[::7] = -1
    kc2, vc2 = kc.clone(), vc.clone()
    write_kv_cache(k, v, kc, vc, slots)
    ta.triton_write_kv_cache(k, v, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


def test_decode_capturable_in_cuda_graph():
    q, kc, vc, meta = make_case([1] * 4, [100, 900, 3, 40], 16, 8, 128, 16, torch.bfloat16)
    expect = ta.triton_paged_attention(q, kc, vc, meta, 0.1)
    k_new = torch.randn(4, 8, 128, device=DEV, dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ta.triton_write_kv_cache(k_new, k_new, kc, vc, torch.full((4,), -1, device=DEV))
        ta.triton_paged_attention(q, kc, vc, meta, 0.1)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ta.triton_write_kv_cache(k_new, k_new, kc, vc, torch.full((4,), -1, device=DEV))
        out = ta.triton_paged_attention(q, kc, vc, meta, 0.1)
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expect, atol=0, rtol=0)
