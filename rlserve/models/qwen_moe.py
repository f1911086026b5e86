"""Qwen3-MoE and Qwen2-MoE: the Llama-family decoder (:mod:`rlserve.models.llama`) with sparse
mixture-of-experts MLPs (:mod:`rlserve.layers.moe`).

- ``Qwen3MoeForCausalLM`` (``model_type == "qwen3_moe"``, e.g. Qwen3-30B-A3B: 128 experts, top-8,
  ``norm_topk_prob``): Qwen3 attention (per-head q/k RMSNorm), a router ``mlp.gate`` and the
  routed experts.
- ``Qwen2MoeForCausalLM`` (``model_type == "qwen2_moe"``): Qwen2 attention (q/k/v bias), plus a
  shared expert ``mlp.shared_expert`` (a dense MLP) scaled per token by
  ``sigmoid(mlp.shared_expert_gate(x))``.

Layer ``i`` is sparse when ``i not in mlp_only_layers``, ``num_experts > 0`` and
``(i + 1) % decoder_sparse_step == 0`` (Hugging Face's rule); other layers take the dense MLP of
``intermediate_size``.

Checkpoint names: the experts are held fused (``experts.w13_weight`` ``[E, 2I, H]``,
``experts.w2_weight`` ``[E, H, I]``). :meth:`load_weights` takes the per-expert names that
``save_pretrained`` writes and trainers send (``mlp.experts.{e}.gate_proj.weight`` ``[I, H]``,
``up_proj`` ``[I, H]``, ``down_proj`` ``[H, I]``) and transformers 5's fused parameter names
(``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``).
:meth:`checkpoint_spec` lists both; :meth:`required_checkpoint_names` the per-expert ones (a
fused name counts for the per-expert names it holds:
:func:`rlserve.loader.weight_utils.expand_expert_names`).

The forward runs the layer modules (not the dense models' CPU decode fast path of
:mod:`rlserve.models.llama_cpu`, nor its micro-batches).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from rlserve.errors import UnsupportedArchitectureError
from rlserve.layers.linear import ReplicatedLinear
from rlserve.layers.moe import FusedMoE, RoutedExpertsCapture
from rlserve.loader.weight_utils import parse_expert_name
from rlserve.models.llama import LlamaForCausalLM, LlamaMLP, LlamaModel


def num_experts(config) -> int:
    """The routed expert count of a Qwen MoE config (``num_experts``, stored by transformers 5 as
    ``num_local_experts``)."""
    return int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0) or 0)


def is_sparse_layer(config, i: int) -> bool:
    """Hugging Face's rule: layer ``i`` has experts (see the module docstring)."""
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return (i not in (getattr(config, "mlp_only_layers", None) or [])) and num_experts(config) > 0 \
        and (i + 1) % step == 0


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ the gated shared expert when ``shared_size``): ``x [T, H] -> [T, H]``."""

    def __init__(self, config, layer_id: int, shared_size: int = 0, quant_config=None, prefix: str = ""):
        super().__init__()
        if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
            raise UnsupportedArchitectureError(f"MoE experts support hidden_act 'silu' only, got {config.hidden_act!r}")
        H, E = config.hidden_size, num_experts(config)
        self.gate = ReplicatedLinear(H, E, bias=False, prefix=f"{prefix}.gate")  # router: never quantized
        self.experts = FusedMoE(E, config.num_experts_per_tok, H, config.moe_intermediate_size,
                                renormalize=bool(getattr(config, "norm_topk_prob", False)), layer_id=layer_id,
                                quant_config=quant_config)
        self.shared_expert = self.shared_expert_gate = None
        if shared_size:
            self.shared_expert = LlamaMLP(H, shared_size, config.hidden_act, quant_config=quant_config,
                                          prefix=f"{prefix}.shared_expert")
            self.shared_expert_gate = ReplicatedLinear(H, 1, bias=False, prefix=f"{prefix}.shared_expert_gate")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoeModel(LlamaModel):
    """:class:`LlamaModel` whose forward runs the layer modules and starts the routed-experts
    capture (when one is set) for each step."""

    capture: RoutedExpertsCapture | None = None

    def forward(self, input_ids, positions, meta):
        hidden = self.embed_tokens(input_ids)
        if self.capture is not None:
            self.capture.begin(hidden.shape[0], hidden.device)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        return self.norm(hidden, residual)[0]


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE (see the module docstring); the model contract of ``docs/INTERFACES.md``.

    Raises:
        UnsupportedArchitectureError: an activation other than SiLU.
        ValueError: ``moe_intermediate_size`` not divisible by the TP size; bad ``num_experts_per_tok``.
    """

    shared_expert = False

    def _build_model(self, config, quant_config) -> nn.Module:
        shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0) if self.shared_expert else 0

        def make_mlp(i: int, prefix: str):
            return SparseMoeBlock(config, i, shared, quant_config, prefix) if is_sparse_layer(config, i) else None

        return MoeModel(config, quant_config, prefix="model", make_mlp=make_mlp)

    # ---- experts by name ----------------------------------------------------------------
    def _experts(self) -> dict[str, FusedMoE]:
        """``{"model.layers.i.mlp.experts": module}`` (built once)."""
        found = self.__dict__.get("_rlserve_experts")
        if found is None:
            found = self.__dict__["_rlserve_experts"] = {
                n: m for n, m in self.named_modules() if isinstance(m, FusedMoE)}
        return found

    def _expert_spec(self) -> tuple[dict[str, tuple[int, ...]], set[str]]:
        """``(spec of every expert name, the per-expert names)``."""
        spec: dict[str, tuple[int, ...]] = {}
        per_expert: set[str] = set()
        for prefix, m in self._experts().items():
            for e, proj in m.checkpoint_names():
                name = f"{prefix}.{e}.{proj}.weight"
                spec[name] = m.checkpoint_shape(e, proj)
                per_expert.add(name)
            for proj in ("gate_up_proj", "down_proj"):
                spec[f"{prefix}.{proj}"] = m.checkpoint_shape(None, proj)
        return spec, per_expert

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As :meth:`LlamaForCausalLM.load_weights`, plus the expert names of the module docstring
        (copied into the fused weights in place).

        Raises:
            KeyError: unknown name (an expert name of a dense layer included). ValueError: wrong
                shape / dtype or an expert id out of range (that tensor is not copied).
        """
        experts = self._experts()
        loaded: set[str] = set()

        def others():
            for name, tensor in weights:
                parsed = parse_expert_name(name)
                if parsed is None:
                    yield name, tensor
                    continue
                prefix, e, proj = parsed
                if prefix not in experts:
                    raise KeyError(f"checkpoint tensor {name!r} names experts of a layer without experts")
                experts[prefix].load_expert(tensor, e, proj)
                loaded.add(name)

        loaded |= super().load_weights(others())
        return loaded

    def checkpoint_spec(self) -> dict[str, tuple[int, ...]]:
        spec = super().checkpoint_spec()
        spec.update(self._expert_spec()[0])
        return spec

    def required_checkpoint_names(self) -> set[str]:
        """The per-expert names and every non-expert name (the fused aliases are optional)."""
        spec, per_expert = self._expert_spec()
        return (super().required_checkpoint_names() - set(spec)) | per_expert

    # ---- routed-experts replay --------------------------------------------------------
    def enable_routed_experts_capture(self, reserve_rows: int = 0) -> RoutedExpertsCapture:
        """Make every forward record the routed expert ids (``[T, num_hidden_layers, top_k]``
        int32, see :class:`RoutedExpertsCapture`; ``reserve_rows``: the largest decode CUDA graph's
        batch); returns the capture (the same one when called again)."""
        cap = self.model.capture
        if cap is None:
            cfg = self.config
            cap = RoutedExpertsCapture(cfg.num_hidden_layers, cfg.num_experts_per_tok, num_experts(cfg),
                                       reserve_rows=reserve_rows)
            self.model.capture = cap
            for m in self._experts().values():
                m.capture = cap
        return cap


    def after_graph_replay(self, num_rows: int) -> None:
        """Called by the model runner after a decode CUDA graph ran ``num_rows`` real rows: the
        routed-experts capture (if on) points at the rows the graph wrote."""
        if self.model.capture is not None:
            self.model.capture.replayed(num_rows)


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    """Qwen2-MoE: Qwen2 attention (q/k/v bias, ``qkv_bias``), routed experts and the sigmoid-gated
    shared expert (``shared_expert_intermediate_size``)."""

    shared_expert = True
