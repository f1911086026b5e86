"""The decode-sized linear kernels (rlserve/layers/skinny_gemm.py) on CPU through Triton's
interpreter: equal to a float32 reference up to the output rounding, bias and odd sizes
included, and used by the linear layers only where they apply."""

import pytest
import torch

import tests.triton_interp  # noqa: F401  (skips this module, or sets TRITON_INTERPRET=1 first)
from rlserve.layers import skinny_gemm  # noqa: E402


@pytest.fixture()
def skinny():

    prev = skinny_gemm.set_max_rows(64, on_cpu=True)
    yield skinny_gemm
    skinny_gemm.set_max_rows(*prev)


@pytest.mark.parametrize("M,N,K,bias", [(1, 40, 600, False), (1, 16, 64, True), (3, 48, 200, True),
                                         (17, 33, 130, False)])
def test_skinny_linear_equals_float32_reference(skinny, M, N, K, bias):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x = torch.randn(M, K, generator=g).to(torch.float16)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(torch.float16)
    b = torch.randn(N, generator=g).to(torch.float16) if bias else None
    assert skinny.takes(x, w)
    out = skinny.linear(x, w, b)
    ref = x.float() @ w.float().T + (b.float() if bias else 0)
    assert out.dtype == torch.float16 and out.shape == (M, N)
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)  # fp16 output rounding


def test_skinny_applies_only_where_it_should(skinny):
    w = torch.zeros(8, 16, dtype=torch.float16)
    assert not skinny.takes(torch.zeros(65, 16, dtype=torch.float16), w)  # too many rows
    assert not skinny.takes(torch.zeros(2, 16), w.float())  # float32: F.linear
    assert not skinny.takes(torch.zeros(2, 16, dtype=torch.bfloat16), w)  # dtypes differ
    skinny.set_max_rows(0, on_cpu=True)
    assert not skinny.takes(torch.zeros(2, 16, dtype=torch.float16), w)  # switched off
