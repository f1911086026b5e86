"""Mixture-of-experts on a GPU: token permutation and grouped GEMMs over the routed tokens.

Two implementations of :func:`rlserve.layers.moe.experts_grouped`'s contract
``(x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, K], topk_ids [T, K]) -> [T, H]``,
both free of host synchronisation and of data-dependent allocation sizes, so the decode CUDA
graphs capture them:

- :func:`experts_triton` (the default on CUDA): vLLM's fused-MoE design. :func:`moe_align`
  sorts the ``N = T * K`` (token, slot) pairs by expert and pads each expert's run to a multiple
  of ``BLOCK_M`` (padding entries hold ``N``, an invalid pair id); one Triton launch per GEMM
  walks the blocks (each block has one expert: ``expert_ids[block]``), gathers its rows of the
  activations, multiplies by that expert's weight tile and scatters the rows back to pair order.
  ``gate_up`` -> SiLU-and-mul -> ``down`` (the routing weight applied in the ``down`` epilogue);
  the ``K`` rows of a token are then summed (``[T, K, H].sum(1)``, float32 accumulation inside
  ``torch.sum``, K-slot order). The padded length is at most
  ``N + min(N, E) * (BLOCK_M - 1)`` (at most ``min(N, E)`` experts get tokens, each padded by
  fewer than ``BLOCK_M`` entries), rounded up to a multiple of ``BLOCK_M``: the grid is sized by
  that bound and blocks past ``num_tokens_post_padded`` (read on the device) return at once. On
  the GPU the permutation is two Triton launches (:func:`moe_align_triton`) and the routing one
  (:func:`topk_softmax`): at decode batch 1 a dozen small PyTorch launches cost more than the
  expert GEMMs (BENCHMARKS.md, MoE).
- :func:`experts_grouped_mm`: the pairs sorted by expert with ``torch.sort``, then
  ``torch._grouped_mm`` (PyTorch's grouped GEMM: CUTLASS on sm90 for bf16 with 16-byte aligned
  strides, a fallback elsewhere) over the expert-sorted rows with the per-expert end offsets.
  Kept as the measured alternative (``RLSERVE_MOE_BACKEND=grouped_mm``; BENCHMARKS.md, MoE).

fp8 (``--quantization fp8``, :mod:`rlserve.layers.fp8`'s scheme): the weights are
``float8_e4m3fn`` with one float32 scale per (expert, output row) (``w13_scale [E, 2I]``,
``w2_scale [E, H]``); activations are quantized per row at each GEMM
(:func:`rlserve.layers.fp8.quantize_per_row`), the Triton kernel multiplies the fp8 tiles on the
tensor cores and scales the float32 accumulator by ``a_scale[row] * w_scale[col]``.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from rlserve import envs
from rlserve.layers.fp8 import FP8_DTYPE, quantize_per_row

_K: list = []
logger = logging.getLogger(__name__)


def _kernels():
    """:mod:`rlserve.layers.moe_triton_kernels`, imported at the first launch (importing Triton
    at rlserve's import would fix its interpreter mode before a CPU test can choose it)."""
    if not _K:
        from rlserve.layers import moe_triton_kernels

        _K.append(moe_triton_kernels)
    return _K[0]


# ---- routing ---------------------------------------------------------------------------------

def topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rlserve.layers.moe.route` in one Triton launch (one program per token): softmax in
    float32, top-k (largest first), optional renormalization; ``(weights [T, K] in the logits'
    dtype, ids [T, K] int64)``."""
    T, E = router_logits.shape
    weights = torch.empty(T, top_k, dtype=router_logits.dtype, device=router_logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=router_logits.device)
    if T:
        _kernels().topk_softmax_kernel[(T,)](
            router_logits, weights, ids, E, router_logits.stride(0), K=top_k,
            K_PAD=1 << max(top_k - 1, 0).bit_length(), E_PAD=1 << max(E - 1, 0).bit_length(), RENORM=renormalize,
            num_warps=1 if E <= 256 else 4,
        )
    return weights, ids


# ---- permutation -------------------------------------------------------------------------

def max_padded(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of the padded sorted length (module docstring), ``N + min(N, E) * (BLOCK_M - 1)``,
    rounded up to a multiple of ``BLOCK_M`` (the kernel reads whole blocks)."""
    bound = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return -(-bound // block_m) * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the (token, slot) pairs by expert, each expert's run padded to a multiple of ``block_m``:
    two Triton launches where Triton runs (:func:`moe_align_triton`; pairs of one expert in any
    order), else :func:`moe_align_torch` (ascending). Same contract as :func:`moe_align_torch`."""
    if triton_runs_on(topk_ids.device.type):
        return moe_align_triton(topk_ids, num_experts, block_m)
    return moe_align_torch(topk_ids, num_experts, block_m)


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`moe_align_torch`'s result from two kernels (one counting, padding and labelling
    blocks, its programs each a slice of the blocks; one placing the pairs with atomic cursors) instead of about twelve small
    launches: at decode batch 1 those launches cost more than the expert GEMMs
    (BENCHMARKS.md, MoE). The order of the pairs within one expert's run is arbitrary."""
    N = topk_ids.numel()
    dev = topk_ids.device
    flat = topk_ids.reshape(-1)
    P = max_padded(N, num_experts, block_m)
    sorted_ids = torch.empty(P, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(P // block_m, dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=dev)
    offs = torch.empty(num_experts, dtype=torch.int32, device=dev)
    k = _kernels()
    e_pad = 1 << num_experts.bit_length()  # >= E + 1: the last bin takes masked lanes
    mb_chunk = max(16, 4096 // e_pad)  # blocks per program (a [mb_chunk, e_pad] compare each)
    k.moe_align_counts_kernel[(-(-(P // block_m) // mb_chunk),)](
        flat, cursor, offs, expert_ids, num_post, sorted_ids, N, num_experts, P,
        E_PAD=e_pad, BLOCK_M=block_m, CHUNK=1024, MB_CHUNK=mb_chunk, num_warps=4)
    k.moe_align_scatter_kernel[(-(-N // 1024),)](flat, cursor, sorted_ids, N, P, BLOCK=1024, num_warps=4)
    return sorted_ids, expert_ids, num_post, offs


def moe_align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the (token, slot) pairs by expert, each expert's run padded to a multiple of ``block_m``
    (PyTorch ops).

    Args:
        topk_ids: ``[T, K]`` integer expert ids in ``[0, E)``.

    Returns:
        ``(sorted_ids [P] int32, expert_ids [P / block_m] int32, num_post_padded [1] int32,
        offsets [E] int32)`` with ``P = max_padded(T * K, E, block_m)``: ``sorted_ids`` lists pair
        ids ``t * K + k`` (ascending within an expert, experts ascending), padding entries ``T * K``;
        block ``b`` belongs to expert ``expert_ids[b]`` (blocks past ``num_post_padded`` hold
        ``E - 1`` and are skipped by the kernel); ``offsets[e]`` is the end of expert ``e``'s
        rows in the UNPADDED expert-sorted order (``torch._grouped_mm``'s ``offs``).
        Only fixed-size device ops (no host sync), so it runs inside CUDA graphs.
    """
    N = topk_ids.numel()
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    ends = torch.cumsum(counts, 0)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    order = torch.sort(flat, stable=True).indices  # pair ids by expert
    sorted_e = flat.index_select(0, order)
    rank = torch.arange(N, device=dev) - (ends - counts).index_select(0, sorted_e)
    dest = (padded_ends - padded).index_select(0, sorted_e) + rank
    P = max_padded(N, num_experts, block_m)
    sorted_ids = torch.full((P,), N, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(0, P, block_m, device=dev)
    expert_ids = torch.searchsorted(padded_ends, starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, padded_ends[-1:].to(torch.int32), ends.to(torch.int32)


# ---- Triton kernel -------------------------------------------------------------------------

#: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) by regime; see :func:`kernel_config`
CONFIGS = {
    "small": (16, 64, 128, 1, 4, 4),
    "large": (64, 128, 64, 8, 4, 3),
}

#: Tuned tables on sm90 for bf16 / fp16 experts, keyed by ``(E, I)`` (experts, per-expert
#: intermediate size on this rank): ``((max tokens, config), ...)``, the last bound None (no bound).
#: ``(128, 768)`` (Qwen3-30B-A3B) is vLLM 0.24's tuned table for that shape on the H200
#: (``fused_moe/configs/E=128,N=768,device_name=NVIDIA_H200.json``; vLLM ships none for the H100,
#: where it falls back to the default rule above), coarsened from its 18 batch keys to five tile
#: classes so the warm-up compiles 5 x 2 GEMM kernels: tokens <= 32 keep the default 16-row tile
#: (vLLM's keys 8 and 24 differ from it only in ``num_stages``), <= 192 its keys 96/128, <= 384 its
#: key 256, <= 768 its key 512, above that its keys 1536..3072 (1024 and 4096: ``GROUP_M`` 16).
#: The bounds sit between vLLM's keys, as vLLM picks the key nearest the batch's token count.
#: Used by default on sm90 (:func:`tuned_device`; ``RLSERVE_MOE_TUNED_CONFIGS=0``: the default rule): on an
#: H100 (session 16, first window, ``benchmarks/moe_kernels.py --tuned``) one layer took 433.5 / 452.3 / 533.5 /
#: 895.1 us at 128 / 256 / 1024 / 4096 tokens against the default rule's 453.5 / 466.6 / 538.7 / 1100.5.
TUNED_SM90 = {
    (128, 768): (
        (32, (16, 64, 128, 1, 4, 4)),
        (192, (16, 128, 128, 1, 4, 2)),
        (384, (32, 256, 128, 16, 4, 2)),
        (768, (64, 128, 64, 1, 4, 3)),
        (None, (128, 256, 64, 1, 8, 4)),
    ),
}


def config_table(num_experts: int, inter: int, top_k: int, tuned: bool) -> tuple[tuple[int | None, tuple], ...]:
    """The tile classes of one expert shape: ``((max pairs, config), ...)`` ascending, the last
    bound None. ``tuned``: :data:`TUNED_SM90`'s table when it has ``(num_experts, inter)`` (its token
    bounds times ``top_k``), else the default rule (:func:`kernel_config`)."""
    table = TUNED_SM90.get((num_experts, inter)) if tuned else None
    if table is not None:
        return tuple((None if b is None else b * top_k, cfg) for b, cfg in table)
    return ((4 * num_experts, CONFIGS["small"]), (None, CONFIGS["large"]))


def pick(table, num_pairs: int) -> tuple[int, int, int, int, int, int]:
    """The config of the first class of ``table`` (:func:`config_table`) whose bound holds ``num_pairs``."""
    for bound, cfg in table:
        if bound is None or num_pairs <= bound:
            return cfg
    raise ValueError("a config table ends with an unbounded class")


def kernel_config(num_pairs: int, num_experts: int) -> tuple[int, int, int, int, int, int]:
    """The default rule (an earlier vLLM's; vLLM 0.24's has six classes by tokens, timed beside it by
    ``benchmarks/moe_kernels.py --vllm-default``): ``BLOCK_M = 16`` tiles while the pairs per expert
    are few (``N <= 4 E``: decode up to batch ``4 E / K``), else 64-row tiles (prefill, large batches)."""
    return CONFIGS["small" if num_pairs <= 4 * num_experts else "large"]


_SM90: dict = {}


def tuned_device(device: torch.device, wdtype: torch.dtype) -> bool:
    """Whether :data:`TUNED_SM90` applies (on unless ``RLSERVE_MOE_TUNED_CONFIGS=0``; measured faster
    than the default rule on an H100, BENCHMARKS.md, MoE): a CUDA device of compute capability 9.x (the
    H100 / H200: the tables' largest tiles take 192 KiB of shared memory) and bf16 / fp16 weights (not fp8)."""
    if device.type != "cuda" or wdtype not in (torch.bfloat16, torch.float16) or not envs.RLSERVE_MOE_TUNED_CONFIGS:
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM90:
        _SM90[idx] = torch.cuda.get_device_capability(idx)[0] == 9
    return _SM90[idx]


#: expert shapes ``(E, I)`` whose tuned table failed to compile or launch here (:func:`warm_up`)
_TUNED_OFF: set = set()


def layer_table(w13: torch.Tensor, top_k: int) -> tuple[tuple[int | None, tuple], ...]:
    """:func:`config_table` of the experts ``w13 [E, 2I, H]`` on their device."""
    shape = (w13.shape[0], w13.shape[1] // 2)
    return config_table(*shape, top_k, shape not in _TUNED_OFF and tuned_device(w13.device, w13.dtype))


def _launch(a, w, c, a_scale, w_scale, topk_w, sorted_ids, expert_ids, num_post, top_k, mul_weight, cfg):
    BM, BN, BK, GM, warps, stages = cfg
    N, K = w.shape[1], w.shape[2]
    EM = sorted_ids.shape[0]
    grid = (-(-EM // BM) * -(-N // BN),)
    ieee = a.dtype == torch.float32
    dummy = c  # unused pointer arguments (constexpr flags keep them unread)
    _kernels().fused_moe_kernel[grid](
        a, w, c, a_scale if a_scale is not None else dummy, w_scale if w_scale is not None else dummy,
        topk_w if topk_w is not None else dummy, sorted_ids, expert_ids, num_post,
        N, K, EM, c.shape[0],
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), c.stride(0), c.stride(1),
        w_scale.stride(0) if w_scale is not None else 0, w_scale.stride(1) if w_scale is not None else 0,
        TOP_K=top_k, MUL_WEIGHT=mul_weight, A_SCALED=a_scale is not None, B_SCALED=w_scale is not None,
        IEEE=ieee, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=GM, num_warps=warps, num_stages=stages,
    )


def _silu_and_mul(gu: torch.Tensor) -> torch.Tensor:
    if gu.is_cuda:
        from rlserve.layers.fused_ops import silu_and_mul

        return silu_and_mul(gu)
    d = gu.shape[-1] // 2
    return torch.nn.functional.silu(gu[..., :d]) * gu[..., d:]


def experts_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                   config: tuple | None = None) -> torch.Tensor:
    """The routed experts' weighted sum with the fused-MoE Triton kernel (module docstring).

    Args:
        x: ``[T, H]`` float32 / float16 / bfloat16. w13: ``[E, 2I, H]``; w2: ``[E, H, I]``: ``x``'s
            dtype, or float8_e4m3fn with ``w13_scale [E, 2I]`` / ``w2_scale [E, H]`` float32
            (then the activations are quantized per row too).
        topk_weights: ``[T, K]``; topk_ids: ``[T, K]`` in ``[0, E)``.
        config: ``(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages)`` (default: the
            class of ``T * K`` pairs in :func:`layer_table`).

    Returns:
        ``[T, H]`` in ``x``'s dtype.
    """
    T, H = x.shape
    E, I2, _ = w13.shape
    K = topk_ids.shape[1]
    N = T * K
    if T == 0:
        return torch.zeros_like(x)
    cfg = config or pick(layer_table(w13, K), N)
    sorted_ids, expert_ids, num_post, _ = moe_align(topk_ids, E, cfg[0])
    fp8 = w13.dtype == FP8_DTYPE
    a, a_scale = quantize_per_row(x) if fp8 else (x, None)
    gu = torch.empty(N, I2, dtype=x.dtype, device=x.device)
    _launch(a, w13, gu, a_scale, w13_scale, None, sorted_ids, expert_ids, num_post, K, False, cfg)
    h = _silu_and_mul(gu)
    h, h_scale = quantize_per_row(h) if fp8 else (h, None)
    y = torch.empty(N, H, dtype=x.dtype, device=x.device)
    _launch(h, w2, y, h_scale, w2_scale, topk_weights.reshape(-1), sorted_ids, expert_ids, num_post, 1, True, cfg)
    return y.view(T, K, H).sum(1)


def experts_grouped_mm(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor) -> torch.Tensor:
    """The same sum with ``torch._grouped_mm`` (bf16 on sm90; see the module docstring):
    rows gathered in expert order, two grouped GEMMs (``offs`` = per-expert row ends), SiLU-and-
    mul between, weighted, scattered back to pair order and summed over the K slots.

    Raises:
        RuntimeError: from ``torch._grouped_mm`` on an unsupported device / dtype / alignment."""
    T, H = x.shape
    K = topk_ids.shape[1]
    if T == 0:
        return torch.zeros_like(x)
    flat = topk_ids.reshape(-1).to(torch.int64)
    counts = torch.zeros(w13.shape[0], dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    order = torch.sort(flat, stable=True).indices
    xs = x.index_select(0, order // K)
    gu = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
    y = torch._grouped_mm(_silu_and_mul(gu), w2.transpose(1, 2), offs=offs)
    y = y * topk_weights.reshape(-1).index_select(0, order).unsqueeze(1).to(y.dtype)
    out = torch.empty_like(y)
    out.index_copy_(0, order, y)
    return out.view(T, K, H).sum(1)


# ---- warm-up -------------------------------------------------------------------------------

def warm_up(moe_layers, act_dtype: torch.dtype) -> list[tuple]:
    """Launch every fused-MoE kernel specialization the serving path can pick, once: for each
    distinct expert shape among ``moe_layers`` (:class:`rlserve.layers.moe.FusedMoE` modules),
    the routing kernel and, per tile class of :func:`layer_table`, the permutation and both GEMMs
    (and SiLU-and-mul) with that class's config, on a batch of the class's smallest token count
    (whatever the count, the kernels compile the same: the batch-sized integers are not
    specialized, :mod:`rlserve.layers.moe_triton_kernels`). After it no batch size compiles a
    MoE kernel again (``tests/test_moe_warmup.py`` counts them on the CPU).

    Safe under :func:`rlserve.engine.worker.triton_precompile.record` (skipped launches leave
    outputs uninitialized): the routing ids and weights fed to the experts are built by torch, not
    by the routing kernel, and the scatter kernel ignores slots outside the padded length.

    Args:
        moe_layers: the FusedMoE modules (``w13_weight [E, 2I, H]``, ``w2_weight``, fp8 scales,
            ``top_k``, ``renormalize``); act_dtype: the activations' dtype (the model's).

    Returns:
        ``(E, 2I, H, weight dtype, top_k, config, tokens)`` of each launch, in launch order.
    """
    seen, done = set(), []
    for m in moe_layers:
        w13, w2 = m.w13_weight, m.w2_weight
        E, I2, H = w13.shape
        K = m.top_k
        key = (E, I2, H, w13.dtype, K, bool(m.renormalize), w13.device)
        if key in seen:
            continue
        seen.add(key)
        topk_softmax(torch.zeros(1, E, dtype=act_dtype, device=w13.device), K, m.renormalize)
        table = layer_table(w13, K)
        try:
            done += _warm_table(m, table, act_dtype)
        except Exception:  # noqa: BLE001 -- e.g. a tuned tile out of shared memory on this card
            if table == config_table(E, I2 // 2, K, tuned=False):
                raise
            logger.warning("fused-MoE tuned configs for E=%d, I=%d failed here; vLLM's default rule instead",
                           E, I2 // 2, exc_info=True)
            _TUNED_OFF.add((E, I2 // 2))
            done += _warm_table(m, layer_table(w13, K), act_dtype)
    return done


def _warm_table(m, table, act_dtype: torch.dtype) -> list[tuple]:
    """:func:`warm_up`'s launches of one layer's tile classes."""
    w13, w2, K, done, lo = m.w13_weight, m.w2_weight, m.top_k, [], 0
    E, I2, H = w13.shape
    for bound, cfg in table:
        T = lo // K + 1  # the smallest token count of the class (pairs in (lo, bound])
        ids = (torch.arange(T * K, device=w13.device) % E).view(T, K)
        weights = torch.full((T, K), 1.0 / K, dtype=act_dtype, device=w13.device)
        x = torch.zeros(T, H, dtype=act_dtype, device=w13.device)
        experts_triton(x, w13, w2, weights, ids, m.w13_weight_scale, m.w2_weight_scale, config=cfg)
        if w13.is_cuda:
            torch.cuda.synchronize(w13.device)  # a launch failure surfaces here, inside the try
        done.append((E, I2, H, w13.dtype, K, cfg, T))
        lo = bound if bound is not None else lo
    return done


def triton_runs_on(device_type: str) -> bool:
    """Whether :func:`experts_triton` can run on a device type (Triton installed; ``cuda``, or any
    device under ``TRITON_INTERPRET=1``). Does not import Triton."""
    if importlib.util.find_spec("triton") is None:
        return False
    return device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
