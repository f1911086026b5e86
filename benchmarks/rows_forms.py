"""Each decoder linear of a decode step in the form the model runs it, at 2..64 rows, with cold weights
(issue 37): ``decode_step.py --gemms`` adds these fields to its 2..64-row rows.

``decode_step.py --gemms`` times plain ``x @ W.T`` with one weight launched 10 times over: a weight of up
to the L2's size (Qwen3-8B's o_proj, 33.5 MB; qkv_proj, 50 MB; an H100's L2 holds 50 MB) is partly read
from L2, and none of the add + RMSNorm / SiLU-and-mul the model puts before qkv / gate_up / down is in
it. Session 18 measured the small-batch GEMM at 16 rows as fast as cuBLAS there and the 8B step with it
1.9x cuBLAS's. Here each chain of 10 launches cycles through copies of the weight (at least
``COLD_BYTES`` of them together, so a weight is evicted before it comes back) and puts the model's input
op before each linear:

- ``plain`` (o_proj): ``x @ W.T``;
- ``norm`` (qkv_proj, gate_up_proj): ``rmsnorm(x + r) * w_norm @ W.T`` (and ``x + r``);
- ``silu`` (down_proj): ``(silu(g) * u) @ W.T`` of ``x = [g | u]``.

Fields (microseconds a launch, the input op's kernel included): ``cold_cublas_us`` (the fused norm /
SiLU-and-mul kernel, then ``F.linear``), ``cold_rows_us`` (that kernel, then the small-batch GEMM: the
default, ``RLSERVE_DECODE_GEMM_ROWS_FOLD=0``), ``cold_rows_fold_us`` (the op folded into the GEMM's input
loads, ``=1``; not for ``plain``), ``form``, ``cold_copies``.
"""

from __future__ import annotations

import torch

COLD_BYTES = 160 * 1024 ** 2  # > 3x an H100's 50 MB L2 (an H200's is 50 MB too)
MAX_COPIES = 10  # the chain's length: every launch its own weight at most
EPS = 1e-6


def form_of(linear: str) -> str:
    """``"norm"``, ``"silu"`` or ``"plain"``: the input op the decoder layer puts before ``linear``."""
    return {"qkv": "norm", "gate_up": "norm", "down": "silu"}.get(linear, "plain")


def rows_forms(linear: str, M: int, w: torch.Tensor, iters: int, chain_us) -> dict:
    """The fields above for ``w [N, K]`` (bf16, CUDA) at ``M`` rows; ``chain_us(f, iters, chain)``:
    decode_step's microseconds a call of ``f`` in a chain of ``chain`` calls replayed from a CUDA graph."""
    from rlserve.layers import fused_ops, gemv, pdl

    N, K = w.shape
    form = form_of(linear)
    copies = max(1, min(MAX_COPIES, -(-COLD_BYTES // (w.numel() * w.element_size()))))
    ws = [w] + [w.clone() for _ in range(copies - 1)]
    g = torch.Generator(device=w.device).manual_seed(M)
    x = torch.randn(M, 2 * K if form == "silu" else K, generator=g, device=w.device).to(w.dtype)
    r = torch.randn(M, K, generator=g, device=w.device).to(w.dtype)
    nw = (1 + 0.1 * torch.randn(K, generator=g, device=w.device)).to(w.dtype)

    def unfold():  # the model's input op as its own kernel
        if form == "norm":
            return fused_ops.rms_norm(x, nw, EPS, r)[0]
        return fused_ops.silu_and_mul(x) if form == "silu" else x

    def cycled(body):
        n = [0]

        def f():
            n[0] += 1
            return body(ws[n[0] % copies])
        return lambda: chain_us(f, iters, 10)

    out = {"form": form, "cold_copies": copies,
           "cold_cublas_us": cycled(lambda wi: torch.nn.functional.linear(unfold(), wi))()}
    prev = gemv.set_pdl(pdl.unavailable(w.device) is None)
    try:
        out["cold_rows_us"] = cycled(lambda wi: gemv._launch_rows(0, unfold(), K, wi, None)[0])()
        if form == "norm":
            out["cold_rows_fold_us"] = cycled(
                lambda wi: gemv._launch_rows(1, x, K, wi, None, residual=r, norm_weight=nw, eps=EPS)[0])()
        elif form == "silu":
            out["cold_rows_fold_us"] = cycled(lambda wi: gemv._launch_rows(2, x, K, wi, None)[0])()
    finally:
        gemv.set_pdl(prev)
    del ws
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}
