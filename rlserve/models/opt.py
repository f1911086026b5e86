"""OPT decoder (facebook/opt-*) on rlserve layers.

Learned absolute positions (table offset 2), LayerNorm before (``do_layer_norm_before``) or
after each block, ReLU MLP (``fc1``/``fc2``), ``project_in``/``project_out`` when
``word_embed_proj_dim != hidden_size`` (opt-350m), LM head tied to the token embedding.
Parameter names equal the HF names (``model.decoder.*``) except the fused ``qkv_proj``;
checkpoints saved from a bare ``OPTModel`` (names ``decoder.*``) are accepted too.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from rlserve.distributed.head_partition import attention_head_partition_sizes
from rlserve.layers.activation import get_act_fn
from rlserve.layers.attention import Attention, AttentionMetadata
from rlserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from rlserve.layers.linear import ColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from rlserve.layers.norm import LayerNorm
from rlserve.loader.weight_utils import default_weight_loader, load_mapped_weights, mapped_checkpoint_spec, \
    set_weight_attrs

OPT_POSITION_OFFSET = 2


class OPTLearnedPositionalEmbedding(nn.Module):
    """Replicated table ``[max_position_embeddings + 2, hidden]``; position ``p`` reads row ``p + 2``."""

    def __init__(self, num_positions: int, embedding_dim: int):
        super().__init__()
        self.offset = OPT_POSITION_OFFSET
        self.weight = nn.Parameter(torch.empty(num_positions + self.offset, embedding_dim), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": default_weight_loader})

    @property
    def position_limit(self) -> int:
        """The positions the table holds (:func:`rlserve.layers.rotary.cover_positions` refuses more)."""
        return self.weight.shape[0] - self.offset

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """``positions [T] int64`` -> ``[T, hidden]``."""
        return nn.functional.embedding(positions + self.offset, self.weight)


class OPTAttention(nn.Module):
    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        self.head_dim = hidden // total_heads
        bias = bool(getattr(config, "enable_bias", True))
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, total_heads, total_heads, bias=bias,
                                          quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        q_split = [q * self.head_dim for q, _ in attention_head_partition_sizes(
            total_heads, total_heads, self.qkv_proj.tp_size)]  # rows follow this rank's heads
        self.out_proj = RowParallelLinear(hidden, hidden, bias=bias, quant_config=quant_config,
                                          prefix=f"{prefix}.out_proj", input_partition_sizes=q_split)
        self.num_heads = self.qkv_proj.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_heads)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size] * 3, dim=-1)
        return self.out_proj(self.attn(q, k, v, meta))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        hidden = config.hidden_size
        bias = bool(getattr(config, "enable_bias", True))
        affine = bool(getattr(config, "layer_norm_elementwise_affine", True))
        self.do_layer_norm_before = config.do_layer_norm_before
        self.self_attn = OPTAttention(config, quant_config, prefix=f"{prefix}.self_attn")
        self.self_attn_layer_norm = LayerNorm(hidden, elementwise_affine=affine)
        self.fc1 = ColumnParallelLinear(hidden, config.ffn_dim, bias=bias, quant_config=quant_config,
                                        prefix=f"{prefix}.fc1")
        self.fc2 = RowParallelLinear(config.ffn_dim, hidden, bias=bias, quant_config=quant_config,
                                     prefix=f"{prefix}.fc2")
        self.activation_fn = get_act_fn(config.activation_function)
        self.final_layer_norm = LayerNorm(hidden, elementwise_affine=affine)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        residual = hidden
        if self.do_layer_norm_before:
            hidden = self.self_attn_layer_norm(hidden)
        hidden = residual + self.self_attn(hidden, meta)
        if not self.do_layer_norm_before:
            hidden = self.self_attn_layer_norm(hidden)
        residual = hidden
        if self.do_layer_norm_before:
            hidden = self.final_layer_norm(hidden)
        hidden = residual + self.fc2(self.activation_fn(self.fc1(hidden)))
        if not self.do_layer_norm_before:
            hidden = self.final_layer_norm(hidden)
        return hidden


class OPTDecoder(nn.Module):
    def __init__(self, config, quant_config=None, prefix: str = "model.decoder"):
        super().__init__()
        hidden, proj = config.hidden_size, config.word_embed_proj_dim
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, proj, prefix=f"{prefix}.embed_tokens")
        self.embed_positions = OPTLearnedPositionalEmbedding(config.max_position_embeddings, hidden)
        if proj != hidden:
            self.project_in = ReplicatedLinear(proj, hidden, bias=False, prefix=f"{prefix}.project_in")
            self.project_out = ReplicatedLinear(hidden, proj, bias=False, prefix=f"{prefix}.project_out")
        else:
            self.project_in = None
            self.project_out = None
        if config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False):
            affine = bool(getattr(config, "layer_norm_elementwise_affine", True))
            self.final_layer_norm = LayerNorm(hidden, elementwise_affine=affine)
        else:
            self.final_layer_norm = None
        self.layers = nn.ModuleList(
            OPTDecoderLayer(config, quant_config, prefix=f"{prefix}.layers.{i}") for i in range(config.num_hidden_layers)
        )

    def forward(self, input_ids, positions, meta):
        hidden = self.embed_tokens(input_ids)
        if self.project_in is not None:
            hidden = self.project_in(hidden)
        hidden = hidden + self.embed_positions(positions)
        for layer in self.layers:
            hidden = layer(hidden, meta)
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return hidden


class OPTModel(nn.Module):
    def __init__(self, config, quant_config=None):
        super().__init__()
        self.decoder = OPTDecoder(config, quant_config, prefix="model.decoder")

    def forward(self, input_ids, positions, meta):
        return self.decoder(input_ids, positions, meta)


class OPTForCausalLM(nn.Module):
    """OPT causal LM following the model contract of ``docs/INTERFACES.md``.

    ``forward`` returns ``[T, word_embed_proj_dim]`` (the width the LM head consumes; equal to
    ``hidden_size`` except for project_out models such as opt-350m).

    Args:
        config: HF ``OPTConfig``.
        quant_config: optional quantization config for the linear layers.

    Raises:
        UnsupportedArchitectureError: unsupported activation. ValueError: heads that cannot be
            split over the TP size (see :func:`rlserve.distributed.head_partition.attention_head_partition`).
    """

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    stacked_params_mapping = [
        (".qkv_proj.", ".q_proj.", "q"),
        (".qkv_proj.", ".k_proj.", "k"),
        (".qkv_proj.", ".v_proj.", "v"),
    ]

    def __init__(self, config, quant_config=None):
        super().__init__()
        self.config = config
        self.quant_config = quant_config
        self.model = OPTModel(config, quant_config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head = self.model.decoder.embed_tokens
            self.lm_head.serve_as_lm_head()
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.word_embed_proj_dim, prefix="lm_head")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``input_ids [T] int64``, ``positions [T] int64`` (0-based) -> ``[T, word_embed_proj_dim]``."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """``hidden [N, word_embed_proj_dim]`` -> ``[N, vocab_size]`` float32 (``float32=False``:
        the model dtype) on every rank."""
        return self.lm_head.compute_logits(hidden, float32=float32)

    @staticmethod
    def normalize_checkpoint_name(name: str) -> str:
        """``decoder.*`` (a bare ``OPTModel`` checkpoint, e.g. facebook/opt-125m) -> ``model.decoder.*``."""
        return name if name.startswith(("model.", "lm_head.")) else f"model.{name}"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF ``(name, full tensor)`` pairs in place; returns the names consumed as given
        (``decoder.*`` or ``model.decoder.*``; see :meth:`normalize_checkpoint_name`).

        Raises:
            KeyError: unknown name. ValueError: wrong shape (that tensor is not copied).
        """
        ignore = {"lm_head.weight"} if self.tie_word_embeddings else set()
        return load_mapped_weights(self, weights, self.stacked_params_mapping, rename=self.normalize_checkpoint_name, ignore=ignore)

    def checkpoint_spec(self) -> dict[str, tuple[int, ...]]:
        """``{hf_name: full shape}`` of every tensor :meth:`load_weights` accepts."""
        spec = mapped_checkpoint_spec(self, self.stacked_params_mapping)
        if self.tie_word_embeddings:
            spec["lm_head.weight"] = spec["model.decoder.embed_tokens.weight"]
        return spec

    def tied_checkpoint_names(self) -> dict[str, str]:
        """``{name: the name it is tied to}`` for every tensor this model serves as another one
        (``tie_word_embeddings``: ``lm_head.weight`` is ``model.decoder.embed_tokens.weight``); empty when nothing
        is tied. A weight update that carries a tied name is refused (it would be ignored, and the
        server would serve the other tensor in its place), see
        :func:`rlserve.transfer.wire.protocol.validate_against_spec`."""
        return {"lm_head.weight": "model.decoder.embed_tokens.weight"} if self.tie_word_embeddings else {}

    def required_checkpoint_names(self) -> set[str]:
        """All of :meth:`checkpoint_spec` except a tied ``lm_head.weight``."""
        names = set(self.checkpoint_spec())
        if self.tie_word_embeddings:
            names.discard("lm_head.weight")
        return names
