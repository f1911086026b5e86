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
logits' dtype. Expert computation, two implementations with the same contract
``(x [T, H], w13, w2, topk_weights [T, K], topk_ids [T, K]) -> [T, H]``:

- :func:`experts_grouped` (the CPU path, used everywhere this round): tokens sorted by expert,
  one GEMM pair per expert over the tokens routed to it; experts summed per token in ascending
  expert order, as Hugging Face's eager ``Qwen3MoeExperts`` does.
- :func:`experts_reference`: every expert on every token, masked by the routing (dense, O(E);
  a float32 reference to test a GPU grouped-GEMM kernel against).

Routed-experts capture (vLLM's ``--enable-return-routed-experts``): a layer given a
:class:`RoutedExpertsCapture` writes its ``topk_ids`` into the capture's step buffer at its
decoder-layer index.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import Parameter

from rlserve.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_reduce
from rlserve.loader.weight_utils import check_float


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits [T, E]`` -> ``(topk_weights [T, K] in the logits' dtype, topk_ids [T, K]
    int64)``: softmax in float32, ``torch.topk`` (largest first), renormalized to sum 1 when
    ``renormalize``."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def _silu_and_mul(gu: torch.Tensor) -> torch.Tensor:
    d = gu.shape[-1] // 2
    return F.silu(gu[..., :d]) * gu[..., d:]


def experts_grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
    """The routed experts' weighted sum, one GEMM pair per expert that got tokens.

    Args:
        x: ``[T, H]`` activations. w13: ``[E, 2I, H]``; w2: ``[E, H, I]`` (same dtype as ``x``).
        topk_weights: ``[T, K]`` routing weights; topk_ids: ``[T, K]`` expert ids in ``[0, E)``.

    Returns:
        ``[T, H]`` in ``x``'s dtype: ``sum_k w[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))``,
        accumulated per token in ascending expert order (Hugging Face's order).
    """
    T, K = topk_ids.shape
    out = torch.zeros_like(x)
    if T == 0:
        return out
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    flat_w = topk_weights.reshape(-1)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = order[start:start + n]
        start += n
        tok = rows // K
        h = _silu_and_mul(F.linear(x.index_select(0, tok), w13[e]))
        y = F.linear(h, w2[e]) * flat_w.index_select(0, rows).unsqueeze(1)
        out.index_add_(0, tok, y)
    return out


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
    ``decoder_sparse_step``) stay 0, as in vLLM. ``num_layers`` is the decoder's layer count."""

    def __init__(self, num_layers: int, top_k: int, num_experts: int):
        self.num_layers, self.top_k, self.num_experts = num_layers, top_k, num_experts
        self.buffer: torch.Tensor | None = None

    def begin(self, num_tokens: int, device) -> None:
        self.buffer = torch.zeros(num_tokens, self.num_layers, self.top_k, dtype=torch.int32, device=device)

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
                 layer_id: int, params_dtype: torch.dtype | None = None, reduce_results: bool = True):
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
        self.w13_weight = Parameter(torch.empty(num_experts, 2 * self.i_part, hidden_size, dtype=dtype),
                                    requires_grad=False)
        self.w2_weight = Parameter(torch.empty(num_experts, hidden_size, self.i_part, dtype=dtype),
                                   requires_grad=False)
        self.capture: RoutedExpertsCapture | None = None
        # the expert computation, :func:`experts_grouped`'s contract: the seam where a GPU grouped
        # GEMM kernel goes (tested against :func:`experts_reference`, tests/gpu/test_moe_gpu.py)
        self.experts_fn = experts_grouped

    # ---- forward ------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, ``router_logits [T, E]`` -> ``[T, H]`` (x's dtype)."""
        weights, ids = route(router_logits, self.top_k, self.renormalize)
        if self.capture is not None:
            self.capture.record(self.layer_id, ids)
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
            dst.copy_(loaded)
            return
        p, r = self.i_part, self.tp_rank
        if expert is None and proj == "gate_up_proj":  # [E, 2I, H]: this rank's gate rows, then its up rows
            I = self.intermediate_size
            dst[:, :p].copy_(loaded[:, r * p:(r + 1) * p])
            dst[:, p:].copy_(loaded[:, I + r * p:I + (r + 1) * p])
            return
        dst.copy_(loaded.narrow(dim, r * p, p))

    def export_expert(self, expert: int | None, proj: str) -> torch.Tensor:
        """The full Hugging Face tensor of one expert projection, rebuilt from the fused weights
        (this rank's part when TP > 1; the caller gathers along the intermediate dim)."""
        p = self.i_part
        if expert is None:
            return self.w13_weight.data if proj == "gate_up_proj" else self.w2_weight.data
        if proj == "gate_proj":
            return self.w13_weight.data[expert, :p]
        if proj == "up_proj":
            return self.w13_weight.data[expert, p:]
        return self.w2_weight.data[expert]

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
        w13, w2 = self.w13_weight.data, self.w2_weight.data
        items.append((f"{mod_name}.gate_up_proj",
                      lambda: torch.cat([full(w13[:, :p], 1), full(w13[:, p:], 1)], dim=1)))
        items.append((f"{mod_name}.down_proj", lambda: full(w2, 2)))
        return items
