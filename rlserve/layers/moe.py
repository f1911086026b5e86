"""Mixture-of-experts layer: top-k router and fused expert weights (Qwen3-MoE / Qwen2-MoE style).

Weights, fused the way vLLM's ``FusedMoE`` holds them (and transformers 5's in-memory
``experts.gate_up_proj`` / ``experts.down_proj``):

- ``w13_weight`` ``[E, 2 * I_p, H]``: per expert ``[gate; up]`` (rows ``0:I_p`` gate, ``I_p:`` up),
- ``w2_weight`` ``[E, H, I_p]``: per expert ``down``,

with ``E`` experts, hidden size ``H`` and ``I_p = moe_intermediate_size / tp_size`` (tensor
parallelism splits every expert's intermediate dimension like a dense MLP; the partial outputs
are summed with one all-reduce).

Routing (:func:`route`, Hugging Face's ``Qwen3MoeTopKRouter``): softmax over the router logits
in float32, top-k, optionally renormalized to sum 1 (``norm_topk_prob``), cast back to the
logits' dtype (one Triton launch on CUDA). Expert computation, implementations with the same
contract ``(x [T, H], w13, w2, topk_weights [T, K], topk_ids [T, K]) -> [T, H]``, picked by
:func:`experts_auto`:

- :func:`rlserve.layers.moe_kernels.experts_triton` (CUDA): the fused-MoE Triton kernel, no host
  sync (captured in the decode CUDA graphs); fp8 weights too.
- :func:`experts_grouped` (CPU): tokens sorted by expert, one GEMM pair per expert over the
  tokens routed to it; experts summed per token in ascending expert order, as Hugging Face's
  eager ``Qwen3MoeExperts`` does. :func:`experts_fp8_emulated`: the same with fp8 weights.
- :func:`experts_reference`: every expert on every token, masked by the routing (dense, O(E);
  the float32 reference the kernels are tested against).

Online fp8 (``--quantization fp8``): ``w13_weight`` / ``w2_weight`` are float8_e4m3fn with
``w13_weight_scale [E, 2 * I_p]`` / ``w2_weight_scale [E, H]`` float32, one scale per (expert,
output row), :mod:`rlserve.layers.fp8`'s scheme; every load re-quantizes the rows it writes.

Routed-experts capture (vLLM's ``--enable-return-routed-experts``): a layer given a
:class:`RoutedExpertsCapture` writes its ``topk_ids`` into the capture's step buffer at its
decoder-layer index.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import Parameter

from rlserve import envs
from rlserve.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_reduce
from rlserve.layers import moe_kernels
from rlserve.layers.fp8 import FP8_DTYPE, dequantize_per_row, fp8_linear_emulated, quantize_per_row
from rlserve.loader.weight_utils import check_float


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits [T, E]`` -> ``(topk_weights [T, K] in the logits' dtype, topk_ids [T, K]
    int64)``: softmax in float32, top-k (largest first), renormalized to sum 1 when
    ``renormalize``. On CUDA one Triton launch (:func:`rlserve.layers.moe_kernels.topk_softmax`),
    elsewhere :func:`route_torch`."""
    if router_logits.is_cuda and moe_kernels.triton_runs_on("cuda"):
        return moe_kernels.topk_softmax(router_logits, top_k, renormalize)
    return route_torch(router_logits, top_k, renormalize)


def route_torch(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`route` with PyTorch ops (Hugging Face's ``Qwen3MoeTopKRouter``): ``torch.softmax``
    in float32, ``torch.topk``, ``weights / weights.sum()``."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def _silu_and_mul(gu: torch.Tensor) -> torch.Tensor:
    d = gu.shape[-1] // 2
    return F.silu(gu[..., :d]) * gu[..., d:]


def _expert_loop(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                 mlp) -> torch.Tensor:
    """``sum_k w[t, k] * mlp(e_tk, x_t)``: tokens sorted by expert, ``mlp(e, rows [n, H]) -> [n, H]``
    once per expert that got tokens, accumulated per token in ascending expert order (one host
    sync for the per-expert counts)."""
    T, K = topk_ids.shape
    out = torch.zeros_like(x)
    if T == 0:
        return out
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    flat_w = topk_weights.reshape(-1)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = order[start:start + n]
        start += n
        tok = rows // K
        y = mlp(e, x.index_select(0, tok)) * flat_w.index_select(0, rows).unsqueeze(1)
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def experts_grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
    """The routed experts' weighted sum, one GEMM pair per expert that got tokens (the CPU path).

    Args:
        x: ``[T, H]`` activations. w13: ``[E, 2I, H]``; w2: ``[E, H, I]`` (same dtype as ``x``).
        topk_weights: ``[T, K]`` routing weights; topk_ids: ``[T, K]`` expert ids in ``[0, E)``.

    Returns:
        ``[T, H]`` in ``x``'s dtype: ``sum_k w[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))``,
        accumulated per token in ascending expert order (Hugging Face's order).
    """
    return _expert_loop(x, topk_weights, topk_ids, w13.shape[0],
                        lambda e, xe: F.linear(_silu_and_mul(F.linear(xe, w13[e])), w2[e]))


def experts_fp8_emulated(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor) -> torch.Tensor:
    """fp8 experts without fp8 tensor cores (CPU): :func:`experts_grouped` with every GEMM an
    :func:`rlserve.layers.fp8.fp8_linear_emulated` (activations quantized per row, float32
    product of the fp8 values, both scales): the function the Triton kernel computes with fp8
    weights. ``w13`` / ``w2`` float8_e4m3fn, ``w13_scale [E, 2I]`` / ``w2_scale [E, H]`` float32."""
    def mlp(e, xe):
        h = _silu_and_mul(fp8_linear_emulated(xe, w13[e], w13_scale[e]))
        return fp8_linear_emulated(h, w2[e], w2_scale[e])

    return _expert_loop(x, topk_weights, topk_ids, w13.shape[0], mlp)


def experts_auto(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                 w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The expert path for ``x``'s device (:envvar:`RLSERVE_MOE_BACKEND` overrides): on CUDA the
    fused-MoE Triton kernel (:func:`rlserve.layers.moe_kernels.experts_triton`; no host sync, CUDA
    graphs capture it), ``grouped_mm`` PyTorch's grouped GEMM (bf16 on sm90; PyTorch's fallback
    elsewhere, CPU included), ``loop`` one GEMM pair per expert (a host sync per layer: no CUDA
    graphs); on CPU the loop (``grouped_mm`` measured no faster there in a whole decode step). fp8 weights (with their
    scales) take the Triton kernel on CUDA and :func:`experts_fp8_emulated` elsewhere.

    Raises:
        ValueError: an unknown ``RLSERVE_MOE_BACKEND``.
    """
    backend = envs.RLSERVE_MOE_BACKEND
    if backend not in (None, "triton", "grouped_mm", "loop"):
        raise ValueError(f"RLSERVE_MOE_BACKEND must be 'triton', 'grouped_mm' or 'loop', got {backend!r}")
    triton_ok = moe_kernels.triton_runs_on(x.device.type)
    if backend is None:
        backend = "triton" if x.is_cuda and triton_ok else "loop"
    if w13_scale is not None:  # fp8: the Triton kernel where it runs, else the emulation
        if backend != "loop" and triton_ok:
            return moe_kernels.experts_triton(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
        return experts_fp8_emulated(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    if backend == "grouped_mm":
        return moe_kernels.experts_grouped_mm(x, w13, w2, topk_weights, topk_ids)
    if backend == "triton" and triton_ok:
        return moe_kernels.experts_triton(x, w13, w2, topk_weights, topk_ids)
    return experts_grouped(x, w13, w2, topk_weights, topk_ids)


def experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> torch.Tensor:
    """The same sum as :func:`experts_grouped`, computed densely in float32: every expert on
    every token (``[E, T, H]`` intermediates), weighted by a ``[T, E]`` matrix that is zero
    off the routed experts. Returns ``[T, H]`` float32. For tests (memory O(E * T * H))."""
    xf, w13f, w2f = x.float(), w13.float(), w2.float()
    h = _silu_and_mul(torch.einsum("th,eoh->eto", xf, w13f))  # [E, T, I]
    y = torch.einsum("eti,ehi->eth", h, w2f)  # [E, T, H]
    dense = torch.zeros(x.shape[0], w13.shape[0], dtype=torch.float32, device=x.device)
    dense.scatter_add_(1, topk_ids, topk_weights.float())
    return torch.einsum("te,eth->th", dense, y)


class RoutedExpertsCapture:
    """The step's routed expert ids of every MoE layer (vLLM's ``RoutedExpertsCapturer``).

    :meth:`begin` (called by the model at the start of each forward) makes ``buffer`` a zeroed
    ``[T, num_layers, top_k]`` int32 tensor on ``device``; each MoE layer writes its top-k ids
    into ``buffer[:, layer_id]``; layers without experts (``mlp_only_layers``,
    ``decoder_sparse_step``) stay 0, as in vLLM. ``num_layers`` is the decoder's layer count.

    CUDA graphs: steps of at most ``reserve_rows`` tokens (the engine sets ``max_num_seqs``, the
    largest decode graph) write into the first rows of one ``[reserve_rows, num_layers, top_k]``
    buffer allocated at the first :meth:`begin` and never replaced, so a captured decode graph
    writes there at every replay; after a replay of ``B`` rows the runner calls
    :meth:`replayed` (``buffer`` = the first ``B`` rows). Larger (prefill) steps get a buffer of
    their own."""

    def __init__(self, num_layers: int, top_k: int, num_experts: int, reserve_rows: int = 0):
        self.num_layers, self.top_k, self.num_experts = num_layers, top_k, num_experts
        self.reserve_rows = reserve_rows
        self.buffer: torch.Tensor | None = None
        self._static: torch.Tensor | None = None

    def begin(self, num_tokens: int, device) -> None:
        """Start a forward of ``num_tokens`` rows (see the class docstring).

        Raises:
            RuntimeError: a CUDA graph capture of more than ``reserve_rows`` rows (the graph
                would write a buffer the engine never reads).
        """
        if self._static is None and self.reserve_rows:
            self._static = torch.zeros(self.reserve_rows, self.num_layers, self.top_k, dtype=torch.int32,
                                       device=device)
        static = self._static
        if static is not None and num_tokens <= static.shape[0] and static.device == torch.device(device):
            self.buffer = self._static[:num_tokens]
            self.buffer.zero_()
            return
        if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"routed-experts capture: a CUDA graph of {num_tokens} rows exceeds the reserved "
                               f"{self.reserve_rows}")
        self.buffer = torch.zeros(num_tokens, self.num_layers, self.top_k, dtype=torch.int32, device=device)

    def replayed(self, num_rows: int) -> None:
        """A CUDA graph wrote the routing of ``num_rows`` real rows (padding rows follow) into
        the reserved buffer.

        Raises:
            RuntimeError: no reserved buffer (graphs were captured without one)."""
        if self._static is None or num_rows > self._static.shape[0]:
            raise RuntimeError(f"routed-experts capture: a CUDA graph replay of {num_rows} rows without a reserved "
                               f"buffer of that size ({self.reserve_rows} rows)")
        self.buffer = self._static[:num_rows]

    def record(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """Write one layer's ``[T, top_k]`` ids (nothing before :meth:`begin`).

        Raises:
            RuntimeError: ``T`` is not the step's token count (a forward that split the step's
                rows would lose rows: the MoE model runs whole steps).
        """
        if self.buffer is None:
            return
        if self.buffer.shape[0] != topk_ids.shape[0]:
            raise RuntimeError(f"routed-experts capture: layer {layer_id} routed {topk_ids.shape[0]} tokens in a "
                               f"step of {self.buffer.shape[0]}")
        self.buffer[:, layer_id] = topk_ids

    def take(self) -> torch.Tensor | None:
        """The buffer of the last forward (``None`` before any); cleared."""
        buf, self.buffer = self.buffer, None
        return buf


class FusedMoE(nn.Module):
    """The routed experts of one MoE block: fused weights, routing applied to given logits.

    Args:
        num_experts / top_k: ``E`` and ``K``. hidden_size: ``H``. intermediate_size: the FULL
            per-expert ``I`` (``moe_intermediate_size``; split over TP ranks).
        renormalize: ``norm_topk_prob``. layer_id: the decoder layer's index (capture slot).
        reduce_results: all-reduce the output over the TP group (False when the caller sums
            more partial outputs first).

    Raises:
        ValueError: ``I`` not divisible by the TP size, or ``top_k`` not in ``[1, E]``.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 layer_id: int, params_dtype: torch.dtype | None = None, reduce_results: bool = True,
                 quant_config=None):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        if intermediate_size % self.tp_size:
            raise ValueError(f"moe_intermediate_size {intermediate_size} is not divisible by the TP size {self.tp_size}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.i_part = intermediate_size // self.tp_size
        self.layer_id, self.reduce_results = layer_id, reduce_results
        dtype = params_dtype or torch.get_default_dtype()
        # online fp8 (``--quantization fp8``): fp8 weights, one float32 scale per (expert, output row)
        self.fp8 = getattr(quant_config, "name", None) == "fp8"
        wdtype = FP8_DTYPE if self.fp8 else dtype
        self.w13_weight = Parameter(torch.empty(num_experts, 2 * self.i_part, hidden_size, dtype=wdtype),
                                    requires_grad=False)
        self.w2_weight = Parameter(torch.empty(num_experts, hidden_size, self.i_part, dtype=wdtype),
                                   requires_grad=False)
        self.w13_weight_scale = self.w2_weight_scale = None
        if self.fp8:
            self.w13_weight_scale = Parameter(torch.ones(num_experts, 2 * self.i_part, dtype=torch.float32),
                                              requires_grad=False)
            self.w2_weight_scale = Parameter(torch.ones(num_experts, hidden_size, dtype=torch.float32),
                                             requires_grad=False)
        self.capture: RoutedExpertsCapture | None = None
        # the expert computation, :func:`experts_grouped`'s contract plus the fp8 scales
        # (:func:`experts_auto`: the Triton kernel on CUDA, the loop on CPU)
        self.experts_fn = experts_auto

    # ---- forward ------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, ``router_logits [T, E]`` -> ``[T, H]`` (x's dtype)."""
        weights, ids = route(router_logits, self.top_k, self.renormalize)
        if self.capture is not None:
            self.capture.record(self.layer_id, ids)
        if self.fp8:
            out = self.experts_fn(x, self.w13_weight, self.w2_weight, weights, ids,
                                  self.w13_weight_scale, self.w2_weight_scale)
        else:
            out = self.experts_fn(x, self.w13_weight, self.w2_weight, weights, ids)
        if self.reduce_results and self.tp_size > 1:
            out = tp_all_reduce(out)
        return out

    # ---- loading ------------------------------------------------------------------------
    def _target(self, expert: int | None, proj: str) -> tuple[torch.Tensor, tuple[int, ...], int]:
        """``(destination view, full checkpoint shape, dim of the intermediate size in the
        checkpoint tensor)`` for one Hugging Face expert tensor."""
        E, H, I, p = self.num_experts, self.hidden_size, self.intermediate_size, self.i_part
        w13, w2 = self.w13_weight.data, self.w2_weight.data
        if expert is None:
            if proj == "gate_up_proj":
                return w13, (E, 2 * I, H), 1
            return w2, (E, H, I), 2
        if proj == "gate_proj":
            return w13[expert, :p], (I, H), 0
        if proj == "up_proj":
            return w13[expert, p:], (I, H), 0
        return w2[expert], (H, I), 1

    def checkpoint_shapes(self, param_name: str) -> dict:
        """Empty: the fused parameters have no checkpoint name of their own (the model lists the
        per-expert names, :func:`rlserve.loader.weight_utils.mapped_checkpoint_spec` skips these)."""
        return {}

    def checkpoint_shape(self, expert: int | None, proj: str) -> tuple[int, ...]:
        """The full Hugging Face shape of an expert tensor (see :func:`parse_expert_name`)."""
        return self._target(expert, proj)[1]

    def load_expert(self, loaded: torch.Tensor, expert: int | None, proj: str) -> None:
        """Copy one Hugging Face expert tensor (full, or this rank's shard of exactly the shard's
        shape) into the fused weights in place.

        Raises:
            ValueError: expert id out of range, a non-float tensor or a wrong shape (nothing copied).
        """
        if expert is not None and not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range [0, {self.num_experts})")
        check_float(loaded, f"experts.{proj}")
        dst, full, dim = self._target(expert, proj)
        shape = tuple(loaded.shape)
        if shape != full and not (self.tp_size > 1 and expert is not None and shape == tuple(dst.shape)):
            raise ValueError(f"experts.{'' if expert is None else f'{expert}.'}{proj}: shape {list(shape)} != "
                             f"expected {list(full)}")
        if shape == tuple(dst.shape):
            local = loaded
        else:
            p, r = self.i_part, self.tp_rank
            if expert is None and proj == "gate_up_proj":  # [E, 2I, H]: this rank's gate rows, then its up rows
                I = self.intermediate_size
                local = torch.cat([loaded[:, r * p:(r + 1) * p], loaded[:, I + r * p:I + (r + 1) * p]], dim=1)
            else:
                local = loaded.narrow(dim, r * p, p)
        if not self.fp8:
            dst.copy_(local)
            return
        # rows are the output channels of w13 and w2 alike: quantize this rank's rows (as fp8.py's
        # row-parallel rule: the down projection's scales are over this rank's columns)
        q, scale = quantize_per_row(local.to(dst.device))
        dst.copy_(q)
        self._scale_target(expert, proj).copy_(scale.squeeze(-1))

    def _scale_target(self, expert: int | None, proj: str) -> torch.Tensor:
        """The fp8 scales of the rows :meth:`_target` names (``[..rows]`` float32 view)."""
        p, s13, s2 = self.i_part, self.w13_weight_scale.data, self.w2_weight_scale.data
        if expert is None:
            return s13 if proj == "gate_up_proj" else s2
        return {"gate_proj": s13[expert, :p], "up_proj": s13[expert, p:]}.get(proj, s2[expert])

    def export_expert(self, expert: int | None, proj: str) -> torch.Tensor:
        """The full Hugging Face tensor of one expert projection, rebuilt from the fused weights
        (this rank's part when TP > 1; the caller gathers along the intermediate dim)."""
        view = self._target(expert, proj)[0]
        if self.fp8:  # float32 ``q * scale`` (as Fp8LinearMethod.dequantized_weight)
            return dequantize_per_row(view, self._scale_target(expert, proj))
        return view

    def checkpoint_names(self) -> list[tuple[int, str]]:
        """``(expert, projection)`` of every per-expert tensor, in checkpoint order."""
        return [(e, proj) for e in range(self.num_experts) for proj in ("gate_proj", "up_proj", "down_proj")]

    def export_checkpoint_tensors(self, mod_name: str, gather) -> list[tuple[str, object]]:
        """``[(hf name, thunk)]``: a thunk returns the full Hugging Face tensor, per expert and the
        two fused ones (for :func:`rlserve.transfer.server.checksums.export_plan`).
        ``gather(local, dim)``: every TP rank's ``local`` concatenated along ``dim`` (all ranks
        must call the thunks together, in order)."""
        p = self.i_part

        def full(local, dim):
            return local if self.tp_size == 1 else gather(local, dim)

        dims = {"gate_proj": 0, "up_proj": 0, "down_proj": 1}
        items = [(f"{mod_name}.{e}.{proj}.weight", lambda e=e, proj=proj: full(self.export_expert(e, proj), dims[proj]))
                 for e, proj in self.checkpoint_names()]
        w13, w2 = self.export_expert(None, "gate_up_proj"), self.export_expert(None, "down_proj")
        items.append((f"{mod_name}.gate_up_proj",
                      lambda: torch.cat([full(w13[:, :p], 1), full(w13[:, p:], 1)], dim=1)))
        items.append((f"{mod_name}.down_proj", lambda: full(w2, 2)))
        return items
