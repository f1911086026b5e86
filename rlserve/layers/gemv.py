"""Batch-1 decode GEMV (Triton) with the preceding elementwise op folded into it.

At batch 1 a decode step is one matrix-vector product per linear layer, and on a Qwen3-0.6B
step each of them is small (4-13 MB of bf16 weights: 1-3 us of HBM time on an H100/H200), so
the launches and the dependent small kernels between them set the step time, not bytes
(``benchmarks/decode_step.py``: 1.34 ms per graph-replayed step against a 0.31 ms HBM floor on
an H200, issue 37). Here one kernel does what took two:

- :func:`norm_linear` -- ``W @ rmsnorm(x + residual)`` (the decoder layer's fused add + RMSNorm
  before ``qkv_proj`` / ``gate_up_proj``): every program reduces ``sum((x + r)^2)`` over the
  ``K`` (hidden size) values itself, so no separate norm kernel; program 0 stores ``x + r``
  (the next residual).
- :func:`silu_mul_linear` -- ``W @ (silu(gate) * up)`` (``down_proj`` reads ``gate_up_proj``'s
  output; no SiLU-and-mul kernel).
- :func:`linear` -- the plain GEMV (``o_proj``).

Rounding: the folded op's output is rounded to the model dtype where the unfused ops round
(:mod:`rlserve.layers.fused_ops`: residual sum, norm, times the weight; SiLU, times up), so the
GEMV sees the same input vector (up to the order of the norm's float32 mean); the dot product
accumulates in float32 in its own order (cuBLAS's differs: bf16 results may differ by one
rounding of the output). One program per ``BLOCK_N`` output rows reads its rows' whole ``K``
(:func:`tile`).

When it runs (:func:`takes`): ``RLSERVE_DECODE_GEMV`` ``auto`` (the default: only linears of at
most ``_AUTO_MAX_ELEMENTS`` weights, the sizes measured faster than cuBLAS), ``pdl`` or ``1`` (every
size), not ``0`` (:func:`set_enabled`, :func:`set_pdl`), and the
fused kernels on a Triton device (:func:`rlserve.layers.fused_ops.triton_enabled`), exactly one
row, ``--batch-invariant`` off (its own kernels keep their bitwise contract), and every linear
unquantized (:class:`~rlserve.layers.linear.UnquantizedLinearMethod`), tensor-parallel size 1,
contiguous, in the input's dtype, with no forward hook that would run (a direct kernel call
skips hooks; LoRA's hooks, :mod:`rlserve.lora.model`, count only during a step with adapters: a
batch-1 step on the base model or on a merged adapter takes the GEMV with ``--enable-lora`` too).
The decision is per call, on static facts and on whether the step runs adapters, so a CUDA graph
captured at batch 1 holds what an eager batch-1 step of its kind runs (graphs = eager; the LoRA
decode graphs are captured inside a step with adapters).

Small batches (``RLSERVE_DECODE_GEMM_ROWS=N``, :func:`set_rows`, default off): a step of 2..N rows
(N <= 64) takes the same three forms through one tensor-core GEMM kernel each
(:mod:`rlserve.layers.gemm_rows_kernels`: weights streamed in pipelined tiles, ``K`` split where the
column tiles alone leave SMs idle and reduced in the same launch), for linears of every size; the other
conditions as above. The add + RMSNorm / SiLU-and-mul run as their own fused kernel before the plain GEMM
(:func:`set_rows_fold` / ``RLSERVE_DECODE_GEMM_ROWS_FOLD=1``: folded into the GEMM's input loads, the
norm's per-row scale applied after the dot products; ``_ROWS_FOLD`` says why that is not the default). A row's arithmetic depends
on the row tile (16, 32 or 64 rows, :func:`rows_tile`) and ``(N, K)`` only: a CUDA graph padded to a
capture size computes its real rows as the eager step does.

Programmatic dependent launch (``pdl``): :mod:`rlserve.layers.pdl` (what it needs from the card,
driver and Triton; where it is missing the GEMVs launch plainly, the same arithmetic).
"""

from __future__ import annotations

import torch
from torch import nn

from rlserve import envs
from rlserve.batch_invariant import mode as bi_mode
from rlserve.layers import fused_ops, pdl
from rlserve.layers.linear import ColumnParallelLinear, UnquantizedLinearMethod
from rlserve.layers.norm import RMSNorm

# False, True (every size) or "auto" (linears of at most _AUTO_MAX_ELEMENTS weights)
_ENABLED: list = [{"0": False, "auto": "auto"}.get(envs.RLSERVE_DECODE_GEMV, True)]
# "auto": the largest weight measured faster than cuBLAS is Qwen3-8B's gate_up_proj (24576 x 4096
# = 100.7M: 66.7 vs 68.6 us; qkv 19.0 vs 21.1, o 7.8 vs 11.3, down 33.6 vs 38.4; the batch-1 graph step
# 6.04 vs 6.36 ms, 1.20x vs 1.26x its HBM floor; H100, session 18, BENCHMARKS.md D5); Qwen3-0.6B's
# (<= 6.3M) since session 14 (D3/D4). Larger linears are not measured: they keep cuBLAS
_AUTO_MAX_ELEMENTS = 1 << 27
_K: list = []  # the kernel module, once imported
# Tiles: a program reads BLOCK_N whole rows of W, in chunks of BLOCK_K = min(next_pow2(K),
# _MAX_BLOCK_K) columns (one chunk up to K = 4096: Qwen3-0.6B's and -8B's hidden sizes). BLOCK_N:
# the largest power of two up to _MAX_BLOCK_N whose tile holds at most _MAX_TILE elements and that
# leaves at least _PROGRAMS_PER_SM programs per SM (many loads in flight hide HBM latency).
_MAX_BLOCK_N = 16
_MAX_BLOCK_K = 4096
_MAX_TILE = 16384  # elements of W per chunk (4 warps up to 4096, else 8: <= 64 values a thread)
_PROGRAMS_PER_SM = 2  # every program also reads x (and r) from L2: 1 / BLOCK_N of its bytes
# Small batches (2..RLSERVE_DECODE_GEMM_ROWS rows, gemm_rows_kernels): the most rows the switch allows, the
# row tiles (a step of M rows takes the smallest that holds M; 16, 32 and 64 are CUDA-graph capture sizes,
# so a padded graph batch has the tile of the eager batch it stands for: graphs = eager), the weight tile
# and the programs wanted in flight (K is split until the grid has them).
_ROWS = [envs.RLSERVE_DECODE_GEMM_ROWS]
MAX_ROWS = 64
_ROW_TILES = (16, 32, 64)
# (BLOCK_N, BLOCK_K, num_stages) of each row tile: shared memory = stages x (BLOCK_M + BLOCK_N) x BLOCK_K x 2
# bytes (bf16; sm_90 AOT compile, Triton 3.6), and _ROWS_PROGRAMS_PER_SM of them must fit an SM's 228 KB.
# 16 / 32 rows: 64 x 128 weight tiles, 4 stages (60 / 72 KB: 3 programs an SM fit). 64 rows: 128 columns
# (every program reads its rows' x from L2: M / BLOCK_N of the weight bytes) x 64, 4 stages (96 KB: 2 fit).
# Until session 18 the 64-row tile was 128 x 128 x 3 stages: 144 KB, one program an SM, so the split plan's
# two programs an SM ran as two waves of 4-7 K steps each (8B at 64 rows: o_proj 25.7 us vs cuBLAS's 9.5).
_ROWS_TILE = {16: (64, 128, 4), 32: (64, 128, 4), 64: (128, 64, 4)}
_ROWS_PROGRAMS_PER_SM = 2
# the folded prologues (add + RMSNorm into qkv / gate_up, SiLU-and-mul into down; RLSERVE_DECODE_GEMM_ROWS_FOLD):
# off by default. Each of the GEMM's programs redoes its K range of the prologue for its own column tile
# (N / BLOCK_N times over: 64 for Qwen3-8B's down_proj), which at 16 rows costs more issue slots than the
# tile's dot products (sm_90 SASS of the K loop, Triton 3.6, benchmarks/rows_sass.py: 145 instructions
# plain, ~300 with the norm, 1067 with SiLU-and-mul: the 4 warps each hold the whole input tile in the MMA's
# operand layout); the 8B step with them measured 13.7 ms against cuBLAS's 7.3 (H100, session 18, BENCHMARKS
# D5). Off: one fused norm / SiLU-and-mul kernel (fused_ops) before the plain GEMM.
_ROWS_FOLD = [envs.RLSERVE_DECODE_GEMM_ROWS_FOLD]
_CNT: dict = {}  # device -> int32 tile counters of the split-K reduction (zero between launches)
_CNT_SIZE = 1024


def set_enabled(on: bool | str) -> bool | str:
    """Switch the batch-1 GEMV path on (every size), ``"auto"`` (linears of at most
    ``_AUTO_MAX_ELEMENTS`` weights) or off for this process (A/B runs, tests); returns the previous
    setting (pass it back to restore). CUDA graphs captured before the switch keep what they captured."""
    prev = _ENABLED[0]
    _ENABLED[0] = on if on == "auto" else bool(on)
    return prev


def set_pdl(on: bool) -> bool:
    """Launch the GEMVs (and, :func:`rlserve.layers.pdl.set_neighbours`, the batch-1 decode kernels
    between them) with programmatic dependent launch where it runs
    (:func:`rlserve.layers.pdl.unavailable`): a GEMV loads its first weights while the kernel before
    it finishes (see ``gemv_kernels._gemv_kernel``). Returns the previous setting; graphs captured
    before keep what they captured."""
    return pdl.set_requested(on)


def set_rows(n: int) -> int:
    """Run steps of 2..``n`` rows (``n <= MAX_ROWS``; 0 or 1: none) through the small-batch GEMM
    (module docstring); returns the previous setting. CUDA graphs captured before keep what they
    captured."""
    if not 0 <= int(n) <= MAX_ROWS:
        raise ValueError(f"GEMM rows must be in 0..{MAX_ROWS}, got {n}")
    prev = _ROWS[0]
    _ROWS[0] = int(n)
    return prev


def set_rows_fold(on: bool) -> bool:
    """Fold the add + RMSNorm / SiLU-and-mul into the small-batch GEMM's input loads (``True``) or run
    them as one fused kernel before the plain GEMM (``False``, the default: ``_ROWS_FOLD``'s note);
    returns the previous setting. CUDA graphs captured before keep what they captured."""
    prev = _ROWS_FOLD[0]
    _ROWS_FOLD[0] = bool(on)
    return prev


def pdl_requested() -> bool:
    """The :func:`set_pdl` switch (whether a GPU has PDL is checked per launch)."""
    return pdl.requested()


def mode() -> str:
    """``"0"``, ``"auto"``, ``"1"`` or ``"pdl"``: what :func:`set_enabled` / :func:`set_pdl` (or
    ``RLSERVE_DECODE_GEMV``) asked for (``"auto"``: whatever :func:`set_pdl` says); whether PDL runs
    on a device is :func:`rlserve.layers.pdl.unavailable`."""
    if not _ENABLED[0]:
        return "0"
    return "auto" if _ENABLED[0] == "auto" else "pdl" if pdl.requested() else "1"


def enabled() -> bool:
    """The process-wide switch (``RLSERVE_DECODE_GEMV``, :func:`set_enabled`): on for some sizes."""
    return bool(_ENABLED[0])


def _runs(hook) -> bool:
    """Whether a forward hook does anything now: not when it carries an ``idle()`` that says so
    (LoRA's permanent hooks between steps with adapters, :meth:`rlserve.lora.model.LoRAModel._hook`)."""
    idle = getattr(hook, "idle", None)
    return idle is None or not idle()


def no_hooks(*mods: nn.Module) -> bool:
    """None of ``mods`` has a forward pre-hook or a forward hook that runs now (:func:`_runs`): a
    direct kernel call would skip it."""
    return not any(m._forward_pre_hooks or any(_runs(h) for h in m._forward_hooks.values()) for m in mods)


def _linear_ok(lin: nn.Module, x: torch.Tensor, any_size: bool) -> bool:
    w = getattr(lin, "weight", None)
    return (type(getattr(lin, "quant_method", None)) is UnquantizedLinearMethod
            and getattr(lin, "tp_size", 1) == 1 and w is not None and w.dtype == x.dtype and w.dim() == 2
            and (any_size or _ENABLED[0] != "auto" or w.numel() <= _AUTO_MAX_ELEMENTS)
            and w.stride(1) == 1 and not (isinstance(lin, ColumnParallelLinear) and lin.gather_output)
            and (lin.bias is None or lin.bias.dtype == x.dtype) and no_hooks(lin))


def takes(x: torch.Tensor, *linears: nn.Module) -> bool:
    """Whether the GEMV kernel runs ``x [1, K]`` (or the small-batch GEMM ``x [M, K]``, ``2 <= M <=``
    :func:`set_rows`'s ``n``, every linear size) through each of ``linears`` (module docstring)."""
    if not (_ENABLED[0] and x.dim() == 2):
        return False
    m = x.shape[0]
    return ((m == 1 or 2 <= m <= _ROWS[0]) and fused_ops.triton_enabled(x)
            and not bi_mode.enabled() and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and all(_linear_ok(lin, x, m > 1) for lin in linears))


def _kernels():
    if not _K:
        from rlserve.layers import gemv_kernels

        _K.append(gemv_kernels)
    return _K[0]


def tile(N: int, K: int, device: torch.device) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps)`` for ``W [N, K]`` (see ``_MAX_BLOCK_N`` above)."""
    from rlserve.layers.triton_attention import num_sms

    bk = min(_MAX_BLOCK_K, fused_ops._next_pow2(K))
    want = _PROGRAMS_PER_SM * num_sms(device)
    bn = _MAX_BLOCK_N
    while bn > 1 and (-(-N // bn) < want or bn * bk > _MAX_TILE):
        bn //= 2
    return bn, bk, 4 if bn * bk <= 4096 else 8


def _launch(prologue: int, x: torch.Tensor, K: int, weight: torch.Tensor, bias: torch.Tensor | None,
            residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
            out_dtype: torch.dtype | None = None):
    if x.stride(-1) != 1:
        x = x.contiguous()
    N = weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"GEMV: weight {tuple(weight.shape)} does not take {K} input features")
    out = torch.empty((1, N), dtype=out_dtype or x.dtype, device=x.device)
    res_out = torch.empty((1, K), dtype=x.dtype, device=x.device) if residual is not None else out
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    bn, bk, warps = tile(N, K, x.device)
    args = (x, residual if residual is not None else x, norm_weight if norm_weight is not None else x,
            weight, bias if bias is not None else weight, out, res_out, N, weight.stride(0), float(eps))
    meta = dict(K=K, PROLOGUE=prologue, HAS_RES=residual is not None, HAS_BIAS=bias is not None,
                BLOCK_N=bn, BLOCK_K=bk, NORM_ONE_CHUNK=prologue == 1 and K <= bk, num_warps=warps)
    pdl.launch(_kernels()._gemv_kernel, (-(-N // bn),), args, meta, x.device, pdl.on(x.device))
    return out, res_out


def rows_tile(M: int, N: int, K: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, K_PER)`` of the small-batch GEMM for ``x [M, K] @ W[N, K].T``:
    the smallest row tile of ``_ROW_TILES`` that holds ``M``; ``BLOCK_N`` x ``BLOCK_K`` weight tiles
    (``_ROWS_TILE`` of the row tile; smaller where ``N`` / ``K`` are); ``K`` split into ``SPLIT`` ranges of ``K_PER`` columns (a multiple
    of ``BLOCK_K``) until the grid has ``_ROWS_PROGRAMS_PER_SM`` programs per SM or every range is one
    ``BLOCK_K`` chunk. Everything but ``BLOCK_M`` depends on ``(N, K)`` only, so a row's arithmetic does
    not depend on how many rows share the step within one row tile.

    Raises:
        ValueError: ``M`` above the largest row tile."""
    from rlserve.layers.triton_attention import num_sms

    bm = next((t for t in _ROW_TILES if M <= t), None)
    if bm is None:
        raise ValueError(f"small-batch GEMM: {M} rows > {_ROW_TILES[-1]}")
    bn, bk, _ = _ROWS_TILE[bm]
    bn = min(bn, max(16, fused_ops._next_pow2(N)))
    bk = min(bk, max(16, fused_ops._next_pow2(K)))
    tiles = -(-N // bn)
    chunks = -(-K // bk)
    split = max(1, min(chunks, (_ROWS_PROGRAMS_PER_SM * num_sms(device)) // tiles))
    k_per = -(-chunks // split) * bk
    return bm, bn, bk, -(-K // k_per), k_per


def rows_stages(bm: int, prologue: int) -> int:
    """Software-pipeline stages of the small-batch GEMM's ``bm``-row tile with ``prologue`` (0 plain, 1 the
    folded add + RMSNorm, 2 the folded SiLU-and-mul): ``_ROWS_TILE``'s, one fewer with the folded norm, whose
    residual and norm-weight tiles take a buffer a stage too (sm_90, 16 rows: 84 KB at 4 stages, two programs
    an SM, so Qwen3-8B's 384 gate_up programs took 1.45 waves; 56 KB at 3; 64 rows: 136 / 96 KB)."""
    return _ROWS_TILE[bm][2] - (prologue == 1)


def _counters(device: torch.device, n: int) -> torch.Tensor:
    key = (device.type, device.index)
    if key not in _CNT:
        _CNT[key] = torch.zeros(_CNT_SIZE, dtype=torch.int32, device=device)
    if n > _CNT_SIZE:
        raise ValueError(f"small-batch GEMM: {n} split tiles > {_CNT_SIZE} counters")
    return _CNT[key]


def _launch_rows(prologue: int, x: torch.Tensor, K: int, weight: torch.Tensor, bias: torch.Tensor | None,
                 residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0):
    """``x [M, K]`` (``prologue`` 2: ``x [M, 2K]`` = gate | up; 1: ``rmsnorm(x + residual) * norm_weight``)
    through ``weight [N, K]`` -> ``([M, N]`` in ``x.dtype``, ``x + residual [M, K]`` or None) with the
    small-batch GEMM (``gemm_rows_kernels``)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    M, N = x.shape[0], weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"GEMM: weight {tuple(weight.shape)} does not take {K} input features")
    from rlserve.layers import gemm_rows_kernels

    bm, bn, bk, split, k_per = rows_tile(M, N, K, x.device)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    res_out = torch.empty((M, K), dtype=x.dtype, device=x.device) if residual is not None else None
    tiles = -(-N // bn)
    ws = torch.empty((split, bm, N), dtype=torch.float32, device=x.device) if split > 1 else out
    wss = torch.empty((tiles, split, bm), dtype=torch.float32, device=x.device) if split > 1 and prologue == 1 else out
    cnt = _counters(x.device, tiles) if split > 1 else out
    r = residual if residual is not None else x
    args = (x, r, norm_weight if norm_weight is not None else x, weight, bias if bias is not None else weight, out,
            res_out if res_out is not None else out, ws, wss, cnt, M, N, x.stride(0), r.stride(0), out.stride(0),
            res_out.stride(0) if res_out is not None else 0, weight.stride(0), float(eps))
    meta = dict(K=K, K_PER=k_per, PROLOGUE=prologue, HAS_RES=residual is not None, HAS_BIAS=bias is not None,
                BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split, IEEE=x.dtype == torch.float32, num_warps=4,
                num_stages=rows_stages(bm, prologue))
    pdl.launch(gemm_rows_kernels._gemm_rows_kernel, (tiles, split, 1), args, meta, x.device, pdl.on(x.device))
    return out, res_out


def linear(x: torch.Tensor, lin: nn.Module) -> torch.Tensor:
    """``lin(x)`` for ``x [M, K]`` (``K = lin.weight.shape[1]``) -> ``[M, N]`` in ``x.dtype``,
    bias included. Precondition: :func:`takes` ``(x, lin)``."""
    if x.shape[0] > 1:
        return _launch_rows(0, x, x.shape[-1], lin.weight, lin.bias)[0]
    return _launch(0, x, x.shape[-1], lin.weight, lin.bias)[0]


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module, lin: nn.Module):
    """``(lin(norm(x + residual)), x + residual)`` for ``x [M, K]``; without a residual
    ``(lin(norm(x)), x)``. ``norm``: an :class:`~rlserve.layers.norm.RMSNorm` of size ``K``
    (its ``weight`` ``[K]``, ``eps``). One kernel: the batch-1 GEMV, or for more rows the small-batch
    GEMM with the norm's scaling applied after the dot products (``gemm_rows_kernels``' docstring).
    Precondition: :func:`takes` ``(x, lin)``."""
    K = x.shape[-1]
    if x.shape[0] > 1 and not _ROWS_FOLD[0]:  # the fused norm kernel, then the plain GEMM
        h, res = fused_ops.rms_norm(x, norm.weight, norm.eps, residual) if residual is not None else (
            fused_ops.rms_norm(x, norm.weight, norm.eps), x)
        return _launch_rows(0, h, K, lin.weight, lin.bias)[0], res
    if x.shape[0] > 1:
        out, res = _launch_rows(1, x, K, lin.weight, lin.bias, residual=residual, norm_weight=norm.weight,
                                eps=norm.eps)
        return out, (res if residual is not None else x)
    out, res = _launch(1, x, K, lin.weight, lin.bias, residual=residual, norm_weight=norm.weight, eps=norm.eps)
    return out, (res if residual is not None else x)


def silu_mul_linear(gate_up: torch.Tensor, lin: nn.Module) -> torch.Tensor:
    """``lin(silu(gate_up[:, :d]) * gate_up[:, d:])`` for ``gate_up [M, 2d]`` -> ``[M, N]``.
    Precondition: :func:`takes` ``(gate_up, lin)``."""
    if gate_up.shape[0] > 1 and not _ROWS_FOLD[0]:
        return _launch_rows(0, fused_ops.silu_and_mul(gate_up), gate_up.shape[-1] // 2, lin.weight, lin.bias)[0]
    if gate_up.shape[0] > 1:
        return _launch_rows(2, gate_up, gate_up.shape[-1] // 2, lin.weight, lin.bias)[0]
    return _launch(2, gate_up, gate_up.shape[-1] // 2, lin.weight, lin.bias)[0]


def norm_ok(norm: nn.Module, x: torch.Tensor) -> bool:
    """``norm`` is an RMSNorm over ``x``'s last dim in ``x``'s dtype, without hooks."""
    w = norm.weight if isinstance(norm, RMSNorm) else None
    return (w is not None and w.shape == (x.shape[-1],) and w.dtype == x.dtype
            and w.is_contiguous() and no_hooks(norm))
