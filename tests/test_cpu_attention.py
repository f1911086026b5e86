"""The native CPU paged decode kernel (rlserve/layers/cpu_attention.py) against dense float64
attention, and the PyTorch fallback it replaces."""

from __future__ import annotations

import pytest
import torch

from rlserve.layers import cpu_attention
from rlserve.layers.cpu_build import load_library
from rlserve.layers.attention import torch_paged_attention
from tests.attention_cases import make_paged_case


def dense_decode_reference(q, kc, vc, meta, scale):
    """One query token per sequence, attention over its whole context, in float64 from the
    block tables directly (no paged code path shared with the kernel)."""
    B, H, D = q.shape
    Hkv = kc.shape[2]
    bs = kc.shape[1]
    outs = []
    for b in range(B):
        L = meta.seq_lens_cpu[b]
        blocks = meta.block_tables[b, : -(-L // bs)].long()
        k = kc[blocks].reshape(-1, Hkv, D)[:L].double()  # [L, Hkv, D]
        v = vc[blocks].reshape(-1, Hkv, D)[:L].double()
        k = k.repeat_interleave(H // Hkv, dim=1)  # [L, H, D]
        v = v.repeat_interleave(H // Hkv, dim=1)
        s = torch.einsum("hd,lhd->hl", q[b].double(), k) * scale
        outs.append(torch.einsum("hl,lhd->hd", s.softmax(-1), v))
    return torch.stack(outs).float()


CASES = [
    # (seq_lens, H, Hkv, D, block_size)
    ([1, 5, 16, 17, 100, 333], 9, 3, 64, 16),  # SmolLM2's heads; first token, partial and full blocks
    ([7, 64, 65], 4, 4, 32, 8),  # no GQA
    ([3, 130], 8, 1, 128, 32),  # one KV head (MQA), head_dim 128
    ([40], 16, 8, 8, 1),  # block size 1
    ([1, 15, 31, 129, 200], 9, 3, 64, 24),  # blocks not a multiple of 16 tokens (AVX-512 path's tails)
    ([1, 127, 128, 300], 6, 2, 64, 128),  # vLLM CPU's block size: 8 chunks of 16 per block
    ([1, 33, 70], 8, 4, 64, 16),  # 2 query heads per KV head (the AVX-512 path's value passes of 2)
    ([18, 47], 4, 4, 80, 16),  # head_dim 80: the AVX-512 path's general head_dim, one head per value pass
]


@pytest.mark.parametrize("seq_lens,H,Hkv,D,bs", CASES)
def test_kernel_matches_dense_reference(seq_lens, H, Hkv, D, bs):
    assert cpu_attention.available(), "a C compiler is on this machine: the kernel must build"
    q, kc, vc, meta = make_paged_case([1] * len(seq_lens), seq_lens, H, Hkv, D, bs, torch.float32)
    scale = D**-0.5
    out = cpu_attention.paged_decode(q, kc, vc, meta.block_tables, meta.seq_lens, scale)
    assert out is not None and out.shape == (len(seq_lens), H, D) and out.dtype == torch.float32
    ref = dense_decode_reference(q, kc, vc, meta, scale)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-5)


def _cpu_has(flag: str) -> bool:
    try:
        return f" {flag}" in open("/proc/cpuinfo").read()
    except OSError:
        return False


# paged_decode.c has an AVX-512 path (head_dim a multiple of 16), an AVX2 + FMA one and a portable
# one (GCC vector extensions, a horizontal sum per dot product, libm's expf); -march=native compiles
# only the first it can, so the test above never reaches the others there (CI machines differ: AVX2
# and AVX-512 ones). Build the kernel once more without the faster paths and check those too.
OTHER_BUILDS = [
    pytest.param(("-mno-avx512f",), id="avx2", marks=pytest.mark.skipif(
        not _cpu_has("avx512f"), reason="no AVX-512 here: the default build above runs the AVX2 path")),
    pytest.param(("-mno-avx512f", "-mno-fma"), id="portable", marks=pytest.mark.skipif(
        not _cpu_has("avx2"), reason="no AVX2 here: the default build above runs the portable path")),
]


@pytest.mark.parametrize("flags", OTHER_BUILDS)
@pytest.mark.parametrize("seq_lens,H,Hkv,D,bs", CASES)
def test_other_paths_match_dense_reference(seq_lens, H, Hkv, D, bs, flags, monkeypatch):
    lib = load_library("paged_decode.c", flags)
    assert lib is not None, "a C compiler is on this machine: the kernel must build"
    monkeypatch.setitem(cpu_attention._state, "fn", cpu_attention.bind(lib))
    q, kc, vc, meta = make_paged_case([1] * len(seq_lens), seq_lens, H, Hkv, D, bs, torch.float32)
    out = cpu_attention.paged_decode(q, kc, vc, meta.block_tables, meta.seq_lens, D**-0.5)
    assert out is not None
    torch.testing.assert_close(out, dense_decode_reference(q, kc, vc, meta, D**-0.5), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_threads_give_the_same_result(threads):
    q, kc, vc, meta = make_paged_case([1] * 6, [9, 300, 17, 64, 2, 129], 9, 3, 64, 16, torch.float32, seed=3)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = cpu_attention.paged_decode(q, kc, vc, meta.block_tables, meta.seq_lens, 0.125)
    finally:
        torch.set_num_threads(old)
    torch.testing.assert_close(out, dense_decode_reference(q, kc, vc, meta, 0.125), atol=2e-6, rtol=2e-5)


def test_backend_uses_kernel_and_torch_fallback_agrees(monkeypatch):
    """torch_paged_attention takes the kernel for CPU float32 decode; with the kernel turned
    off (RLSERVE_CPU_ATTENTION=torch) the gather + SDPA path gives the same numbers."""
    q, kc, vc, meta = make_paged_case([1] * 5, [1, 31, 32, 33, 250], 9, 3, 64, 16, torch.float32, seed=1)
    calls = []
    real = cpu_attention.paged_decode
    monkeypatch.setattr(cpu_attention, "paged_decode", lambda *a: calls.append(1) or real(*a))
    fast = torch_paged_attention(q, kc, vc, meta, 0.125)
    assert calls, "the CPU decode path did not call the kernel"
    monkeypatch.setenv("RLSERVE_CPU_ATTENTION", "torch")
    assert real(q, kc, vc, meta.block_tables, meta.seq_lens, 0.125) is None
    slow = torch_paged_attention(q, kc, vc, meta, 0.125)
    torch.testing.assert_close(fast, slow, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(slow, dense_decode_reference(q, kc, vc, meta, 0.125), atol=2e-6, rtol=2e-5)


def test_shapes_the_kernel_does_not_take_fall_back():
    """head_dim not a multiple of 8, or a non-float32 cache: None from the kernel, and the
    backend still answers (through PyTorch)."""
    q, kc, vc, meta = make_paged_case([1, 1], [5, 20], 4, 2, 12, 16, torch.float32)
    assert cpu_attention.paged_decode(q, kc, vc, meta.block_tables, meta.seq_lens, 0.3) is None
    torch.testing.assert_close(torch_paged_attention(q, kc, vc, meta, 0.3),
                               dense_decode_reference(q, kc, vc, meta, 0.3), atol=2e-6, rtol=2e-5)
    qb, kb, vb, mb = make_paged_case([1], [20], 4, 2, 16, 16, torch.bfloat16)
    assert cpu_attention.paged_decode(qb, kb, vb, mb.block_tables, mb.seq_lens, 0.25) is None


def test_a_changed_included_source_rebuilds_the_library(tmp_path, monkeypatch):
    """The build cache's key covers the files a source includes (cpu_team.c includes
    paged_decode.c): a change to the included file gives a new build, not the cached old one
    (before: the key hashed the including file alone, and the old library kept being loaded)."""
    from rlserve.layers import cpu_build

    if cpu_build._compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(cpu_build, "CSRC", tmp_path)
    monkeypatch.setattr(cpu_build, "_libs", {})
    monkeypatch.setenv("RLSERVE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "inc.c").write_text("static int value(void) { return 1; }\n")
    (tmp_path / "top.c").write_text('#include "inc.c"\nint rlserve_test_value(void) { return value(); }\n')
    first = load_library("top.c")
    assert first is not None and first.rlserve_test_value() == 1
    (tmp_path / "inc.c").write_text("static int value(void) { return 2; }\n")
    monkeypatch.setattr(cpu_build, "_libs", {})
    second = load_library("top.c")
    assert second is not None and second.rlserve_test_value() == 2
    assert first._name != second._name
