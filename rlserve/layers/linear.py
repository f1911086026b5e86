"""Tensor-parallel linear layers with per-parameter weight loaders and a quantization seam.

Layout conventions (all weights are ``[out_features, in_features]`` like ``nn.Linear``):

- :class:`ReplicatedLinear`: the full weight on every rank.
- :class:`ColumnParallelLinear`: output features split over TP ranks (``output_dim = 0``);
  the output stays sharded unless ``gather_output``.
- :class:`MergedColumnParallelLinear`: several column-parallel matrices fused along the
  output dim (``gate_up_proj`` = ``[gate; up]``); ``shard_id`` is the index 0, 1, ...
- :class:`QKVParallelLinear`: fused ``[q; k; v]`` by heads; ``shard_id`` "q" / "k" / "v".
  Heads are split by :func:`~rlserve.distributed.head_partition.attention_head_partition`:
  whole GQA groups (a KV head and its query heads) per rank, as evenly as possible (3 KV
  heads over 2 ranks: 2 + 1); when there are fewer KV heads than TP ranks the KV heads are
  replicated so that every rank holds exactly one.
- :class:`RowParallelLinear`: input features split (``input_dim = 1``), evenly or by an
  explicit per-rank ``input_partition_sizes`` (o_proj follows the query heads), partial
  outputs summed with :func:`tp_all_reduce`; the bias is added once, after the reduction.

Every parameter carries ``param.weight_loader(param, loaded_weight, shard_id=None)`` which
takes the FULL Hugging Face tensor (or, when TP > 1, an already-sliced per-rank tensor of
exactly the parameter's shard shape), checks its shape (``ValueError`` before anything is
copied), slices this rank's part and copies it in place (``param.data[...].copy_``; dtype is
converted by the copy). Storage is never re-assigned.

Quantization seam: each layer holds ``self.quant_method`` (a :class:`LinearMethodBase`,
by default :class:`UnquantizedLinearMethod`) chosen by ``quant_config.get_quant_method(layer,
prefix)``. The method creates the weight parameters (``create_weights``), may intercept
loading (``weight_loader``), runs the matmul (``apply``) and post-processes after a load
(``process_weights_after_loading``; the loader calls it after the initial load, and a weight
sync must call it again after each update). Parameters that do not come from a checkpoint
(e.g. fp8 scales computed online) should be marked ``param.not_in_checkpoint = True`` so
that :meth:`LinearBase.checkpoint_shapes` leaves them out.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import Parameter

from rlserve.batch_invariant import mode as bi_mode, ops as bi_ops
from rlserve.distributed.head_partition import attention_head_partition, divide
from rlserve.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_gather_last_dim, tp_all_reduce
from rlserve.layers import cpu_gemm
from rlserve.layers.cpu_linear import pack_weight, packed_linear
from rlserve.loader.weight_utils import check_float, default_weight_loader, set_weight_attrs


class QuantizationConfig(Protocol):
    """What a quantization config offers the layers (fp8 implements it elsewhere)."""

    def get_quant_method(self, layer: nn.Module, prefix: str) -> "LinearMethodBase | None":
        """Return the method for ``layer`` (``None`` = unquantized)."""


class LinearMethodBase:
    """How a linear layer stores, loads and applies its weight. Subclass for quantization."""

    def create_weights(
        self,
        layer: "LinearBase",
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        """Register the layer's weight parameter(s) (at least ``layer.weight``) on ``layer``,
        with ``extra_weight_attrs`` (``weight_loader``) set on each."""
        raise NotImplementedError

    def weight_loader(self, layer: "LinearBase", param: Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        """Load one (full HF) tensor into ``param``. Default: the layer's TP slicing + copy."""
        layer.load_shard(param, loaded_weight, shard_id)

    def apply(self, layer: "LinearBase", x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., in_per_rank] -> [..., out_per_rank]``."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: "LinearBase") -> None:
        """Called once all of the layer's tensors were loaded (initial load and each sync)."""


class UnquantizedLinearMethod(LinearMethodBase):
    """Plain ``F.linear`` on a weight of the model dtype; on CPU in float32, decode-sized
    inputs run on a oneDNN pre-packed copy of the weight (:mod:`rlserve.layers.cpu_linear`),
    rebuilt by :meth:`process_weights_after_loading` after every load."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        weight = Parameter(
            torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            requires_grad=False,
        )
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, **extra_weight_attrs})
        layer.register_parameter("weight", weight)

    @staticmethod
    def packed_weight(layer) -> torch.Tensor | None:
        """``layer``'s current CPU packed copy of its weight (:func:`pack_weight`), or ``None``
        (not on CPU/float32, packing off, or not built yet). Rebuilt by every weight load."""
        return layer.__dict__.get("_cpu_packed_weight")

    def apply(self, layer, x, bias=None):
        packed = self.packed_weight(layer)
        if bi_mode.enabled():  # --batch-invariant: a row's bits never depend on the other rows
            return bi_ops.linear(x, layer.weight, packed, bias, layer=layer)
        team = cpu_gemm.team_weight(layer)
        if team is not None and cpu_gemm.takes(x):  # decode-sized: on the CPU team's cores
            return cpu_gemm.linear(x, team, layer.weight.shape[0], bias)
        if packed is not None:
            return packed_linear(x, layer.weight, packed, bias)
        return F.linear(x, layer.weight, bias)

    def process_weights_after_loading(self, layer):
        """(Re)build the CPU packed copy of ``layer.weight`` (``None`` off CPU/float32): the CPU
        team's when one runs (:mod:`rlserve.layers.cpu_gemm`), else oneDNN's."""
        cpu_gemm.build_team_weight(layer, layer.weight.data)
        layer.__dict__.pop("_bi_fma_weight", None)  # --batch-invariant's copy: repacked at its next use
        # with a team copy, the oneDNN one would serve only steps above cpu_gemm.MAX_ROWS rows
        # (MKL does those): not kept (--batch-invariant runs the team's kernel for every M)
        team = cpu_gemm.team_weight(layer) is not None
        layer.__dict__["_cpu_packed_weight"] = None if team else pack_weight(layer.weight.data)


class LinearBase(nn.Module):
    """Common base: TP info, the quant method, the bias, and the weight-loader seam.

    Args:
        input_size / output_size: FULL (unsharded) feature sizes.
        bias: whether the layer has a bias.
        params_dtype: parameter dtype (default ``torch.get_default_dtype()``).
        quant_config: optional :class:`QuantizationConfig`.
        prefix: module name in the model (``model.layers.0.self_attn.qkv_proj``), for quant configs.
    """

    def __init__(self, input_size: int, output_size: int, params_dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.prefix = prefix
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        self.quant_method: LinearMethodBase = method or UnquantizedLinearMethod()

    # -- loading -----------------------------------------------------------------------
    def weight_loader(self, param: Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        """The ``param.weight_loader`` of every parameter of this layer (see module doc)."""
        self.quant_method.weight_loader(self, param, loaded_weight, shard_id)

    def load_shard(self, param: Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        """Slice this rank's part of ``loaded_weight`` and copy it into ``param`` in place.

        Raises:
            ValueError: wrong shape, non-float tensor, or a bad ``shard_id`` (nothing copied).
        """
        raise NotImplementedError

    def checkpoint_shapes(self, param_name: str) -> dict[Any, tuple[int, ...]]:
        """FULL checkpoint shape of the tensor(s) that feed parameter ``param_name`` of this
        layer, keyed by ``shard_id`` (``None`` for an unfused parameter)."""
        param = getattr(self, param_name)
        if getattr(param, "not_in_checkpoint", False):
            return {}
        return {None: self._full_shape(param, None)}

    def _full_shape(self, param: Parameter, shard_id) -> tuple[int, ...]:
        return tuple(param.shape)

    def _make_bias(self, size_per_partition: int, output_dim: int | None) -> None:
        bias = Parameter(torch.empty(size_per_partition, dtype=self.params_dtype), requires_grad=False)
        attrs = {"weight_loader": self.weight_loader}
        if output_dim is not None:
            attrs["output_dim"] = output_dim
        set_weight_attrs(bias, attrs)
        self.register_parameter("bias", bias)


def _full_shape_along(param: Parameter, dim_attr: str, full_size: int) -> tuple[int, ...]:
    """``param``'s full checkpoint shape: its own shape with the sharded dimension (named by the
    parameter attribute ``dim_attr``, e.g. ``output_dim``) at ``full_size``."""
    shape = list(param.shape)
    dim = getattr(param, dim_attr, None)
    if dim is not None:
        shape[dim] = full_size
    return tuple(shape)


def _load_along_dim(layer: "LinearBase", param: Parameter, loaded_weight: torch.Tensor, shard_id, dim_attr: str,
                    full_size: int, start_of) -> None:
    """Copy this rank's slice of a full (unfused) tensor into ``param`` in place.

    The slice runs along the dimension named by ``param.<dim_attr>`` from ``start_of(size)``;
    a parameter without that attribute (e.g. a row-parallel bias) is loaded whole; a tensor
    already of the shard's shape (TP > 1) is taken as this rank's part.

    Raises:
        ValueError: a shard id (these layers are unfused), a non-float tensor or a wrong shape.
    """
    if shard_id is not None:
        raise ValueError(f"{type(layer).__name__} takes no shard id, got {shard_id!r}")
    dim = getattr(param, dim_attr, None)
    if dim is None:
        return default_weight_loader(param, loaded_weight)
    what = layer.prefix or "weight"
    check_float(loaded_weight, what)
    if layer.tp_size > 1 and tuple(loaded_weight.shape) == tuple(param.shape):
        param.data.copy_(loaded_weight)  # already this rank's shard
        return
    _check_shape(loaded_weight, _full_shape_along(param, dim_attr, full_size), what)
    size = param.shape[dim]
    param.data.copy_(loaded_weight.narrow(dim, start_of(size), size))


def _check_shape(loaded: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    check_float(loaded, what)
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"{what}: expected full shape {tuple(expected)}, got {tuple(loaded.shape)}")


class ReplicatedLinear(LinearBase):
    """``y = x W^T + b`` with the full weight on every rank.

    Args: see :class:`LinearBase`. Input ``[..., input_size]`` -> output ``[..., output_size]``.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True, params_dtype=None,
                 quant_config=None, prefix: str = ""):
        super().__init__(input_size, output_size, params_dtype, quant_config, prefix)
        self.quant_method.create_weights(self, input_size, [output_size], input_size, output_size,
                                         self.params_dtype, weight_loader=self.weight_loader)
        if bias:
            self._make_bias(output_size, None)
        else:
            self.register_parameter("bias", None)

    def load_shard(self, param, loaded_weight, shard_id=None):
        default_weight_loader(param, loaded_weight, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Linear layer with its output features split across TP ranks.

    Args:
        input_size: full input features.
        output_size: full output features (divisible by the TP size).
        bias: add a (sharded) bias.
        gather_output: all-gather the output so every rank gets ``[..., output_size]``;
            otherwise each returns ``[..., output_size / tp]``.

    Raises:
        ValueError: if ``output_size`` is not divisible by the TP size.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = False,
                 params_dtype=None, quant_config=None, prefix: str = "",
                 output_sizes: list[int] | None = None):
        super().__init__(input_size, output_size, params_dtype, quant_config, prefix)
        self.gather_output = gather_output
        self.output_sizes = list(output_sizes) if output_sizes is not None else [output_size]
        self.output_partition_sizes = self._partition_sizes()
        self.output_size_per_partition = sum(self.output_partition_sizes)
        self.quant_method.create_weights(self, input_size, self.output_partition_sizes, input_size, output_size,
                                         self.params_dtype, weight_loader=self.weight_loader)
        if bias:
            self._make_bias(self.output_size_per_partition, 0)
        else:
            self.register_parameter("bias", None)

    def _partition_sizes(self) -> list[int]:
        return [divide(s, self.tp_size, "output_size") for s in self.output_sizes]

    def _full_shape(self, param, shard_id):
        return _full_shape_along(param, "output_dim", self.output_size)

    def load_shard(self, param, loaded_weight, shard_id=None):
        _load_along_dim(self, param, loaded_weight, shard_id, "output_dim", self.output_size,
                        lambda size: self.tp_rank * size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., input_size]`` -> ``[..., output_size/tp]`` (or full when ``gather_output``)."""
        out = self.quant_method.apply(self, x, self.bias)
        return tp_all_gather_last_dim(out) if self.gather_output else out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices of the same input fused along the output dim.

    Each rank holds ``[shard_0 part; shard_1 part; ...]``. ``weight_loader(param, t, i)``
    loads HF matrix ``i`` (full shape ``[output_sizes[i], input_size]``); ``shard_id=None``
    accepts the already-fused full tensor ``[sum(output_sizes), input_size]``.

    Args:
        input_size: full input features.
        output_sizes: full output features of each fused matrix (each divisible by TP).
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = True, gather_output: bool = False,
                 params_dtype=None, quant_config=None, prefix: str = ""):
        super().__init__(input_size, sum(output_sizes), bias, gather_output, params_dtype, quant_config, prefix,
                         output_sizes=output_sizes)

    def _shard_ids(self) -> list:
        return list(range(len(self.output_sizes)))

    def _shard_index(self, shard_id) -> int:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"{self.prefix}: bad shard id {shard_id!r}; expected one of {self._shard_ids()}")
        return shard_id

    def _src_offset(self, idx: int) -> int:
        """Start of this rank's rows inside HF matrix ``idx``."""
        return self.tp_rank * self.output_partition_sizes[idx]

    def _shard_full_size(self, idx: int) -> int:
        return self.output_sizes[idx]

    def _full_shape(self, param, shard_id):
        shape = list(param.shape)
        dim = getattr(param, "output_dim", None)
        if dim is not None:
            shape[dim] = self.output_size if shard_id is None else self._shard_full_size(self._shard_index(shard_id))
        return tuple(shape)

    def checkpoint_shapes(self, param_name):
        param = getattr(self, param_name)
        if getattr(param, "not_in_checkpoint", False):
            return {}
        if getattr(param, "output_dim", None) is None:
            return {None: tuple(param.shape)}
        return {sid: self._full_shape(param, sid) for sid in self._shard_ids()}

    def load_shard(self, param, loaded_weight, shard_id=None):
        dim = getattr(param, "output_dim", None)
        if dim is None:
            return default_weight_loader(param, loaded_weight, shard_id)
        what = f"{self.prefix or type(self).__name__}[{shard_id}]"
        check_float(loaded_weight, what)
        if shard_id is None:  # the whole fused tensor: validate, then split
            _check_shape(loaded_weight, self._full_shape(param, None), what)
            start = 0
            pieces = []
            for sid in self._shard_ids():
                n = self._shard_full_size(self._shard_index(sid))
                pieces.append((sid, loaded_weight.narrow(dim, start, n)))
                start += n
            for sid, piece in pieces:
                self.load_shard(param, piece, sid)
            return
        idx = self._shard_index(shard_id)
        size = self.output_partition_sizes[idx]
        dst_offset = sum(self.output_partition_sizes[:idx])
        dst = param.data.narrow(dim, dst_offset, size)
        full = self._full_shape(param, shard_id)
        if tuple(loaded_weight.shape) == tuple(full):
            dst.copy_(loaded_weight.narrow(dim, self._src_offset(idx), size))
        elif self.tp_size > 1 and tuple(loaded_weight.shape) == tuple(dst.shape):
            dst.copy_(loaded_weight)  # already this rank's shard
        else:
            raise ValueError(f"{what}: expected full shape {full}, got {tuple(loaded_weight.shape)}")


class QKVParallelLinear(MergedColumnParallelLinear):
    """Fused query/key/value projection, split by heads across TP ranks.

    Per rank the weight is ``[(num_heads + 2*num_kv_heads) * head_size, hidden_size]``; which
    heads a rank holds is :func:`attention_head_partition` (``q_head_start``/``num_heads``,
    ``kv_head_start``/``num_kv_heads``): whole GQA groups, as evenly as possible, or, when
    ``total_num_kv_heads < tp``, one KV head replicated on ``tp / total_num_kv_heads`` ranks
    (``num_kv_head_replicas``). ``shard_id`` is "q", "k" or "v".

    Args:
        hidden_size: input features.
        head_size: per-head size.
        total_num_heads / total_num_kv_heads: over all ranks.
        bias: q/k/v biases (Qwen2).

    Raises:
        ValueError: see :func:`attention_head_partition`.
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int | None = None,
                 bias: bool = True, params_dtype=None, quant_config=None, prefix: str = ""):
        tp = get_tp_size()
        self.hidden_size = hidden_size
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        (self.q_head_start, self.num_heads, self.kv_head_start,
         self.num_kv_heads) = attention_head_partition(total_num_heads, self.total_num_kv_heads, tp, get_tp_rank())
        self.num_kv_head_replicas = tp // self.total_num_kv_heads if tp > self.total_num_kv_heads else 1
        sizes = [total_num_heads * head_size, self.total_num_kv_heads * head_size, self.total_num_kv_heads * head_size]
        super().__init__(hidden_size, sizes, bias, False, params_dtype, quant_config, prefix)

    def _partition_sizes(self) -> list[int]:
        return [self.num_heads * self.head_size, self.num_kv_heads * self.head_size,
                self.num_kv_heads * self.head_size]

    _IDS = {"q": 0, "k": 1, "v": 2}

    def _shard_ids(self) -> list:
        return ["q", "k", "v"]

    def _shard_index(self, shard_id) -> int:
        if shard_id not in self._IDS:
            raise ValueError(f"{self.prefix}: bad shard id {shard_id!r}; expected 'q', 'k' or 'v'")
        return self._IDS[shard_id]

    def _src_offset(self, idx: int) -> int:
        return (self.q_head_start if idx == 0 else self.kv_head_start) * self.head_size


class RowParallelLinear(LinearBase):
    """Linear layer with its input features split across TP ranks.

    Args:
        input_size: full input features (divisible by the TP size unless
            ``input_partition_sizes`` is given).
        output_size: output features.
        bias: add a (replicated) bias once, after the all-reduce.
        input_is_parallel: the input is already this rank's slice ``[..., input_size/tp]``;
            otherwise the full input is given and sliced here.
        reduce_results: all-reduce the partial outputs (``tp_all_reduce``).
        input_partition_sizes: optional explicit split of the input features, one size per TP
            rank in rank order (summing to ``input_size``); rank ``r`` holds the contiguous
            input features ``[sum(sizes[:r]), sum(sizes[:r+1]))``. Used by o_proj, whose rows
            follow the query heads of :func:`attention_head_partition`.

    Raises:
        ValueError: if ``input_size`` is not divisible by the TP size, or the explicit
            partition does not have one positive size per rank summing to ``input_size``.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True, input_is_parallel: bool = True,
                 reduce_results: bool = True, params_dtype=None, quant_config=None, prefix: str = "",
                 input_partition_sizes: list[int] | None = None):
        super().__init__(input_size, output_size, params_dtype, quant_config, prefix)
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        if input_partition_sizes is None:
            self.input_size_per_partition = divide(input_size, self.tp_size, "input_size")
            self.input_start = self.tp_rank * self.input_size_per_partition
        else:
            sizes = [int(n) for n in input_partition_sizes]
            if len(sizes) != self.tp_size or sum(sizes) != input_size or min(sizes) < 1:
                raise ValueError(f"{prefix or 'RowParallelLinear'}: input_partition_sizes={sizes} must give one "
                                 f"positive size per TP rank ({self.tp_size}) summing to input_size={input_size}")
            self.input_size_per_partition = sizes[self.tp_rank]
            self.input_start = sum(sizes[: self.tp_rank])
        self.quant_method.create_weights(self, self.input_size_per_partition, [output_size], input_size, output_size,
                                         self.params_dtype, weight_loader=self.weight_loader)
        if bias:
            self._make_bias(output_size, None)
        else:
            self.register_parameter("bias", None)

    def _full_shape(self, param, shard_id):
        return _full_shape_along(param, "input_dim", self.input_size)

    def load_shard(self, param, loaded_weight, shard_id=None):
        _load_along_dim(self, param, loaded_weight, shard_id, "input_dim", self.input_size,
                        lambda size: self.input_start)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., input_size_per_partition]`` (or full if not ``input_is_parallel``) -> ``[..., output_size]``."""
        if not self.input_is_parallel and self.tp_size > 1:
            x = x.narrow(-1, self.input_start, self.input_size_per_partition)
        if self.tp_size == 1:
            return self.quant_method.apply(self, x, self.bias)
        if not self.reduce_results:  # partial sums: only rank 0 adds the bias
            return self.quant_method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        out = tp_all_reduce(self.quant_method.apply(self, x, None))
        if self.bias is not None:
            out = out + self.bias
        return out
