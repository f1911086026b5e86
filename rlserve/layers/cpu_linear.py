"""``F.linear`` for CPU through oneDNN where it measured faster than torch's default (MKL).

torch computes a float32 ``F.linear`` on CPU with MKL's sgemm. On AMD CPUs (the 2-core AMD
EPYC CI machine; MKL picks its code path by vendor) oneDNN's own JIT kernels are faster for
the wide, short products of an LM head: ``[N, 576] x [576, 49152]`` (SmolLM2's tied head),
one thread, CPU time (2026-12-01): N=1 13.9 -> 11.4 ms, N=8 48.7 -> 29.4 ms, N=64 113 ->
77 ms, N=256 342 -> 324 ms. For the decoder's narrower projections the two were within
noise of each other or MKL was faster, so only the LM head uses this: since 2026-12-02 as the
fallback for row counts outside :func:`packed_rows`, the head itself running on a packed copy
like the decoder's (:meth:`rlserve.layers.embedding.VocabParallelEmbedding.serve_as_lm_head`;
on the AVX2 machine, where that means 2-256 rows, the head's packed copy was not measured).

There the weight is passed as a plain dense tensor, so in-place weight updates (weight
sync) are seen at the next call with nothing to invalidate.

The decoder's linears at decode-step sizes (2-256 rows: one per running sequence) run on
a oneDNN pre-packed copy of the weight (:func:`pack_weight`, oneDNN's blocked layout for a
batch of 64): 30 layers of SmolLM2-135M's four projections, one thread, CPU time, three
interleaved runs each at load 8-10 (2026-12-01): 2 rows MKL 145-168 ms -> packed 101-107, 8
rows 185-231 -> 139-178, 32 rows 280-366 -> 217-284, 128 rows 629-802 -> 599-623, 256 rows
947-1,387 -> 877-998; 1 row 57-67 -> 78-96 (slower: one row keeps MKL, as do prefill
sizes, where MKL reaches ~65 GFLOPS, the machine's practical peak). The packed copy costs a
second copy of those weights in memory and must be rebuilt whenever the weights change:
the linear layers do it in ``process_weights_after_loading``, which the loader, every
weight-sync path and ``LLMEngine.load_weights`` call after writing weights (a test syncs new
weights and checks the served greedy tokens). ``RLSERVE_CPU_PACKED_LINEAR=0`` turns it off.
Results are float32 (oneDNN's default fp32 math mode), equal to MKL's up to summation order.

On CPUs where ATen's capability is AVX-512 (:func:`packed_rows`) every row count runs on the
packed copy, prefill included: there MKL (which picks its code path by CPU vendor) stays on
its AVX2 kernels while oneDNN uses AVX-512. Measured on the 2-core AMD EPYC machine of the
eighth session (Zen 5, AVX-512; one thread, CPU time, SmolLM2-135M's 30 layers x 4
projections, load ~2, 2026-12-02): 1 row MKL 36.0 ms -> packed 20.5, 16 rows 81.3 -> 32.5,
512 rows 1,306 -> 559, 4,096 rows 11,086 -> 5,380 (MKL ~95 GFLOPS, oneDNN ~190). The issue's
64-request workload offline: 67.8 / 69.6 -> 57.0 / 51.0 s of CPU, same greedy tokens.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from rlserve import envs

logger = logging.getLogger(__name__)

_state: dict = {}

PACK_ROWS = 64  # the batch size oneDNN's layout is chosen for
PACKED_MIN_ROWS, PACKED_MAX_ROWS = 2, 256  # where the packed copy measured faster on AVX2 (see above)


def packed_rows() -> tuple[int, float]:
    """``(lowest, highest)`` row count that runs on the packed copy on this CPU: every row
    count where ATen's CPU capability is AVX-512 (oneDNN's AVX-512 kernels, about twice
    MKL's rate there, see the module docstring), else ``PACKED_MIN_ROWS..PACKED_MAX_ROWS``
    (the AVX2 machine's measurements)."""
    if "rows" not in _state:
        try:
            cap = torch.backends.cpu.get_cpu_capability()
        except Exception:  # noqa: BLE001 - an older torch: the AVX2 rule
            cap = ""
        _state["rows"] = (1, float("inf")) if cap == "AVX512" else (PACKED_MIN_ROWS, PACKED_MAX_ROWS)
    return _state["rows"]


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


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A oneDNN pre-packed copy of ``weight [N, K]`` (float32, CPU, contiguous) for
    :func:`cpu_linear`'s ``packed``; ``None`` where packing does not apply (another device or
    dtype, oneDNN missing, ``RLSERVE_CPU_PACKED_LINEAR=0``). The copy does not follow later
    writes to ``weight``: call again after every weight update."""
    if (weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2
            or not weight.is_contiguous() or not envs.RLSERVE_CPU_PACKED_LINEAR or not _onednn_ok()):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
    except Exception as e:  # noqa: BLE001 - no packed copy: MKL
        logger.info("oneDNN weight packing unavailable, using F.linear: %s", e)
        return None


def packed_linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
                  bias: torch.Tensor | None = None, fallback=F.linear) -> torch.Tensor:
    """``x [M, K] @ weight.T + bias`` on CPU: on ``packed`` (from :func:`pack_weight` of this
    same ``weight``) for float32 2-D inputs whose row count is in :func:`packed_rows`, else
    ``fallback(x, weight, bias)``: ``F.linear`` (MKL) for the decoder's projections, where it
    was as fast as oneDNN on the plain weight; the LM head passes :func:`cpu_linear`."""
    if packed is None or x.dim() != 2:
        return fallback(x, weight, bias)
    lo, hi = packed_rows()
    if lo <= x.shape[0] <= hi and x.dtype == torch.float32 and (bias is None or bias.dtype == torch.float32):
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return fallback(x, weight, bias)
