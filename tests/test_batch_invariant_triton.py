"""The batch-invariant mode's CUDA forms on CPU, through Triton's interpreter
(``TRITON_INTERPRET=1``; rlserve/batch_invariant/gpu.py, the attention hooks of
rlserve/layers/triton_attention.py): the Triton GEMM's rows and the attention of a token do
not depend on the rest of the batch, bit for bit. float32 only (the interpreter has no bf16
matmul); tests/gpu/test_batch_invariant_gpu.py runs the compiled kernels in bf16."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

import tests.triton_interp  # noqa: F401  (skips this module, or sets TRITON_INTERPRET=1 first)

for _name in ("rlserve.layers.triton_attention_kernels", "rlserve.batch_invariant.query_tiles",
              "rlserve.layers.triton_attention", "rlserve.batch_invariant.gemm_tma",
              "rlserve.batch_invariant.gpu"):
    if _name in sys.modules:  # built without the interpreter: rebuild
        importlib.reload(sys.modules[_name])
from rlserve.batch_invariant import gemm_table, gpu as bi_gpu, mode as bi_mode  # noqa: E402
from rlserve.layers import triton_attention as ta  # noqa: E402
from rlserve.layers.attention import AttentionMetadata, torch_paged_attention  # noqa: E402
from tests.attention_cases import make_paged_case  # noqa: E402


@pytest.mark.parametrize("K,N,bias", [(96, 80, True), (40, 33, False)])
def test_triton_gemm_rows_do_not_depend_on_the_row_count(K, N, bias):
    g = torch.Generator().manual_seed(K)
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    x = torch.randn(70, K, generator=g)
    one = torch.cat([bi_gpu.linear(x[i:i + 1], w, b) for i in range(70)])
    for m in (2, 5, 33, 70):
        assert torch.equal(bi_gpu.linear(x[:m], w, b), one[:m]), m
    assert torch.equal(bi_gpu.linear(x[9:40], w, b), one[9:40])  # another place in the batch
    # float32 IEEE products summed over K <= 96 terms: within 1e-5 of torch's sum order
    torch.testing.assert_close(one, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert bi_gpu.linear(x[:0], w, b).shape == (0, N)
    with pytest.raises(ValueError, match="does not take inputs of 40 features"):
        bi_gpu.linear(torch.zeros(2, 40), torch.zeros(3, 41))


def test_config_depends_on_n_k_and_dtype_only():
    assert bi_gpu.config(1024, 3072, torch.bfloat16) == bi_gpu.config(1024, 3072, torch.bfloat16)
    assert bi_gpu.config(151936, 1024, torch.bfloat16)["BLOCK_N"] == 128
    assert "M" not in str(bi_gpu.config.__code__.co_varnames[:bi_gpu.config.__code__.co_argcount])


def test_every_tile_reduces_k_the_same_way():
    """The tile follows M, the reduction order must not (gpu.py's docstring): every tile of
    TILES has BLOCK_K 64 and 4 warps per 64 rows (one warpgroup per wgmma m64 step)."""
    assert bi_gpu.TILES[:2] == ((128, 128, 8, 3), (64, 128, 4, 4))  # session 13's fixed tiles first
    for bm, bn, warps, stages in bi_gpu.TILES:
        assert bm % 64 == 0 and warps == 4 * bm // 64 and bn % 16 == 0 and stages >= 2
    assert bi_gpu.BLOCK_K == 64 and bi_gpu.config(4096, 4096, torch.bfloat16)["BLOCK_K"] == 64


@pytest.mark.parametrize("M,N,want", [
    (8192, 1024, (128, 128)),   # a prefill: the largest tile (64 x 8 = 512 tiles)
    (128, 151936, (128, 128)),  # the LM head in decode: 1,187 tiles already
    (1, 151936, (128, 128)),
    (64, 4096, (64, 32)),       # Qwen3-8B's o_proj at batch 64: 128 tiles (64 x 128 gave 32)
    (128, 4096, (64, 64)),      # Qwen3-0.6B's q/k/v at batch 128: 2 x 64 = 128 tiles
    (1, 1024, (64, 16)),        # nothing reaches 99: the most tiles (64)
    (256, 24576, (128, 128)),   # 2 x 192
])
def test_tile_fills_the_sms_from_the_largest(M, N, want):
    """132 SMs (the H100 / H200): the first tile whose count reaches 99 (3/4 of them)."""
    got = bi_gpu.tile(M, N, 4096, torch.bfloat16, 132)
    assert (got["BLOCK_M"], got["BLOCK_N"]) == want
    assert got["BLOCK_K"] == 64 and got["num_warps"] == 4 * want[0] // 64
    assert bi_gpu.tile(M, N, 4096, torch.float32, 132) == bi_gpu.config(N, 4096, torch.float32)


@pytest.mark.parametrize("shape", bi_gpu.TILES)
def test_every_tile_computes_the_product(shape):
    """Each tile shape of the kernel (masks at the M, N and K edges: 70 x 100 x 200 is no multiple
    of any tile), forced with ``tile_shape``, float32 in the interpreter: the product within
    float32 rounding of torch's (IEEE products, 200 terms: 1e-5); the bias added once."""
    g = torch.Generator().manual_seed(5)
    w, b, x = torch.randn(100, 200, generator=g), torch.randn(100, generator=g), torch.randn(70, 200, generator=g)
    got = bi_gpu.linear(x, w, b, tile_shape=shape)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="is not one of"):
        bi_gpu.linear(x, w, b, tile_shape=(32, 32, 4, 2))


@pytest.mark.parametrize("form", ["tiles", "per_query"])
@pytest.mark.parametrize("H", [4, 6])
def test_attention_of_a_token_is_the_same_in_every_kind_of_step(form, H, monkeypatch):
    """A prompt in one prefill, in two chunks (the second over the cached first), next to
    another prompt, and each of its tokens as a decode step alone or among other decode rows:
    the same bits with the mode on (and the torch reference's values up to float32 rounding).
    Both prefill forms (rlserve/batch_invariant/query_tiles.py: 8 query tokens per program for
    2 heads per KV head, 5 for 3, so tiles end inside the prompt and its chunks)."""
    from rlserve.batch_invariant import query_tiles

    monkeypatch.setattr(query_tiles, "FORM", [form])
    Hkv, D, bs, n = 2, 16, 4, 37
    q, kc, vc, meta = make_paged_case([n], [n], H, Hkv, D, bs, torch.float32, spare_blocks=12)
    table = meta.block_tables[0].tolist()
    others = [10 + i for i in range(3)]  # spare blocks: a neighbour's context
    with bi_mode.active(True):
        whole = ta.triton_paged_attention(q, kc, vc, meta, 0.25)
        tiled = [k for k in meta.backend_cache if isinstance(k, tuple) and k[0] == "bi_query_tiles"]
        assert tiled == ([("bi_query_tiles", 16 // (H // Hkv))] if form == "tiles" else [])
        a = ta.triton_paged_attention(q[:11], kc, vc, AttentionMetadata.build([11], [11], [table], bs), 0.25)
        b = ta.triton_paged_attention(q[11:], kc, vc, AttentionMetadata.build([n - 11], [n], [table], bs), 0.25)
        two = ta.triton_paged_attention(torch.cat([q[:5], q]), kc, vc,
                                        AttentionMetadata.build([5, n], [12, n], [others, table], bs), 0.25)
        dec = {}
        for t in (0, 3, 36):
            alone = ta.triton_paged_attention(q[t:t + 1], kc, vc, AttentionMetadata.build([1], [t + 1], [table], bs),
                                              0.25)
            many = ta.triton_paged_attention(torch.cat([q[:6], q[t:t + 1]]), kc, vc, AttentionMetadata.build(
                [1] * 7, [12] * 6 + [t + 1], [others] * 6 + [table], bs), 0.25)
            dec[t] = (alone[0], many[6])
    assert torch.equal(torch.cat([a, b]), whole)
    assert torch.equal(two[5:], whole)
    for t, (alone, many) in dec.items():
        assert torch.equal(alone, whole[t]) and torch.equal(many, whole[t]), t
    ref = torch_paged_attention(q, kc, vc, meta, 0.25)
    torch.testing.assert_close(whole, ref, atol=2e-6, rtol=1e-5)  # as test_triton_interpret's fp32 bound


def test_without_the_mode_the_split_plan_follows_the_batch():
    """The control: with the mode off a decode row's split count (hence its bits) depends on
    the batch size; the mode pins it to one split."""
    assert ta.plan_num_splits(1, 2, 512, torch.device("cpu")) > ta.plan_num_splits(64, 2, 512, torch.device("cpu"))


def test_sampling_row_takes_its_own_path_whatever_the_neighbours(monkeypatch):
    """With the mode on, a seeded temperature row (the fused sampler's kind) gets the same
    token and logprob alone, among rows the fused sampler takes, and among rows it does not
    (top-p, logprobs): a mixed batch is split by row (rlserve/engine/core/sample_split.py).
    (Without the mode a mixed batch moves every row to the general sampler, another draw.)
    Every row's logprob is bitwise ``log_softmax`` of its logits, whichever sampler drew it
    (the fused sampler's own chunked log-sum-exp differed by an ulp on the H100)."""
    from rlserve.engine.core import fused_sampling
    from rlserve.engine.core.sampler import Sampler, SamplingMetadata
    from rlserve.engine.sampling_params import SamplingParams
    from rlserve.layers import fused_ops

    prev = fused_ops.set_fused_kernels(True, on_cpu=True)
    monkeypatch.setattr(fused_sampling, "_BLOCK", 16)  # the interpreter stays fast
    # few programs per call: without the mode the chunk count would follow the batch (8 at B=1, 2 at B=6)
    monkeypatch.setattr(fused_sampling, "_TARGET_PROGRAMS", 8)
    try:
        V = 120
        g = torch.Generator().manual_seed(3)
        logits = torch.randn(6, V, generator=g) * 2
        target = SamplingParams(temperature=0.8, seed=11)
        # (the general-path row asks for logprobs: a row that does not gets NaN there, lean_sampling's rule)
        others = [SamplingParams(temperature=1.0, top_p=0.9, seed=1, logprobs=0), SamplingParams(temperature=0.0, logprobs=3),
                  SamplingParams(temperature=0.7, seed=5), SamplingParams(temperature=1.0, seed=2),
                  SamplingParams(temperature=0.0)]
        sampler = Sampler(set(), V)

        def run(params, rows):
            meta = SamplingMetadata(params=params, prompt_token_ids=[[1]] * len(params),
                                    output_token_ids=[[4, 5]] * len(params))
            return sampler(logits[rows], meta)

        with bi_mode.active(True):
            alone = run([target], [0])
            fused_mix = run([target, others[2], others[3]], [0, 3, 4])
            mixed = run([target] + others, [0, 1, 2, 3, 4, 5])
        for out in (fused_mix, mixed):
            assert out.token_ids[0] == alone.token_ids[0]
            assert torch.equal(out.logprobs[0], alone.logprobs[0])
        # every row's logprob is log_softmax's (the general sampler's, the trainer-side reference's)
        lsm = torch.log_softmax(logits, dim=-1)
        for out, rows in ((alone, [0]), (fused_mix, [0, 3, 4]), (mixed, [0, 1, 2, 3, 4, 5])):
            want = lsm[rows].gather(1, out.token_ids.view(-1, 1)).squeeze(1)
            assert torch.equal(out.logprobs, want), (out.logprobs - want).abs().max()
        assert mixed.topk_token_ids.shape == (6, 3)
        assert mixed.topk_token_ids[2].tolist() == logits[2].topk(3).indices.tolist()  # the general rows' top-3
        assert mixed.token_ids[5] == logits[5].argmax()
    finally:
        fused_ops.set_fused_kernels(*prev)


def test_a_tile_that_fails_to_launch_is_skipped(monkeypatch):
    """A tile the device's Triton cannot compile (its launch raises) is marked broken and the
    next tile of TILES serves, then and from now on; an error on every tile is raised (not
    hidden). The launch is faked: the interpreter has no bf16 dot."""
    monkeypatch.setattr(bi_gpu, "BROKEN", set())
    monkeypatch.setattr(bi_gpu, "_num_sms", lambda device: 132)
    launched = []

    def fake_launch(a, w, out, bias, cfg):
        t = (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"])
        launched.append(t)
        if t == (64, 16, 4, 6) or fail_all[0]:
            raise RuntimeError(f"cannot compile {t}")
        out.copy_(torch.nn.functional.linear(a.float(), w.float()).to(out.dtype))

    fail_all = [False]
    monkeypatch.setattr(bi_gpu, "_launch", fake_launch)
    x, w = torch.randn(1, 64).bfloat16(), torch.randn(1024, 64).bfloat16()  # M = 1, N = 1024: 64 x 16 first
    got = bi_gpu.linear(x, w)
    assert launched == [(64, 16, 4, 6), (64, 32, 4, 5)] and bi_gpu.BROKEN == {(64, 16, 4, 6)}
    assert torch.equal(got, torch.nn.functional.linear(x.float(), w.float()).bfloat16())
    launched.clear()
    bi_gpu.linear(x, w)
    assert launched == [(64, 32, 4, 5)]  # skipped from now on
    fail_all[0] = True
    with pytest.raises(RuntimeError, match="cannot compile"):
        bi_gpu.linear(x, w)
    assert len(bi_gpu.BROKEN) == len(bi_gpu.TILES) - 1  # the last one's error is raised, not swallowed


@pytest.mark.parametrize("i", range(len(gemm_table._SHAPES) + len(gemm_table._SWAPPED) + len(gemm_table._TMA)))
def test_every_candidate_computes_the_product(i):
    """Each launch configuration a GEMM table may name (gemm_table.CANDIDATES: BLOCK_K 64 / 128,
    one program per SM, two, or one per tile, the swapped form, TMA loads), float32 in the interpreter, K = 200 (no multiple of
    BLOCK_K: the masked K loop) and K = 256 (the unmasked one), 70 x 100 (M and N edges): the
    product within float32 rounding of torch's (IEEE products, two orders of K sums of terms of
    about unit size: each within K x 2**-24 of exact, so K x 2**-23 apart at most)."""
    g = torch.Generator().manual_seed(i)
    for K in (200, 256):
        w, b, x = torch.randn(100, K, generator=g), torch.randn(100, generator=g), torch.randn(70, K, generator=g)
        n, n2 = len(gemm_table._SHAPES), len(gemm_table._SHAPES) + len(gemm_table._SWAPPED)
        shape, swap, tma = ((gemm_table._SHAPES[i], 0, 0) if i < n else (gemm_table._SWAPPED[i - n], 1, 0) if i < n2
                            else (gemm_table._TMA[i - n2], 0, 1))
        cfg = gemm_table.Cfg(*shape, gemm_table.WAVES[i % len(gemm_table.WAVES)], swap, tma)
        got = bi_gpu.linear(x, w, b, cfg=cfg)
        torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=K * 2 ** -23)
    with pytest.raises(ValueError, match="is not one of gemm_table.CANDIDATES"):
        bi_gpu.linear(x, w, b, cfg=(32, 32, 32, 4, 2, 1))
