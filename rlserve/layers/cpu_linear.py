"""``F.linear`` for CPU through oneDNN where it measured faster than torch's default (MKL).

torch computes a float32 ``F.linear`` on CPU with MKL's sgemm. On AMD CPUs (the 2-core AMD
EPYC CI machine; MKL picks its code path by vendor) oneDNN's own JIT kernels are faster for
the wide, short products of an LM head: ``[N, 576] x [576, 49152]`` (SmolLM2's tied head),
one thread, CPU time (2026-12-01): N=1 13.9 -> 11.4 ms, N=8 48.7 -> 29.4 ms, N=64 113 ->
77 ms, N=256 342 -> 324 ms. For the decoder's narrower projections the two were within
noise of each other or MKL was faster, so only the LM head uses this.

The weight is passed as a plain dense tensor (no oneDNN pre-packed copy), so in-place
weight updates (weight sync) are seen at the next call with nothing to invalidate. Results
are float32 (oneDNN's default fp32 math mode), equal to MKL's up to summation order.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

_state: dict = {}


def _onednn_ok() -> bool:
    if "ok" not in _state:
        ok = False
        try:
            if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
                x, w = torch.randn(2, 16), torch.randn(24, 16)
                ok = torch.allclose(torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), F.linear(x, w),
                                    atol=1e-5, rtol=1e-5)
        except Exception as e:  # noqa: BLE001 - any failure means "use F.linear"
            logger.info("oneDNN linear unavailable, using F.linear: %s", e)
        _state["ok"] = ok
    return _state["ok"]


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [N, K] @ weight[M, K].T + bias`` -> ``[N, M]`` on CPU; oneDNN for float32 2-D
    inputs when available (see the module docstring), else ``F.linear``."""
    if (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.dim() == 2 and x.shape[0] > 0
            and weight.is_contiguous() and (bias is None or bias.dtype == torch.float32) and _onednn_ok()):
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
