"""Llama-family decoder (Llama 2/3, Mistral, SmolLM2, Qwen2/2.5, Qwen3) on rlserve layers.

Parameter names equal the Hugging Face checkpoint names except for the fused
``qkv_proj`` (q_proj, k_proj, v_proj) and ``gate_up_proj`` (gate_proj, up_proj).
Variants, read from the HF config:

- Qwen2 (``model_type == "qwen2"``): q/k/v projections always have a bias, o_proj none.
- Llama ``attention_bias``: bias on q/k/v and o; ``mlp_bias``: bias on the MLP projections.
- Qwen3 (``model_type == "qwen3"``): per-head RMSNorm ``q_norm`` / ``k_norm`` before rotary.
- ``tie_word_embeddings``: the LM head is the token embedding; ``lm_head.weight`` is optional.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch
from torch import nn

from rlserve.distributed.head_partition import attention_head_partition_sizes
from rlserve.errors import UnsupportedArchitectureError
from rlserve.layers import fused_ops, gemv
from rlserve.layers.activation import SiluAndMul
from rlserve.layers.attention import Attention, AttentionMetadata
from rlserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from rlserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from rlserve.layers.norm import RMSNorm
from rlserve.layers.rotary import get_rope
from rlserve.loader.weight_utils import load_mapped_weights, mapped_checkpoint_spec
from rlserve.models import llama_cpu

logger = logging.getLogger(__name__)


class LlamaMLP(nn.Module):
    """``x [T, H] -> down(silu(gate(x)) * up(x)) [T, H]`` with fused, column-parallel gate/up."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False,
                 quant_config=None, prefix: str = ""):
        super().__init__()
        if hidden_act not in ("silu", "swish"):
            raise UnsupportedArchitectureError(f"Llama MLP supports hidden_act 'silu' only, got {hidden_act!r}")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias,
                                                       quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    """Self-attention: fused QKV, optional per-head q/k RMSNorm (Qwen3), RoPE, paged attention, o_proj."""

    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        model_type = getattr(config, "model_type", "llama")
        hidden = config.hidden_size
        self.total_num_heads = config.num_attention_heads
        self.total_num_kv_heads = getattr(config, "num_key_value_heads", None) or self.total_num_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // self.total_num_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        qwen2 = model_type in ("qwen2", "qwen2_moe")
        qkv_bias = bool(getattr(config, "qkv_bias", True)) if qwen2 else attention_bias
        o_bias = False if qwen2 else attention_bias
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, self.total_num_heads, self.total_num_kv_heads,
                                          bias=qkv_bias, quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # o_proj's input rows follow this rank's query heads (uneven when the KV heads do not
        # divide over the TP size, e.g. 3 KV heads over 2 ranks).
        q_split = [q * self.head_dim for q, _ in attention_head_partition_sizes(
            self.total_num_heads, self.total_num_kv_heads, self.qkv_proj.tp_size)]
        self.o_proj = RowParallelLinear(self.total_num_heads * self.head_dim, hidden, bias=o_bias,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj",
                                        input_partition_sizes=q_split)
        self.qk_norm = model_type in ("qwen3", "qwen3_moe")
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.rotary_emb = get_rope(self.head_dim, config.max_position_embeddings, config)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(hidden), meta, self.o_proj)

    def fused_write_ok(self, qkv: torch.Tensor) -> bool:
        """Whether :meth:`norm_rope_write` runs for ``qkv`` (fused kernels on for it, a cache bound). Not
        for an fp8 cache on the CPU kernels (they write float32 only), nor for a layer that is to compute
        its KV scales (it sees its K/V in ``Attention.forward`` first)."""
        attn = self.attn
        fp8 = attn.k_scale is not None
        return (fused_ops.fused_enabled(qkv) and attn.k_cache is not None
                and not (fp8 and (attn.calculate_kv_scales or not fused_ops.triton_enabled(qkv))))

    def norm_rope_write(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q/k norm, rotary and the KV-cache write of ``qkv [T, q_size + 2 * kv_size]`` in one kernel
        (:func:`rlserve.layers.fused_ops.qkv_norm_rope_write`, slots ``meta.slot_mapping``); returns the
        rotated queries ``[T, q_size]``. Only where :meth:`fused_write_ok`."""
        attn, rope = self.attn, self.rotary_emb
        return fused_ops.qkv_norm_rope_write(
            qkv, positions, rope.cos_cache, rope.sin_cache, self.num_heads, self.num_kv_heads, self.head_dim,
            attn.k_cache, attn.v_cache, meta.slot_mapping,
            self.q_norm.weight if self.qk_norm else None, self.k_norm.weight if self.qk_norm else None,
            self.q_norm.eps if self.qk_norm else 0.0, **attn.kv_scale_kwargs(),
        )

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata, o_proj) -> torch.Tensor:
        """The layer after ``qkv_proj``: ``qkv [T, q_size + 2 * kv_size]`` -> ``o_proj(attention) [T, hidden]``
        (``o_proj``: the module, or the batch-1 GEMV of :mod:`rlserve.layers.gemv`)."""
        T = qkv.shape[0]
        if self.fused_write_ok(qkv):  # attention reads K/V from the cache the fused kernel wrote
            return o_proj(self.attn.forward_cached(self.norm_rope_write(positions, qkv, meta), meta))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            q = self.q_norm(q.reshape(T, self.num_heads, self.head_dim)).reshape(T, self.q_size)
            k = self.k_norm(k.reshape(T, self.num_kv_heads, self.head_dim)).reshape(T, self.kv_size)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, meta)
        return o_proj(out)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; carries the residual stream separately (fused add + RMSNorm). ``mlp``:
    the feed-forward module (``x [T, H] -> [T, H]``; default the dense :class:`LlamaMLP`; the MoE
    models pass their sparse block)."""

    def __init__(self, config, quant_config=None, prefix: str = "", mlp: nn.Module | None = None):
        super().__init__()
        self.self_attn = LlamaAttention(config, quant_config, prefix=f"{prefix}.self_attn")
        self.mlp = mlp if mlp is not None else LlamaMLP(
            config.hidden_size, config.intermediate_size, getattr(config, "hidden_act", "silu"),
            bias=bool(getattr(config, "mlp_bias", False)), quant_config=quant_config, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions, hidden, residual, meta):
        a, m = self.self_attn, self.mlp
        if (gemv.takes(hidden, a.qkv_proj, a.o_proj) and gemv.norm_ok(self.input_layernorm, hidden)
                and gemv.no_hooks(self, a)):  # batch-1 decode: the linears as GEMVs, norms / SiLU folded in
            qkv, residual = gemv.norm_linear(hidden, residual, self.input_layernorm, a.qkv_proj)
            hidden = a.attend(positions, qkv, meta, lambda x: gemv.linear(x, a.o_proj))
            if (type(m) is LlamaMLP and gemv.takes(hidden, m.gate_up_proj, m.down_proj)
                    and gemv.norm_ok(self.post_attention_layernorm, hidden) and gemv.no_hooks(m, m.act_fn)):
                gate_up, residual = gemv.norm_linear(hidden, residual, self.post_attention_layernorm, m.gate_up_proj)
                return gemv.silu_mul_linear(gate_up, m.down_proj), residual
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            return m(hidden), residual
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF ``model.*``). ``make_mlp(i, prefix)``: the
    feed-forward module of layer ``i`` (``None``: the dense :class:`LlamaMLP`)."""

    def __init__(self, config, quant_config=None, prefix: str = "model", make_mlp=None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix=f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, quant_config, prefix=f"{prefix}.layers.{i}",
                              mlp=make_mlp(i, f"{prefix}.layers.{i}.mlp") if make_mlp is not None else None)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, positions, meta):
        hidden = self.embed_tokens(input_ids)
        ctx = llama_cpu.step_context(self.layers, hidden, positions, meta)  # CPU decode: kernels called directly
        return llama_cpu.forward_layers(ctx, self.layers, self.norm, positions, hidden, meta)


class LlamaForCausalLM(nn.Module):
    """Causal LM for the Llama family (see module docstring), following the model contract of
    ``docs/INTERFACES.md``.

    Args:
        config: the Hugging Face config (``LlamaConfig``, ``MistralConfig``, ``Qwen2Config``,
            ``Qwen3Config``).
        quant_config: optional quantization config for the linear layers.

    Raises:
        UnsupportedArchitectureError: unsupported activation or rope type.
        ValueError: heads that cannot be split over the TP size (see
            :func:`rlserve.distributed.head_partition.attention_head_partition`).
    """

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    stacked_params_mapping = [
        (".qkv_proj.", ".q_proj.", "q"),
        (".qkv_proj.", ".k_proj.", "k"),
        (".qkv_proj.", ".v_proj.", "v"),
        (".gate_up_proj.", ".gate_proj.", 0),
        (".gate_up_proj.", ".up_proj.", 1),
    ]

    def __init__(self, config, quant_config=None):
        super().__init__()
        self.config = config
        self.quant_config = quant_config
        sw = getattr(config, "sliding_window", None)
        if sw is not None and getattr(config, "use_sliding_window", True) and sw < config.max_position_embeddings:
            logger.warning("sliding_window=%s is not implemented; attention is full-context (exact only for "
                           "contexts <= %s tokens)", sw, sw)
        self.model = self._build_model(config, quant_config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
            self.lm_head.serve_as_lm_head()
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix="lm_head")

    def _build_model(self, config, quant_config) -> nn.Module:
        """The ``model.*`` module (embedding, layers, norm); subclasses swap the layers' MLPs."""
        return LlamaModel(config, quant_config, prefix="model")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``input_ids [T] int64``, ``positions [T] int64`` -> hidden states ``[T, hidden_size]``
        (model dtype). Writes this step's K/V into the bound caches."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """``hidden [N, hidden_size]`` -> ``[N, vocab_size]`` float32 (``float32=False``: the
        model dtype), full vocabulary on every rank."""
        return self.lm_head.compute_logits(hidden, float32=float32)

    @staticmethod
    def normalize_checkpoint_name(name: str) -> str:
        """The canonical checkpoint name (identity for this family)."""
        return name

    @staticmethod
    def _skip(name: str) -> bool:
        return "rotary_emb.inv_freq" in name or "rotary_emb.cos_cached" in name or "rotary_emb.sin_cached" in name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF ``(name, full tensor)`` pairs in place; returns the names consumed.

        q/k/v go into ``qkv_proj``, gate/up into ``gate_up_proj``; rotary ``inv_freq`` buffers
        are skipped (not reported); with tied embeddings ``lm_head.weight`` is accepted and
        ignored (the embedding is the head).

        Raises:
            KeyError: unknown name. ValueError: wrong shape (that tensor is not copied).
        """
        ignore = {"lm_head.weight"} if self.tie_word_embeddings else set()
        return load_mapped_weights(self, weights, self.stacked_params_mapping, skip=self._skip, ignore=ignore)

    def checkpoint_spec(self) -> dict[str, tuple[int, ...]]:
        """``{hf_name: full shape}`` of every tensor :meth:`load_weights` accepts."""
        spec = mapped_checkpoint_spec(self, self.stacked_params_mapping)
        if self.tie_word_embeddings:
            spec["lm_head.weight"] = spec["model.embed_tokens.weight"]
        return spec

    def tied_checkpoint_names(self) -> dict[str, str]:
        """``{name: the name it is tied to}`` for every tensor this model serves as another one
        (``tie_word_embeddings``: ``lm_head.weight`` is ``model.embed_tokens.weight``); empty when nothing
        is tied. A weight update that carries a tied name is refused (it would be ignored, and the
        server would serve the other tensor in its place), see
        :func:`rlserve.transfer.wire.protocol.validate_against_spec`."""
        return {"lm_head.weight": "model.embed_tokens.weight"} if self.tie_word_embeddings else {}

    def required_checkpoint_names(self) -> set[str]:
        """Names a full checkpoint / full weight update must contain (``lm_head.weight`` is
        optional when embeddings are tied)."""
        names = set(self.checkpoint_spec())
        if self.tie_word_embeddings:
            names.discard("lm_head.weight")
        return names


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: the Llama architecture (sliding window not implemented, see a warning)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5: Llama with q/k/v biases (selected by ``model_type == "qwen2"``)."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with per-head q/k RMSNorm (selected by ``model_type == "qwen3"``)."""
