"""rlserve.layers.cpu_linear: the LM head's CPU product equals F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlserve.layers import cpu_linear as cl


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
