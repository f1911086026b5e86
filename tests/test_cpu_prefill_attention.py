"""The CPU team's causal prefill attention (csrc/paged_prefill.c, cpu_gemm.paged_decode_call with
``prefill=True``) against dense float64 attention, and what its bits depend on: not the tile a
query token lands in, the team's size or the step's other rows; a row alone keeps the decode
kernel's bits."""

from __future__ import annotations

import types

import pytest
import torch

from rlserve.batch_invariant.per_query import per_query_tables
from rlserve.layers import cpu_gemm
from tests.attention_cases import make_paged_case
from tests.test_cpu_attention import dense_decode_reference
from tests.test_cpu_gemm import pytestmark, team  # noqa: F401 - the skip rule and the team-of-2 fixture


def _rows_reference(q, kc, vc, bt, sl, scale):
    """Each row as a one-token sequence over its context, float64 (test_cpu_attention's)."""
    return dense_decode_reference(q, kc, vc, types.SimpleNamespace(seq_lens_cpu=sl.tolist(), block_tables=bt), scale)


def _run(q, kc, vc, bt, sl, H, Hkv, D, prefill=True):
    out = torch.full_like(q, float("nan"))
    rc = cpu_gemm.paged_decode_call(q, kc, vc, bt, sl, out, H, Hkv, D, D**-0.5, prefill=prefill)
    return rc, out


CASES = [
    # (query_lens, seq_lens, H, Hkv, D, block_size)
    ([128], [128], 9, 3, 64, 16),  # SmolLM2's heads, a prompt from scratch: 4 tiles of 32 rows
    ([5, 1, 40], [5, 17, 100], 9, 3, 64, 16),  # a short prompt, a decode row, 40 tokens after a 60-token prefix
    ([33, 1, 7], [40, 300, 7], 8, 1, 128, 24),  # MQA, head_dim 128, blocks of 24 (chunks of 16 + 8 keys)
    ([20, 3], [60, 3], 4, 4, 32, 128),  # no GQA, vLLM CPU's block size (8 chunks of 16 per block)
    ([9], [9], 16, 8, 8, 1),  # block size 1
    ([70], [70], 32, 2, 16, 16),  # 16 query heads per KV head: tiles of 6 rows
    ([1, 2, 3], [1, 2, 30], 6, 2, 64, 4),  # a first token, 2-row tiles
]


@pytest.mark.parametrize("query_lens,seq_lens,H,Hkv,D,bs", CASES)
def test_tiles_match_dense_reference(query_lens, seq_lens, H, Hkv, D, bs, team):
    """Within 3e-6 absolute / 2e-5 relative of float64 attention: SDPA's own float32 error on these
    cases is 0.7-1.5e-6 (AMD EPYC Zen 3, torch 2.13; the kernel's 0.3-1.3e-6 there), the decode
    kernel's test allows 2e-6 / 2e-5."""
    q, kc, vc, meta = make_paged_case(query_lens, seq_lens, H, Hkv, D, bs, torch.float32)
    bt, sl = per_query_tables(meta)
    rc, out = _run(q, kc, vc, bt, sl, H, Hkv, D)
    assert rc == 0
    torch.testing.assert_close(out, _rows_reference(q, kc, vc, bt, sl, D**-0.5), atol=3e-6, rtol=2e-5)


def test_a_tokens_bits_do_not_depend_on_its_tile_or_the_team(team):
    """A 100-token prompt in one call, in chunks of 2+ rows (the later rows over the earlier rows'
    KV, as a prefix-cache hit or chunked prefill computes them), with other sequences' rows around
    it, and on a team of 1: every row the same bits. (A chunk of one row is a decode row:
    test_lone_rows_keep_the_decode_kernels_bits.)"""
    H, Hkv, D = 9, 3, 64
    q, kc, vc, meta = make_paged_case([100, 30], [100, 30], H, Hkv, D, 16, torch.float32)
    bt, sl = per_query_tables(meta)
    rc, full = _run(q, kc, vc, bt, sl, H, Hkv, D)
    assert rc == 0 and not full.isnan().any()
    for cuts in ([0, 37, 100], [0, 2, 50, 98, 100], [0, 64, 100]):
        for a, b in zip(cuts, cuts[1:]):
            rc, part = _run(q[a:b].contiguous(), kc, vc, bt[a:b].contiguous(), sl[a:b].contiguous(), H, Hkv, D)
            assert rc == 0 and torch.equal(part, full[a:b]), (a, b)
    rows = torch.tensor([110, 111, 3, 4, 5, 120, 121, 6, 7])  # both sequences, runs of 2+ rows interleaved
    rc, mixed = _run(q[rows].contiguous(), kc, vc, bt[rows].contiguous(), sl[rows].contiguous(), H, Hkv, D)
    assert rc == 0 and torch.equal(mixed, full[rows])
    with cpu_gemm.use(cpu_gemm.Team(1)):
        rc, alone = _run(q, kc, vc, bt, sl, H, Hkv, D)
    assert rc == 0 and torch.equal(alone, full)


def test_lone_rows_keep_the_decode_kernels_bits(team):
    """Decode rows beside a prompt, and every row where a tile would hold too many query heads
    (64 per KV head), are the decode kernel's bits; tiles are not (another summation order)."""
    H, Hkv, D = 9, 3, 64
    q, kc, vc, meta = make_paged_case([1, 50, 1], [77, 50, 5], H, Hkv, D, 16, torch.float32)
    bt, sl = per_query_tables(meta)
    rc, got = _run(q, kc, vc, bt, sl, H, Hkv, D)
    rc2, dec = _run(q, kc, vc, bt, sl, H, Hkv, D, prefill=False)
    assert rc == rc2 == 0
    assert torch.equal(got[0], dec[0]) and torch.equal(got[51], dec[51])
    assert not torch.equal(got[1:51], dec[1:51])
    q, kc, vc, meta = make_paged_case([40], [40], 64, 1, 16, 16, torch.float32)
    bt, sl = per_query_tables(meta)
    rc, got = _run(q, kc, vc, bt, sl, 64, 1, 16)
    rc2, dec = _run(q, kc, vc, bt, sl, 64, 1, 16, prefill=False)
    assert rc == rc2 == 0 and torch.equal(got, dec)


def test_refused_shapes_and_lengths(team):
    """The decode kernel's checks and codes: 1 for shapes it does not take, 2 for a context
    longer than the block table; nothing written."""
    q, kc, vc, meta = make_paged_case([20], [20], 9, 3, 64, 16, torch.float32)
    bt, sl = per_query_tables(meta)
    rc, out = _run(q, kc, vc, bt, sl + 10_000, 9, 3, 64)
    assert rc == 2 and out.isnan().all()
    rc, out = _run(q, kc, vc, bt, sl, 9, 2, 64)  # 9 heads over 2 KV heads
    assert rc == 1 and out.isnan().all()


def test_the_same_bits_without_avx(team):
    """The tiles' multiply-adds are fused in every build (an FMA instruction with AVX2 + FMA and
    with AVX-512, ``fmaf`` per lane in the portable build): a library built with ``-mno-avx``
    (as on a machine without AVX) gives the same bits as this machine's."""
    import ctypes

    from rlserve.layers.cpu_build import load_library

    lib = load_library("cpu_team.c", ("-mno-avx",))
    assert lib is not None
    fn = lib.rlserve_team_paged_prefill_f32
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]
    H, Hkv, D = 9, 3, 64
    q, kc, vc, meta = make_paged_case([100, 30], [100, 40], H, Hkv, D, 16, torch.float32)
    bt, sl = per_query_tables(meta)
    rc, want = _run(q, kc, vc, bt, sl, H, Hkv, D)
    got = torch.full_like(q, float("nan"))
    assert fn(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), bt.data_ptr(), sl.data_ptr(), got.data_ptr(), q.shape[0], H,
              Hkv, D, 16, bt.shape[1], D**-0.5, 1) == 0
    assert rc == 0 and torch.equal(got, want)
