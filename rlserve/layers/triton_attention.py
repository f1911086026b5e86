"""Paged attention and KV-cache writes in Triton: the fast GPU backend (``"triton"``).

Three kernels (their code: :mod:`rlserve.layers.triton_attention_kernels`; planned, checked and
launched here), all reading the paged cache through the block table (layout and metadata
contract in :mod:`rlserve.layers.attention`):

- :func:`triton_write_kv_cache` -- scatter this step's K/V rows into their slots; one
  program per token, rows with ``slot < 0`` (CUDA-graph padding) are skipped. No host
  sync (the torch writer tests ``valid.all()`` on the host, which cannot be captured).
- decode (``max_query_len == 1``): *flash-decoding* (Dao et al., "Flash-Decoding for
  long-context inference", 2023; the split-KV scheme of vLLM's paged attention v2).
  Grid ``(num_kv_heads, B, num_splits)``: one program holds the ``G = heads / kv_heads``
  query heads that share a KV head (grouped-query packing, so each K/V tile is read once
  per group, not once per head), walks its share of the context in tiles of
  ``BLOCK_N`` tokens with an online softmax (Milakov & Gimelshein 2018), and writes a
  partial output and its log-sum-exp; a second kernel merges the splits. With one split
  the first kernel writes the output directly. Programs take the sequences longest
  context first (a permutation sorted once per step on the device and shared by every
  layer: longest-processing-time-first order, so a long context does not start in the last
  wave and leave the other SMs idle), and the KV heads of one sequence are neighbours in
  launch order (they read the same cache rows). Every per-step value (context lengths,
  block ids) is read from device tensors, and the grid depends only on the batch size
  and ``meta.max_seq_len``, so the kernel can be captured in a CUDA graph where the
  runner passes the static upper bound ``max_model_len`` as ``max_seq_len``.
- prefill / varlen (any ``max_query_len``): FlashAttention-2 style (Dao 2023) causal
  attention, grid ``(ceil(max_query_len / BLOCK_M), B, num_heads)``; query row ``i`` of
  sequence ``b`` sits at absolute position ``seq_len - query_len + i`` and sees keys
  ``0..position`` -- this covers plain prompts, prefix-cache hits and chunked prefill
  (context longer than the query) alike, since all K/V, the new tokens' included, are
  read from the cache after :func:`triton_write_kv_cache` stored them.

fp8 KV cache (``--kv-cache-dtype fp8``, :mod:`rlserve.layers.kv_quant`): the writer stores
``saturate(x / scale)``; decode and prefill load one byte per element, turn it into a float16
dot operand in registers (:data:`FP8_OPERAND`; exact: every e4m3 / e5m2 value is a float16
value; bf16 / fp16 queries go to float16 for the dots, float32 ones keep float32), fold
``k_scale`` into the softmax scale and multiply the output by ``v_scale``. The grid and the launch
arguments do not change, so the CUDA graphs capture it as they do a bf16 cache.

Numerics: ``q·k`` and ``p·v`` accumulate in float32; float32 inputs use IEEE float32
products (``input_precision="ieee"``, never TF32), so float32 results match the
reference :func:`rlserve.layers.attention.torch_paged_attention` to ~1e-6. bf16/fp16
round ``p`` to the input dtype before ``p·v``, as FlashAttention does.

On tensors that are not on a CUDA device the backend falls back to the torch reference,
unless Triton's interpreter is on (``TRITON_INTERPRET=1`` *before* this module and the
kernels' are imported), which runs the kernels on CPU with numpy -- what the CPU tests use.
"""

from __future__ import annotations

import logging
import math
import os

import torch

from rlserve.batch_invariant import mode as bi_mode, query_tiles as bi_tiles
from rlserve.batch_invariant.per_query import per_query_meta
from rlserve.layers import kv_quant, pdl
from rlserve.layers.attention import AttentionMetadata, torch_paged_attention

logger = logging.getLogger(__name__)

try:  # Triton is optional: CPU-only installs do not have it.
    import triton

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None
    HAS_TRITON = False

_LOG2E = 1.4426950408889634

# Tile sizes. Decode is bandwidth-bound: 64-token K/V tiles give each program enough bytes
# in flight; prefill tiles are the FlashAttention-2 defaults for head_dim <= 128 on sm80+.
# Defaults measured on an H200 (Triton 3.6, bf16, 1024-token contexts; numbers in
# benchmarks/results/decode_step-h200-2026-11-29.md): decode BLOCK_N=64 / 4 warps was the
# fastest of {32, 64, 128} x {4, 8 warps} for a Qwen3-0.6B layer (256 us at batch 256, 4.2
# TB/s of K/V) and a SmolLM2 layer (57 us); prefill BLOCK_M=128 / BLOCK_N=64 was the fastest
# of four tilings for 8 x 1024-token prompts (223 us). float32 (tests) uses smaller tiles.
DECODE_BLOCK_N = 64
DECODE_NUM_WARPS = 4
PREFILL_BLOCK_M = 128
PREFILL_BLOCK_N = 64
# Split-K planning: aim for this many programs per SM, never split below this many
# tokens per split, and never use more splits than this. Contexts of unequal length (every
# real batch) leave SMs idle at the end of a step unless there are a few programs per SM
# to balance over (4 against 2 and 8: BENCHMARKS.md, issue 16; the A/B switches of this plan
# and of the longest-context-first order went with that verdict).
# fp8 cache: how the kernels turn a K/V byte into a dot operand (``KV_CVT``,
# triton_attention_kernels._kv_operand). "bf16": cast to the query dtype (the default, the kernel of
# sessions 13-16; on sm90 Triton converts e4m3 -> bf16 as cvt.rn.f16x2.e4m3x2 then two cvt.bf16.f16
# (F2F, a quarter-rate pipe) per pair, and reads V's fp8 tile from shared memory a byte at a time: s14's
# fp8 step at 1.63x its floor). "f16": cast to float16 (q and p go to float16, which holds every bf16
# value of its range exactly and p in [0, 1] to 2^-11): one conversion per pair, V still read bytewise.
# "asm": as f16, V converted by inline assembly before shared memory (read back with ldmatrix.trans).
# sm_90 SASS per KB of K/V a warp issues (BENCHMARKS.md K6): bf16 cache 122, "bf16" 376, "f16" 336 (64-token
# tiles), "asm" 160 with 128-token tiles. "asm" with 128-token tiles is the default since session 21's H100
# run (BENCHMARKS.md K7 / K1, benchmarks/results/s21_w1/fp8kv): the decode kernel at B=256, ctx 2048 401.8 us
# (1.14x its KV floor) vs "bf16" 528.8 us (1.50x); the Qwen3-0.6B decode step 13.35 ms (1.30x its floor) vs
# 16.83 ms; tests/gpu/test_gpu_kv_fp8.py's attention checks pass in both modes. Its rounding: p in float16
# (2^-11) where "bf16" rounds it to 2^-8 (K8: lower error). Where the inline assembly does not compile,
# ``paged_attention`` falls back to "f16" with a warning; the Triton interpreter runs "asm" as "f16".
FP8_OPERAND = "asm"
FP8_OPERAND_MODES = ("bf16", "f16", "asm")
# tokens per K/V tile of the decode kernel on an fp8 cache (a 16-byte load holds 16 fp8 values)
DECODE_BLOCK_N_FP8 = 128
# software-pipelining stages of the decode kernel on an fp8 cache (None: Triton's default, 3)
DECODE_NUM_STAGES_FP8: int | None = None
_PROGRAMS_PER_SM = 4
_MIN_TOKENS_PER_SPLIT = 64
_MAX_SPLITS = 32


def interpreter_enabled() -> bool:
    """True when Triton runs kernels in its numpy interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def is_available(device: torch.device | str | None = None) -> bool:
    """Whether the Triton kernels can run on ``device`` (CUDA with triton importable, or
    any device in interpreter mode)."""
    if not HAS_TRITON:
        return False
    if interpreter_enabled():
        return True
    dev = torch.device(device) if device is not None else None
    return torch.cuda.is_available() and (dev is None or dev.type == "cuda")


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(int(n)))


_SM_COUNT: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (cached); 4 elsewhere (the interpreter:
    keeps grid-planning logic exercised on tiny inputs)."""
    if device.type != "cuda":
        return 4  # interpreter: keep the split logic exercised on tiny inputs
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def plan_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Number of KV splits for a decode batch (a pure function of its arguments, so a
    CUDA graph captured for a batch size keeps its plan).

    Splits only when ``num_seqs * num_kv_heads`` programs would leave SMs idle: the target
    is ``_PROGRAMS_PER_SM x SMs`` programs, with at least ``_MIN_TOKENS_PER_SPLIT`` tokens
    per split and at most ``_MAX_SPLITS`` splits.
    """
    base = max(1, num_seqs * num_kv_heads)
    want = math.ceil(_PROGRAMS_PER_SM * num_sms(device) / base)
    by_len = math.ceil(max(1, max_seq_len) / _MIN_TOKENS_PER_SPLIT)
    return int(max(1, min(want, by_len, _MAX_SPLITS)))


def decode_variants() -> list[tuple[int, int]]:
    """``(rows, splits)`` of one decode launch per variant of the decode kernels Triton compiles apart
    (their constexprs that follow the step, not the model): one row (``ORDERED`` False; ``PDL`` where
    :func:`rlserve.layers.pdl.neighbours` is on) and two (``ORDERED``); one split (``SPLIT`` False, no
    merge) and one split count per merge width ``S_PAD = next_pow2(S)`` up to ``_MAX_SPLITS``
    (:func:`plan_num_splits` picks any of them: a mixed step's decode rows, an eager decode step).
    ``NUM_SPLITS`` and ``stride_bt`` are not specialised. For :mod:`rlserve.engine.worker.jit_warmup`."""
    splits = sorted({1} | {min(1 << k, _MAX_SPLITS) for k in range(1, (_MAX_SPLITS - 1).bit_length() + 1)})
    return [(rows, s) for rows in (1, 2) for s in splits]


if HAS_TRITON:
    from rlserve.layers.triton_attention_kernels import (_decode_kernel, _decode_reduce_kernel, _prefill_kernel,
                                                         _write_kv_kernel)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def fp8_operand_mode(q_dtype: torch.dtype, cache_dtype: torch.dtype, mode: str | None = None) -> int:
    """The kernels' ``KV_CVT`` for queries in ``q_dtype`` on a cache of ``cache_dtype`` under
    :data:`FP8_OPERAND` (or ``mode``): 0 (cast to the query dtype) for a model-dtype cache, for
    float32 queries (their dots stay IEEE float32) and for ``"bf16"``; 1 for ``"f16"``, and for
    ``"asm"`` in Triton's interpreter (it cannot run inline assembly; the values are the same);
    2 / 3 for ``"asm"`` on e4m3 / e5m2.

    Raises:
        ValueError: ``mode`` not one of :data:`FP8_OPERAND_MODES`.
    """
    mode = FP8_OPERAND if mode is None else mode
    if mode not in FP8_OPERAND_MODES:
        raise ValueError(f"fp8 operand mode must be one of {FP8_OPERAND_MODES}, got {mode!r}")
    if not kv_quant.is_fp8(cache_dtype) or q_dtype == torch.float32 or mode == "bf16":
        return 0
    if mode == "f16" or interpreter_enabled():
        return 1
    return 2 if cache_dtype == torch.float8_e4m3fn else 3


def set_fp8_operand(spec: str) -> str:
    """Set :data:`FP8_OPERAND` (and :data:`DECODE_BLOCK_N_FP8`) from ``"MODE[:BLOCK_N]"`` (the
    benchmarks' ``--fp8-operand``), before an engine is built (its CUDA graphs capture the kernel
    variant). Returns the setting as ``"MODE:BLOCK_N"``.

    Raises:
        ValueError: an unknown mode, or a BLOCK_N that is not a power of two >= 16.
    """
    global FP8_OPERAND, DECODE_BLOCK_N_FP8
    mode, _, bn = spec.partition(":")
    fp8_operand_mode(torch.bfloat16, torch.float8_e4m3fn, mode)  # ValueError for an unknown mode
    if bn:
        n = int(bn)
        if n < 16 or n & (n - 1):
            raise ValueError(f"BLOCK_N must be a power of two >= 16, got {bn!r}")
        DECODE_BLOCK_N_FP8 = n
    FP8_OPERAND = mode
    return f"{FP8_OPERAND}:{DECODE_BLOCK_N_FP8}"


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if not k_cache.is_contiguous():
        raise ValueError("the KV cache must be contiguous [num_blocks, block_size, num_kv_heads, head_dim]")


def decode_order(meta: AttentionMetadata) -> torch.Tensor:
    """The decode batch's rows sorted by context length, longest first (``[B]`` int32 on the
    device; no host sync, so it can be captured in a CUDA graph). Computed once per step and
    kept in ``meta.backend_cache`` for the other layers."""
    order = meta.backend_cache.get("decode_order")
    if order is None:
        order = torch.argsort(meta.seq_lens, descending=True).to(torch.int32)
        meta.backend_cache["decode_order"] = order
    return order


def triton_write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter K/V rows into the paged cache (drop-in for ``write_kv_cache``, no host sync).

    Args:
        k, v: ``[T, num_kv_heads, head_dim]`` any float dtype (last dim contiguous).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous;
            values are cast to the cache dtype; an fp8 cache stores ``saturate(x / scale)``.
        slot_mapping: ``[T]`` int64 flat slots; ``< 0`` rows are skipped.
        k_scale, v_scale: float32 ``[1]`` scales of an fp8 cache (None: 1.0).
    """
    if not (k.is_cuda or interpreter_enabled()):
        from rlserve.layers.attention import write_kv_cache

        return write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    T = k.shape[0]
    if T == 0:
        return
    _check_cache(k_cache, v_cache)
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if k.stride(1) != k.shape[2] or v.stride(1) != v.shape[2]:
        k, v = k.contiguous(), v.contiguous()
    Hkv, D = k_cache.shape[2], k_cache.shape[3]
    n = Hkv * D
    ks, vs = kv_quant.kernel_scales(k_cache, k_scale, v_scale, slot_mapping)
    _write_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping, ks, vs,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(1),
        HEAD_DIM=D, N=n, BLOCK=triton.next_power_of_2(n), FP8_MAX=kv_quant.fp8_max(k_cache),
        num_warps=4 if n >= 1024 else 1,
    )


def triton_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                           scale: float, num_splits: int | None = None, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`paged_attention`, with one fallback: when the kernels of ``FP8_OPERAND = "asm"`` (inline
    assembly) fail to compile on this Triton / GPU, a warning is logged, :data:`FP8_OPERAND`
    becomes ``"f16"`` for the process (the same values, Triton's own conversion) and the call is
    repeated. Any other error propagates."""
    try:
        return paged_attention(q, k_cache, v_cache, meta, scale, num_splits, k_scale, v_scale, out)
    except Exception as e:
        global FP8_OPERAND
        if fp8_operand_mode(q.dtype, k_cache.dtype) < 2 or type(e).__name__ != "CompilationError":
            raise
        logger.warning("fp8 KV cache: the inline-assembly V conversion did not compile (%s); using Triton's "
                       "float16 cast (FP8_OPERAND='f16')", str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
        FP8_OPERAND = "f16"
        return paged_attention(q, k_cache, v_cache, meta, scale, num_splits, k_scale, v_scale, out)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    num_splits: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged causal grouped-query attention (drop-in for ``torch_paged_attention``).

    Args:
        q: ``[T, num_heads, head_dim]`` float32 / bf16 / fp16 (last dim contiguous).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous,
            already holding this step's K/V.
        meta: the step's metadata; only its tensors (``seq_lens``, ``query_start_loc``,
            ``block_tables``) and the ints ``max_query_len``, ``max_seq_len`` (an upper
            bound is fine), ``block_size`` are read -- never the CPU lists, so the decode
            path can be captured in a CUDA graph.
        scale: softmax scale.
        num_splits: force the decode split count (tests); default :func:`plan_num_splits`.
        k_scale, v_scale: float32 ``[1]`` scales of an fp8 cache (None: 1.0): the kernels read
            fp8 K/V and dequantize in registers (:mod:`rlserve.layers.kv_quant`).
        out: optional ``[T, num_heads, head_dim]`` tensor of ``q.dtype`` with a unit last stride to write
            the result into (the batch-invariant prefill returns a tensor of its own instead).

    Returns:
        ``[T, num_heads, head_dim]`` in ``q.dtype`` (``out`` when given, but see ``out``).

    Raises:
        ValueError: an ``out`` of another shape or dtype, or without a unit last stride.
    """
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1):
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with a unit last stride, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    if not (q.is_cuda or interpreter_enabled()):
        kw = {"k_scale": k_scale, "v_scale": v_scale} if kv_quant.is_fp8(k_cache.dtype) else {}
        res = torch_paged_attention(q, k_cache, v_cache, meta, scale, **kw)
        return res if out is None else out.copy_(res)
    _check_cache(k_cache, v_cache)
    bi_prefill = bi_mode.enabled() and meta.max_query_len > 1 and bi_tiles.FORM[0] == "tiles"
    kv_fp8 = kv_quant.is_fp8(k_cache.dtype)
    kv_cvt = fp8_operand_mode(q.dtype, k_cache.dtype)
    ks, vs = kv_quant.kernel_scales(k_cache, k_scale, v_scale, meta.seq_lens)
    if bi_mode.enabled():  # --batch-invariant: one KV split; prefill tokens as decode rows
        num_splits = 1
        if meta.max_query_len > 1 and not bi_prefill:
            meta = per_query_meta(meta)
    T, H, D = q.shape
    Hkv = k_cache.shape[2]
    if H % Hkv:
        raise ValueError(f"num_heads={H} is not a multiple of num_kv_heads={Hkv}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    G = H // Hkv
    if out is None:
        out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    D_PAD = _pow2(D)
    page = meta.block_size
    qk_scale = float(scale) * _LOG2E
    prec = _dot_precision(q.dtype)
    bt = meta.block_tables
    if bi_prefill:  # the decode kernel's rows, several query tokens per program
        return bi_tiles.tiled_attention(q, k_cache, v_cache, meta, qk_scale, _pow2(G), D_PAD, DECODE_BLOCK_N,
                                        DECODE_NUM_WARPS, prec)
    if meta.max_query_len == 1:
        B = T
        S = num_splits or plan_num_splits(B, Hkv, meta.max_seq_len, q.device)
        if S > 1:
            part_o = torch.empty((B, H, S, D_PAD), dtype=torch.float32, device=q.device)
            part_lse = torch.empty((B, H, S), dtype=torch.float32, device=q.device)
        else:
            part_o = part_lse = out  # unused
        order = decode_order(meta) if B > 1 else None
        use_pdl = pdl.neighbours(q, B)  # one decode row: launched with PDL (rlserve.layers.pdl)
        pdl.launch(_decode_kernel, (Hkv, B, S), (
            q, k_cache, v_cache, bt, meta.seq_lens, order if order is not None else meta.seq_lens, out, part_o,
            part_lse, ks, vs,
            qk_scale,
            q.stride(0), q.stride(1),
            k_cache.stride(1), k_cache.stride(2),
            bt.stride(0),
            out.stride(0), out.stride(1),
        ), dict(
            NUM_HEADS=H, GROUP=G, GROUP_PAD=_pow2(G), HEAD_DIM=D, D_PAD=D_PAD,
            PAGE=page, BLOCK_N=DECODE_BLOCK_N_FP8 if kv_fp8 else DECODE_BLOCK_N, NUM_SPLITS=S, SPLIT=S > 1,
            DOT_PRECISION=prec, ORDERED=order is not None, KV_FP8=kv_fp8, KV_CVT=kv_cvt,
            num_warps=DECODE_NUM_WARPS,
            **({"num_stages": DECODE_NUM_STAGES_FP8} if kv_fp8 and DECODE_NUM_STAGES_FP8 else {}),
        ), q.device, use_pdl)
        if S > 1:
            pdl.launch(_decode_reduce_kernel, (B, H), (part_o, part_lse, out, out.stride(0), out.stride(1)), dict(
                NUM_HEADS=H, HEAD_DIM=D, D_PAD=D_PAD, NUM_SPLITS=S, S_PAD=triton.next_power_of_2(S), num_warps=4,
            ), q.device, use_pdl)
        return out
    B = meta.seq_lens.shape[0]
    block_m = PREFILL_BLOCK_M
    block_n = PREFILL_BLOCK_N
    if q.dtype == torch.float32:  # keep float32 tiles within registers / shared memory
        block_m = min(block_m, 64)
        block_n = min(block_n, 32 if D_PAD > 64 else 64)
    grid = (triton.cdiv(meta.max_query_len, block_m), B, H)
    _prefill_kernel[grid](
        q, k_cache, v_cache, bt, meta.seq_lens, meta.query_start_loc, out, ks, vs,
        qk_scale,
        q.stride(0), q.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        bt.stride(0),
        out.stride(0), out.stride(1),
        GROUP=G, HEAD_DIM=D, D_PAD=D_PAD,
        PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=prec, KV_FP8=kv_fp8, KV_CVT=kv_cvt,
        num_warps=4 if D_PAD * block_m <= 64 * 64 else 8, num_stages=2,
    )
    return out


def register() -> bool:
    """Add ``"triton"`` to ``ATTENTION_BACKENDS`` (and its KV writer to
    ``KV_CACHE_WRITERS``). Returns False when Triton is not importable."""
    if not HAS_TRITON:
        return False
    from rlserve.layers import attention

    attention.ATTENTION_BACKENDS["triton"] = triton_paged_attention
    getattr(attention, "OUT_BACKENDS", set()).add("triton")
    writers = getattr(attention, "KV_CACHE_WRITERS", None)
    if writers is not None:
        writers["triton"] = triton_write_kv_cache
    return True
