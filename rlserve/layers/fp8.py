"""Online fp8 W8A8 quantization of the decoder's linear layers (``--quantization fp8``).

The checkpoint (or the trainer's weight update) is bf16 / fp16 / fp32; every linear layer
of the decoder (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``; OPT's q/k/v,
``out_proj``, ``fc1``, ``fc2``) stores its weight in ``torch.float8_e4m3fn`` and quantizes its
input on the fly. Embeddings, the LM head and norms stay in the model dtype (as vLLM's
online fp8). Everything is computed with the same scheme on CPU and GPU:

**The number 448.** ``float8_e4m3fn`` has 1 sign bit, 4 exponent bits (bias 7), 3 mantissa
bits, no infinities, and a single NaN pattern per sign (exponent and mantissa all ones). Its
largest finite value is therefore ``1.110b * 2^(15-7) = 1.75 * 256 = 448``
(``torch.finfo(torch.float8_e4m3fn).max``). A scale maps the largest magnitude of a row onto
448 so the row uses the full fp8 range. The smallest normal is ``2^-6``, the smallest
subnormal ``2^-9``; relative rounding error of a normal value is at most ``2^-4`` (half an ULP
with 3 mantissa bits).

**Weights** ``W [N, K]`` (out x in, like ``nn.Linear``) -> ``weight [N, K] float8_e4m3fn`` and
``weight_scale [N] float32``, one scale per output channel (row):
``weight_scale[n] = max_k |W[n, k]| / 448`` and ``weight[n, k] = fp8(W[n, k] / weight_scale[n])``
(clamped to ±448, round to nearest even), so ``W ≈ weight.float() * weight_scale[:, None]``.
Rows are quantized independently, hence quantizing a block of rows gives exactly the rows
of the quantized full matrix. This makes fused and sharded loading trivial: every
``weight_loader`` call quantizes the tensor it receives (a q / k / v or gate / up matrix,
full or already this rank's shard) and the layer's own TP slicing then copies this rank's
rows of the fp8 values and of the scales **in place** into the existing parameters. Row-
parallel layers (``o_proj``, ``down_proj``) shard the *input* dim: there the scale of a row is
the max over this rank's columns (``[N, K/tp]`` is sliced first, in the checkpoint dtype,
then quantized), so the scales of a TP>1 server are per (output channel, rank) — at TP=1 this
is the same as above. Parameter storage is never re-assigned (CUDA graphs and the weight
sync rely on stable ``data_ptr``); every weight sync re-quantizes with fresh scales because
``model.load_weights`` goes through the same ``weight_loader``.

**Activations** ``x [T, K]`` are quantized per token at every call:
``x_scale[t] = max_k |x[t, k]| / 448`` (float32 ``[T, 1]``), ``x_q = fp8(x / x_scale)``.

**Matmul**: ``y[t, n] = (sum_k x_q[t, k] * weight[n, k]) * x_scale[t] * weight_scale[n] (+ bias[n])``,
accumulated in float32, returned in the input dtype. On CUDA devices with fp8 tensor cores
(compute capability >= 8.9) this is one ``torch._scaled_mm(x_q [T, K] row-major,
weight.t() [K, N] column-major, scale_a=x_scale [T, 1], scale_b=weight_scale.view(1, N),
out_dtype=x.dtype)`` (row-wise scaling; K and N must be multiples of 16, other shapes are
zero-padded on the fly). Elsewhere (CPU, older GPUs) :func:`fp8_linear_emulated` computes the
same function: the fp8 operands are upcast to float32 (exact), multiplied in float32 and
scaled — i.e. ``(x_q * x_scale) @ (weight * weight_scale).T``, the dequantized product.
The bias is added after the scaled matmul, in the output dtype.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import nn
from torch.nn import Parameter

from rlserve.loader.weight_utils import check_float, set_weight_attrs

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
#: Largest finite float8_e4m3fn value: 1.75 * 2**8 (see the module docstring).
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
_INV_FP8_MAX = 1.0 / FP8_MAX
#: Lower bound on a row's max magnitude before dividing by 448: an all-zero row gets the
#: scale 1e-12 / 448 (its fp8 values are 0) instead of a division by zero.
AMAX_EPS = 1e-12
#: ``torch._scaled_mm`` needs K and N to be multiples of this.
SCALED_MM_ALIGN = 16


# ---- quantization primitives -----------------------------------------------------------------

def quantize_per_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row (last dim) of ``x`` to float8_e4m3fn with its own scale.

    Args:
        x: ``[..., K]`` any float dtype (computed in float32).

    Returns:
        ``(q, scale)``: ``q [..., K] float8_e4m3fn`` (contiguous) and ``scale [..., 1] float32``
        with ``scale = max(|row|) / 448`` (``max`` floored at :data:`AMAX_EPS`), so that
        ``x ≈ q.float() * scale`` and the largest magnitude of each row maps onto ±448.
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=AMAX_EPS)
    # multiply by the float32 reciprocal rather than divide by 448: PyTorch's CUDA kernel turns a
    # division by a Python scalar into exactly this multiplication while the CPU kernel divides,
    # and the two differ in the last bit for some rows; this way both devices agree bit for bit
    scale = amax * _INV_FP8_MAX
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.contiguous(), scale


def dequantize_per_row(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q [..., K] fp8``, ``scale [..., 1]`` (or ``[...]``) -> ``q.float() * scale`` float32."""
    if scale.dim() == q.dim() - 1:
        scale = scale.unsqueeze(-1)
    return q.float() * scale.float()


def fp8_linear_emulated(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The fp8 W8A8 linear on any device, without fp8 tensor cores (CPU path and reference).

    Quantizes ``x`` per token, multiplies the fp8 operands upcast to float32 (the upcast is
    exact; products of two e4m3 values are exact in float32) and applies both scales — the
    same function as :func:`fp8_linear_scaled_mm`, equal to the float32 product of the
    dequantized activations and weights.

    Args:
        x: ``[T, K]`` activations (any float dtype).
        weight: ``[N, K]`` float8_e4m3fn.
        weight_scale: ``[N]`` float32 per-output-channel scales.
        bias: optional ``[N]``, added after the scaled matmul.
        out_dtype: output dtype (default ``x.dtype``).

    Returns:
        ``[T, N]`` in ``out_dtype``.
    """
    out_dtype = out_dtype or x.dtype
    x_q, x_scale = quantize_per_row(x)
    acc = torch.matmul(x_q.float(), weight.float().t())  # [T, N] float32
    out = (acc * x_scale * weight_scale.float().view(1, -1)).to(out_dtype)
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out


def _pad_u8(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad a 2-D fp8 tensor to ``[rows, cols]`` (through a uint8 view: 0x00 is +0.0)."""
    out = torch.zeros(rows, cols, dtype=torch.uint8, device=t.device)
    out[: t.shape[0], : t.shape[1]] = t.view(torch.uint8)
    return out.view(t.dtype)


def fp8_linear_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The fp8 W8A8 linear on fp8 tensor cores via ``torch._scaled_mm`` (row-wise scaling).

    Args / returns: as :func:`fp8_linear_emulated` (CUDA tensors). ``x`` is quantized per token
    (``x_scale [T, 1]`` float32, contiguous), the weight is passed as ``weight.t()`` (a
    column-major ``[K, N]`` view of the row-major ``[N, K]`` storage, as ``_scaled_mm``
    requires) with ``scale_b = weight_scale.view(1, N)``. ``_scaled_mm`` needs K and N to be
    multiples of 16: other shapes are zero-padded per call (zero columns add nothing; padded
    output columns are dropped). Asks for float32 accumulation (``use_fast_accum=False``), but
    Hopper's fp8 tensor cores keep only ~14 bits while accumulating (DeepSeek-V3, arXiv:2412.19437,
    section 3.3.2): on an H200 the error reached 2^-10.1 of the sum of |products|
    (``benchmarks/fp8_mma_error.py``), against ~2^-23 for :func:`fp8_linear_emulated`.
    """
    out_dtype = out_dtype or x.dtype
    T, K = x.shape
    N = weight.shape[0]
    x_q, x_scale = quantize_per_row(x)
    w_scale = weight_scale.float().view(1, N)
    Kp = -(-K // SCALED_MM_ALIGN) * SCALED_MM_ALIGN
    Np = -(-N // SCALED_MM_ALIGN) * SCALED_MM_ALIGN
    w = weight
    if Kp != K or Np != N:
        x_q = _pad_u8(x_q, T, Kp)
        w = _pad_u8(weight, Np, Kp)
        w_scale = torch.nn.functional.pad(w_scale, (0, Np - N), value=1.0)
    out = torch._scaled_mm(x_q, w.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=out_dtype)
    if Np != N:
        out = out[:, :N]
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out


_SCALED_MM_OK: dict[Any, bool] = {}


def scaled_mm_supported(device: torch.device) -> bool:
    """Whether ``device`` runs ``torch._scaled_mm`` in fp8: CUDA with compute capability
    >= 8.9 (Ada, Hopper, Blackwell). Cached per device."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SCALED_MM_OK:
        _SCALED_MM_OK[key] = torch.cuda.get_device_capability(key) >= (8, 9)
    return _SCALED_MM_OK[key]


# ---- the linear method and the config ----------------------------------------------------------

class Fp8LinearMethod:
    """:class:`rlserve.layers.linear.LinearMethodBase` for online fp8 W8A8 (module docstring).

    Registers on the layer:
        ``weight``: ``[out_per_rank, in_per_rank] float8_e4m3fn`` (``input_dim = 1``,
        ``output_dim = 0``, ``weight_loader``); its full HF shape is the layer's usual one.
        ``weight_scale``: ``[out_per_rank] float32`` per-output-channel scales
        (``output_dim = 0``, ``not_in_checkpoint``: computed, never loaded).

    Args:
        backend: ``"auto"`` (``_scaled_mm`` where :func:`scaled_mm_supported`, else emulated),
            ``"scaled_mm"`` or ``"emulated"`` (forced; tests compare the two).
    """

    def __init__(self, backend: str = "auto"):
        if backend not in ("auto", "scaled_mm", "emulated"):
            raise ValueError(f"fp8 backend must be auto, scaled_mm or emulated, got {backend!r}")
        self.backend = backend

    # -- weights ----------------------------------------------------------------------------
    def create_weights(self, layer, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        n = sum(output_partition_sizes)
        weight = Parameter(torch.zeros(n, input_size_per_partition, dtype=FP8_DTYPE), requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, **extra_weight_attrs,
                                  "dummy_weight_loader": functools.partial(self.load_local, layer)})
        layer.register_parameter("weight", weight)
        scale = Parameter(torch.ones(n, dtype=torch.float32), requires_grad=False)
        set_weight_attrs(scale, {"output_dim": 0, "not_in_checkpoint": True})
        layer.register_parameter("weight_scale", scale)

    @staticmethod
    def _scale_for(layer, param: torch.Tensor) -> torch.Tensor:
        if param is layer.weight:
            return layer.weight_scale
        companion = getattr(param, "weight_scale", None)
        if companion is None:
            raise ValueError(f"{layer.prefix}: fp8 weight loader got a tensor that is neither the layer's weight nor "
                             "carries a .weight_scale companion")
        return companion

    @torch.no_grad()
    def weight_loader(self, layer, param: Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        """Quantize a Hugging Face weight (full, or this rank's shard) and copy this rank's rows
        of fp8 values and scales in place. Biases load unchanged (model dtype).

        Raises:
            ValueError: non-float tensor, wrong shape or bad shard id (nothing copied).
        """
        if param.dtype != FP8_DTYPE:  # the bias (or any other unquantized parameter)
            return layer.load_shard(param, loaded_weight, shard_id)
        what = f"{layer.prefix or type(layer).__name__}" + (f"[{shard_id}]" if shard_id is not None else "")
        check_float(loaded_weight, what)
        if loaded_weight.dim() != 2:
            raise ValueError(f"{what}: expected a 2-D weight, got shape {tuple(loaded_weight.shape)}")
        scale = self._scale_for(layer, param)
        in_local = param.shape[1]
        if in_local != getattr(layer, "input_size", in_local):
            # Row-parallel: the input dim is sharded. Slice this rank's columns first (in the
            # checkpoint dtype, the layer's own slicing and shape checks), then quantize.
            staging = torch.empty(param.shape, dtype=loaded_weight.dtype, device=param.device)
            set_weight_attrs(staging, {"input_dim": 1})
            layer.load_shard(staging, loaded_weight, shard_id)
            q, s = quantize_per_row(staging)
            param.data.copy_(q)
            scale.data.copy_(s.view(-1))
            return
        # Column-parallel / replicated: rows are independent, quantize then let the layer slice
        # rows of the fp8 tensor and of the scales alike.
        q, s = quantize_per_row(loaded_weight.to(param.device))
        layer.load_shard(param, q, shard_id)  # validates the shape before copying
        layer.load_shard(scale, s.view(-1), shard_id)

    @torch.no_grad()
    def load_local(self, layer, local_weight: torch.Tensor) -> None:
        """Quantize a tensor of exactly this rank's weight shape ``[out_per_rank, in_per_rank]``
        and store it (used by dummy initialization).

        Raises:
            ValueError: wrong shape.
        """
        if tuple(local_weight.shape) != tuple(layer.weight.shape):
            raise ValueError(f"{layer.prefix}: expected local shape {tuple(layer.weight.shape)}, "
                             f"got {tuple(local_weight.shape)}")
        q, s = quantize_per_row(local_weight.to(layer.weight.device))
        layer.weight.data.copy_(q)
        layer.weight_scale.data.copy_(s.view(-1))

    def process_weights_after_loading(self, layer) -> None:
        """Nothing to do: each ``weight_loader`` call already wrote final fp8 values and scales."""

    def dequantized_weight(self, layer) -> torch.Tensor:
        """``[out_per_rank, in_per_rank]`` float32: ``weight.float() * weight_scale[:, None]``."""
        return dequantize_per_row(layer.weight, layer.weight_scale)

    # -- forward ----------------------------------------------------------------------------
    def use_scaled_mm(self, x: torch.Tensor) -> bool:
        if self.backend == "emulated":
            return False
        if self.backend == "scaled_mm":
            return True
        return x.is_cuda and scaled_mm_supported(x.device)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., in_per_rank]`` (model dtype) -> ``[..., out_per_rank]`` in ``x.dtype``."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if self.use_scaled_mm(x2):
            out = _scaled_mm_with_fallback(x2, layer.weight, layer.weight_scale, bias, x.dtype)
        else:
            out = fp8_linear_emulated(x2, layer.weight, layer.weight_scale, bias, x.dtype)
        return out.reshape(*lead, out.shape[-1])


# (device index, out dtype) -> "direct" | "via_bf16" | "emulated": decided on the first call
# (eager warm-up, before any CUDA-graph capture). Row-wise _scaled_mm always supports bf16
# output; fp16 / fp32 output depends on the torch / cuBLAS build.
_OUT_MODE: dict[tuple, str] = {}


def _scaled_mm_with_fallback(x, weight, weight_scale, bias, out_dtype):
    key = (x.device.index, out_dtype)
    mode = _OUT_MODE.get(key)
    if mode == "direct":
        return fp8_linear_scaled_mm(x, weight, weight_scale, bias, out_dtype)
    if mode == "via_bf16":
        return fp8_linear_scaled_mm(x, weight, weight_scale, None, torch.bfloat16).to(out_dtype) + (
            bias.to(out_dtype) if bias is not None else 0)
    if mode == "emulated":
        return fp8_linear_emulated(x, weight, weight_scale, bias, out_dtype)
    for mode in ("direct", "via_bf16", "emulated"):
        if mode == "via_bf16" and out_dtype == torch.bfloat16:
            continue
        _OUT_MODE[key] = mode
        try:
            return _scaled_mm_with_fallback(x, weight, weight_scale, bias, out_dtype)
        except (RuntimeError, ValueError, NotImplementedError) as e:
            logger.warning("fp8: torch._scaled_mm with %s output (%s) failed: %s", out_dtype, mode, e)
    raise AssertionError("unreachable")


class Fp8Config:
    """Quantization config for ``--quantization fp8`` (online, from a high-precision checkpoint).

    ``get_quant_method`` gives every :class:`~rlserve.layers.linear.LinearBase` layer an
    :class:`Fp8LinearMethod` unless its prefix matches ``ignored_layers``; embeddings, the LM
    head and norms are not linear layers and stay unquantized.

    Args:
        ignored_layers: module prefixes (or substrings of them) to keep unquantized.
        backend: see :class:`Fp8LinearMethod`.
    """

    name = "fp8"

    def __init__(self, ignored_layers: list[str] | None = None, backend: str = "auto"):
        self.ignored_layers = list(ignored_layers or [])
        self.backend = backend
        Fp8LinearMethod(backend)  # validate

    def get_quant_method(self, layer: nn.Module, prefix: str):
        from rlserve.layers.linear import LinearBase

        if not isinstance(layer, LinearBase):
            return None
        if any(ign and ign in prefix for ign in self.ignored_layers):
            return None
        return Fp8LinearMethod(self.backend)

    def __repr__(self) -> str:
        return f"Fp8Config(ignored_layers={self.ignored_layers}, backend={self.backend!r})"


def get_quant_config(quantization: str | None):
    """``EngineConfig.quantization`` -> a quantization config (``None`` -> ``None``).

    Raises:
        ValueError: an unknown method.
    """
    if quantization is None:
        return None
    if quantization == "fp8":
        return Fp8Config()
    raise ValueError(f"unknown quantization {quantization!r}; supported: fp8")
