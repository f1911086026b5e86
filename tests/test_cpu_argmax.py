"""The C row argmax (``rlserve.layers.cpu_argmax``) against ``torch.argmax(dim=-1)``: ties, NaN,
+-inf, signed zeros, widths around the kernel's 16/32-lane blocks, rows with a stride."""

from __future__ import annotations

import pytest
import torch

from rlserve.layers import cpu_argmax

pytestmark = pytest.mark.skipif(cpu_argmax._lib() is None, reason="no C compiler")


def _rows(B: int, V: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randint(-3, 4, (B, V), generator=g).float()  # few values: ties everywhere
    for r in range(B):
        kind = r % 6
        j = int(torch.randint(0, V, (1,), generator=g))
        if kind == 0:
            x[r] = float("-inf")
        elif kind == 1:
            x[r, j] = float("nan")
            x[r, V - 1] = float("nan")
        elif kind == 2:
            x[r, j] = float("inf")
        elif kind == 3:
            x[r] = torch.where(torch.rand(V, generator=g) < 0.5, -0.0, 0.0)
        elif kind == 4:
            x[r] = torch.randn(V, generator=g)
    return x


@pytest.mark.parametrize("V", [1, 15, 16, 17, 31, 32, 33, 63, 64, 100, 1000, 49152 + 7])
def test_equals_torch_argmax(V):
    g = torch.Generator().manual_seed(V)
    x = _rows(12, V, g)
    assert torch.equal(cpu_argmax.argmax_rows(x), x.argmax(dim=-1))
    if V > 1:
        view = x[:, 1:]  # row stride V, not the width
        assert torch.equal(cpu_argmax.argmax_rows(view), view.argmax(dim=-1))


def test_special_rows():
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[-inf, -inf, -inf], [1.0, nan, nan], [inf, inf, 2.0], [-0.0, 0.0, -1.0], [2.0, 5.0, 5.0]])
    assert cpu_argmax.argmax_rows(x).tolist() == [0, 1, 0, 0, 1]


def test_other_tensors_take_torch():
    x = torch.randn(3, 40, dtype=torch.float64)
    assert torch.equal(cpu_argmax.argmax_rows(x), x.argmax(dim=-1))
    t = torch.randn(40, 3).t()  # column stride 3
    assert torch.equal(cpu_argmax.argmax_rows(t), t.argmax(dim=-1))
