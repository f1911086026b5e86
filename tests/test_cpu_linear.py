"""rlserve.layers.cpu_linear: the LM head's CPU product and the packed decoder linears equal F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlserve.layers import cpu_linear as cl


@pytest.fixture(autouse=True)
def _no_cpu_team():
    """oneDNN's packed copies: with a CPU team running (an engine built earlier in this process
    may have started one) a layer keeps the team's copy instead (rlserve/layers/cpu_gemm.py)."""
    from rlserve.layers import cpu_gemm

    prev = cpu_gemm.size()
    cpu_gemm.start(1)
    yield
    cpu_gemm.start(prev)


@pytest.mark.parametrize("n,bias,transposed", [(1, False, False), (7, True, False), (64, False, True)])
def test_cpu_linear_matches_f_linear(n, bias, transposed):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(576, n, generator=g).t() if transposed else torch.randn(n, 576, generator=g)
    w = torch.randn(1000, 576, generator=g)
    b = torch.randn(1000, generator=g) if bias else None
    assert cl._onednn_ok(), "torch here has oneDNN: the fast path must be taken"
    out = cl.cpu_linear(x, w, b)
    torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_weight_updated_in_place_is_seen():
    x, w = torch.randn(3, 64), torch.randn(50, 64)
    cl.cpu_linear(x, w)
    w.mul_(2)
    torch.testing.assert_close(cl.cpu_linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)


def test_other_dtypes_use_f_linear():
    x, w = torch.randn(3, 64).bfloat16(), torch.randn(50, 64).bfloat16()
    torch.testing.assert_close(cl.cpu_linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("m", [1, 2, 64, 256, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(m, bias):
    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 576, generator=g), torch.randn(960, 576, generator=g)
    b = torch.randn(960, generator=g) if bias else None
    packed = cl.pack_weight(w)
    assert packed is not None, "torch here has oneDNN: decode-sized products must use the packed copy"
    torch.testing.assert_close(cl.packed_linear(x, w, packed, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_packed_copy_follows_process_weights_after_loading(monkeypatch):
    """The packed copy is a snapshot: a layer serves new weights once its method's
    process_weights_after_loading ran (what every load path calls), and packing can be
    switched off."""
    from rlserve.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(64, 96, bias=False)
    layer.weight.data.normal_()
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(4, 64)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), atol=1e-4, rtol=1e-5)
    layer.weight.data.mul_(-3)
    layer.quant_method.process_weights_after_loading(layer)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), atol=1e-4, rtol=1e-5)
    assert cl.pack_weight(layer.weight.data.bfloat16()) is None
    monkeypatch.setenv("RLSERVE_CPU_PACKED_LINEAR", "0")
    assert cl.pack_weight(layer.weight.data) is None


@pytest.mark.parametrize("cap,rows", [("AVX512", (1, float("inf"))), ("AVX2", (2, 256)), ("DEFAULT", (2, 256))])
def test_packed_rows_follow_the_cpu_capability(monkeypatch, cap, rows):
    """AVX-512 CPUs run every row count on the packed copy (oneDNN's AVX-512 kernels beat MKL's
    AVX2 ones there); elsewhere only the 2-256 rows measured faster on the AVX2 machine."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: cap)
    monkeypatch.setattr(cl, "_state", {})
    assert cl.packed_rows() == rows
    x, w = torch.randn(1, 64), torch.randn(32, 64)
    packed = cl.pack_weight(w)
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(cl.torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a) or real(*a))
    torch.testing.assert_close(cl.packed_linear(x, w, packed), F.linear(x, w), atol=1e-4, rtol=1e-5)
    assert len(calls) == (1 if rows[0] == 1 else 0)


@pytest.mark.parametrize("tied", [True, False])
def test_lm_head_packed_copy_follows_weight_loads(tied):
    """The LM head (tied table or ParallelLMHead) gets a packed copy through
    serve_as_lm_head + process_weights_after_loading, computes the same logits as F.linear
    over the real vocabulary, and serves new weights after the next load; a table not marked
    as the head gets no copy."""
    from rlserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from rlserve.layers.linear import UnquantizedLinearMethod
    from rlserve.loader import process_weights_after_loading

    plain = VocabParallelEmbedding(1000, 64, params_dtype=torch.float32)
    if tied:
        head = VocabParallelEmbedding(1000, 64, params_dtype=torch.float32)
        head.serve_as_lm_head()
    else:
        head = ParallelLMHead(1000, 64, params_dtype=torch.float32)
    model = torch.nn.ModuleDict({"plain": plain, "head": head})
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1000, 64, generator=g)
    head.weight_loader(head.weight, w)
    process_weights_after_loading(model)
    assert UnquantizedLinearMethod.packed_weight(plain) is None
    assert UnquantizedLinearMethod.packed_weight(head) is not None
    x = torch.randn(3, 64, generator=g)
    logits = head.compute_logits(x)
    assert logits.shape == (3, 1000)
    torch.testing.assert_close(logits, F.linear(x, w), atol=1e-4, rtol=1e-5)
    head.weight_loader(head.weight, -2 * w)
    process_weights_after_loading(model)
    torch.testing.assert_close(head.compute_logits(x), F.linear(x, -2 * w), atol=1e-4, rtol=1e-5)
