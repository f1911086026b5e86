"""Fused elementwise kernels (Triton) for the GPU path, each with its PyTorch reference.

A Llama-style decoder layer run op by op launches ~35-40 small kernels: the residual add
and RMSNorm (5-6 each), the per-head q/k RMSNorm of Qwen3, rotary embedding (~8 per
tensor), SiLU-and-mul (3) and the KV-cache write. At small batch a decode step is bound by
that launch count, not by bytes (``benchmarks/decode_step.py``). The kernels here do each
group in one pass:

- :func:`rms_norm` -- RMSNorm, optionally fused with the residual add that precedes it
  (``norm(x + residual), x + residual``).
- :func:`silu_and_mul` -- ``silu(x[..., :d]) * x[..., d:]``.
- :func:`qkv_norm_rope_write` -- from the fused QKV projection's output: per-head q/k
  RMSNorm (Qwen3), rotary embedding of q and k, and the write of k and v into the paged
  KV cache, in one kernel; returns the rotated queries.

Every kernel reproduces the rounding of the op-by-op PyTorch code it replaces (the
Hugging Face order): the residual sum is rounded to the model dtype; the RMSNorm runs in
float32, is rounded to the model dtype, then multiplied by the weight and rounded again;
rotary multiplies by cos/sin already rounded to the model dtype, rounding each product
and the sum; SiLU is rounded before the multiply. So in float32 the results equal the
reference up to the order of the float32 mean, and in bf16 / fp16 they differ only where
that order (or ``rsqrt``'s last bit) moves a value across a rounding boundary.

Where the kernels run: on CUDA tensors when Triton is installed; on float32 CPU tensors the
same three functions run the C kernels of :mod:`rlserve.layers.cpu_fused` (same signatures,
same rounding rules) when those build. Both are switched off with ``RLSERVE_FUSED_KERNELS=0``
(read at import) or :func:`set_fused_kernels`; the callers then run their PyTorch code
(``RMSNorm``, ``SiluAndMul``, the Llama attention), the reference. Tests run the Triton
kernels on CPU through Triton's interpreter by asking for it explicitly
(``set_fused_kernels(True, on_cpu=True)`` with ``TRITON_INTERPRET=1``; the Triton kernels then
take CPU tensors instead of the C ones). Triton is imported at the first Triton call, never
by importing this module.
"""

from __future__ import annotations

import importlib.util

import torch

from rlserve import envs
from rlserve.layers import kv_quant, pdl

HAS_TRITON = importlib.util.find_spec("triton") is not None
_ENABLED = [envs.RLSERVE_FUSED_KERNELS]
_ON_CPU = [False]
_K: list = []  # the kernel module, once imported


def set_fused_kernels(on: bool, on_cpu: bool = False) -> tuple[bool, bool]:
    """Switch the fused kernels on or off for this process (A/B benchmarks, tests);
    ``on_cpu`` also runs them on CPU tensors (needs ``TRITON_INTERPRET=1`` before Triton's
    first import). Returns the previous ``(on, on_cpu)``. CUDA graphs captured before the
    switch keep what they captured."""
    prev = (_ENABLED[0], _ON_CPU[0])
    _ENABLED[0], _ON_CPU[0] = bool(on), bool(on_cpu)
    return prev


def triton_enabled(t: torch.Tensor) -> bool:
    """Whether the Triton kernels run on this tensor: Triton is installed, the kernels are
    switched on, and the tensor is on a CUDA device (or CPU runs were asked for)."""
    return _ENABLED[0] and HAS_TRITON and (t.is_cuda or _ON_CPU[0])


def fused_enabled(t: torch.Tensor) -> bool:
    """Whether :func:`rms_norm`, :func:`silu_and_mul` and :func:`qkv_norm_rope_write` run fused
    on this tensor: :func:`triton_enabled`, or a float32 CPU tensor with the C kernels of
    :mod:`rlserve.layers.cpu_fused` available (and the fused kernels switched on)."""
    if triton_enabled(t):
        return True
    if not _ENABLED[0] or t.device.type != "cpu":
        return False
    from rlserve.layers import cpu_fused

    return cpu_fused.takes(t)


def _cpu(t: torch.Tensor):
    """:mod:`rlserve.layers.cpu_fused` when ``t`` goes to the C kernels, else None (Triton)."""
    if triton_enabled(t):
        return None
    from rlserve.layers import cpu_fused

    return cpu_fused


def _kernels():
    if not _K:
        from rlserve.layers import fused_kernels

        _K.append(fused_kernels)
    return _K[0]


# qkv_norm_rope_write: batches of at least _QKV_MANY_TOKENS tokens (prefill steps) give each
# program _QKV_TOKENS_PER_PROGRAM tokens of one head (decode batches keep one, for parallelism);
# the model runner's warm-up compiles both variants.
_QKV_MANY_TOKENS = 1024
_QKV_TOKENS_PER_PROGRAM = 8
# Shorter (decode) batches: each program may take several heads of one token
# (``_qkv_norm_rope_write_heads_kernel``, bit-identical to one program per head), see
# _qkv_heads_per_program; a number here fixes the count (1: one program per token and head;
# benchmarks/qkv_heads.py sets it for its A/B runs).
_QKV_HEADS_PER_PROGRAM: int | None = None
# one-warp programs resident at once per SM (the per-SM block limit of sm_80 / sm_90: 32)
_QKV_PROGRAMS_PER_SM = 32


def _qkv_heads_per_program(T: int, n_heads: int, device: torch.device) -> int:
    """Heads per program of ``qkv_norm_rope_write`` for ``T`` tokens of ``n_heads`` query + key
    heads: ``_QKV_HEADS_PER_PROGRAM`` when set, else the smallest power of two that fits the
    grid into one wave of one-warp programs (``_QKV_PROGRAMS_PER_SM`` x SMs), at most
    ``next_pow2(n_heads)``. One program per head is the fastest while the grid fits in a wave
    (batch 1: 40 programs for Qwen3-8B); past it the extra waves of dependent loads cost more
    (Qwen3-8B at batch 256: 10,240 programs, 8.2 us per call on an H200; numbers in
    BENCHMARKS.md, issue 16, ninth session)."""
    cap = _next_pow2(n_heads)
    if _QKV_HEADS_PER_PROGRAM is not None:
        return max(1, min(_QKV_HEADS_PER_PROGRAM, cap))
    from rlserve.layers.triton_attention import num_sms

    wave = _QKV_PROGRAMS_PER_SM * num_sms(device)
    h = 1
    while h < cap and T * -(-n_heads // h) > wave:
        h *= 2
    return h


def qkv_launch(T: int, n_heads: int, device: torch.device) -> tuple[str, tuple[int, int], dict]:
    """``(kernel name, grid, per-program constexprs)`` of :func:`qkv_norm_rope_write` for ``T`` tokens
    of ``n_heads`` query + key heads: several heads of one token per program on decode-sized batches
    (``HEADS``, :func:`_qkv_heads_per_program`), else one head per program, ``TOKENS`` tokens of it
    (``_QKV_TOKENS_PER_PROGRAM`` from ``_QKV_MANY_TOKENS`` tokens on)."""
    heads = _qkv_heads_per_program(T, n_heads, device) if T < _QKV_MANY_TOKENS else 1
    if heads > 1:
        return "_qkv_norm_rope_write_heads_kernel", (T, -(-n_heads // heads)), {"HEADS": heads}
    tokens = _QKV_TOKENS_PER_PROGRAM if T >= _QKV_MANY_TOKENS else 1
    return "_qkv_norm_rope_write_kernel", (-(-T // tokens), n_heads), {"TOKENS": tokens}


def qkv_launch_class(T: int, n_heads: int, device: torch.device) -> tuple:
    """What Triton compiles apart among :func:`qkv_norm_rope_write`'s launches of ``T`` tokens: the
    kernel, its per-program constexpr, and whether it may launch with PDL (one row: ``pdl.neighbours``);
    ``T`` itself is not specialised (``do_not_specialize``)."""
    name, _, per_program = qkv_launch(T, n_heads, device)
    return name, tuple(per_program.items()), T == 1


def qkv_warm_token_counts(n_heads: int, device: torch.device) -> list[int]:
    """The smallest token count of each :func:`qkv_launch_class` (every ``T`` from 1 to
    ``_QKV_MANY_TOKENS``; from there on the class no longer changes), ascending: a forward of each
    compiles every variant of the qkv kernels a serving run can launch (the model runner's warm-up).
    Without it a step of, e.g., 400 tokens (4 heads a program on an H100 for Qwen3-0.6B) compiled one
    in the middle of serving."""
    first: dict[tuple, int] = {}
    for T in range(1, _QKV_MANY_TOKENS + 1):
        first.setdefault(qkv_launch_class(T, n_heads, device), T)
    return sorted(first.values())


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, last]`` with a unit last stride (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Fused (residual add +) RMSNorm in one kernel; see the module docstring for rounding.

    Args:
        x: ``[..., N]`` float32 / bf16 / fp16 on a device where :func:`fused_enabled` holds.
        weight: ``[N]``.
        eps: variance epsilon.
        residual: optional, the same shape and dtype as ``x``.

    Returns:
        ``norm(x)`` (same shape and dtype), or ``(norm(x + residual), x + residual)`` with a
        residual.
    """
    cpu = _cpu(x)
    if cpu is not None:
        return cpu.rms_norm(x, weight, eps, residual)
    shape = x.shape
    N = shape[-1]
    x2 = _rows(x)
    T = x2.shape[0]
    out = torch.empty((T, N), dtype=x.dtype, device=x.device)
    r2 = _rows(residual) if residual is not None else x2
    res_out = torch.empty_like(out) if residual is not None else out
    if T:
        block = _next_pow2(N)
        _kernels()._rms_norm_kernel[(T,)](
            x2, r2, weight, out, res_out,
            x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
            N, float(eps),
            BLOCK=block, HAS_RES=residual is not None, num_warps=min(8, max(1, block // 256)),
        )
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` in one kernel (``x [..., 2d]`` -> ``[..., d]``, same
    dtype), SiLU rounded to the dtype before the multiply, as the op-by-op code does."""
    cpu = _cpu(x)
    if cpu is not None:
        return cpu.silu_and_mul(x)
    shape = x.shape
    d = shape[-1] // 2
    x2 = _rows(x)
    T = x2.shape[0]
    out = torch.empty((T, d), dtype=x.dtype, device=x.device)
    if T:
        block = min(1024, _next_pow2(d))
        _kernels()._silu_mul_kernel[(T, -(-d // block))](
            x2, out, x2.stride(0), out.stride(0), d, BLOCK=block, num_warps=4 if block >= 512 else 1,
        )
    return out.view(*shape[:-1], d)


def qkv_norm_rope_write(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-head q/k RMSNorm (when weights are given), rotary embedding (``rotate_half``
    style) and the paged KV-cache write, in one kernel.

    Args:
        qkv: ``[T, (num_heads + 2 * num_kv_heads) * head_dim]`` -- q, k, v concatenated (the
            fused QKV projection's output), last dim contiguous.
        positions: ``[T]`` int64 token positions.
        cos_cache, sin_cache: ``[max_position, rotary_dim]`` float32 (``RotaryEmbedding``'s
            buffers); ``rotary_dim <= head_dim``, even; dims past it are not rotated.
        num_heads / num_kv_heads / head_dim: this rank's layout.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` contiguous.
        slot_mapping: ``[T]`` int64 flat slots; rows with ``slot < 0`` write nothing.
        q_weight, k_weight: ``[head_dim]`` RMSNorm weights (Qwen3), or None for no norm.
        eps: the norm's epsilon.
        k_scale, v_scale: float32 ``[1]`` scales of an fp8 cache (Triton only; None: 1.0): it
            stores ``saturate(x / scale)`` (:mod:`rlserve.layers.kv_quant`).

    Returns:
        ``[T, num_heads * head_dim]`` normed and rotated queries, in ``qkv.dtype``. The
        normed, rotated keys and the values are in the cache.

    Raises:
        ValueError: an fp8 cache on the CPU kernels (they write float32 only).
    """
    cpu = _cpu(qkv)
    if cpu is not None:
        if k_cache.dtype != torch.float32:
            raise ValueError(f"the CPU qkv_norm_rope_write writes a float32 cache, not {k_cache.dtype}")
        return cpu.qkv_norm_rope_write(qkv, positions, cos_cache, sin_cache, num_heads, num_kv_heads, head_dim,
                                       k_cache, v_cache, slot_mapping, q_weight, k_weight, eps)
    T = qkv.shape[0]
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    rot = cos_cache.shape[-1]
    q = torch.empty((T, num_heads * head_dim), dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    if not k_cache.is_contiguous() or k_cache.stride() != v_cache.stride():
        raise ValueError("the KV cache must be contiguous [num_blocks, block_size, num_kv_heads, head_dim]")
    norm = q_weight is not None
    n_heads = num_heads + num_kv_heads
    name, grid, per_program = qkv_launch(T, n_heads, qkv.device)
    kernel = getattr(_kernels(), name)
    args = (qkv, positions, cos_cache, sin_cache, q_weight if norm else qkv, k_weight if norm else qkv,
            q, k_cache, v_cache, slot_mapping, *kv_quant.kernel_scales(k_cache, k_scale, v_scale, slot_mapping),
            qkv.stride(0), q.stride(0), k_cache.stride(1), num_heads, num_kv_heads, float(eps), T)
    meta = dict(HEAD_DIM=head_dim, D_PAD=_next_pow2(head_dim), ROT=rot, QK_NORM=norm, **per_program,
                FP8_MAX=kv_quant.fp8_max(k_cache), num_warps=1)
    pdl.launch(kernel, grid, args, meta, qkv.device, pdl.neighbours(qkv, T))  # PDL: one decode row
    return q
