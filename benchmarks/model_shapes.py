"""Model shapes for benchmarks: Hugging Face configs of real models, built offline and
saved (config.json only) so rlserve can serve them with ``load_format="dummy"`` and HF can
build them with random weights. Numbers are the published configs of each model."""

from __future__ import annotations

import os
import re

from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

SHAPES = {
    # not a real model: a 2-layer Llama for checking benchmark scripts on a CPU in seconds
    "tiny-llama": lambda: LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=0, eos_token_id=2, architectures=["LlamaForCausalLM"],
    ),
    # not a real model: a small Qwen3-MoE (32 experts, top-4) for CPU runs of the MoE path
    "small-qwen3-moe": lambda: Qwen3MoeConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=32, num_experts_per_tok=4,
        norm_topk_prob=True, max_position_embeddings=4096, bos_token_id=0, eos_token_id=2,
        architectures=["Qwen3MoeForCausalLM"],
    ),
    # Qwen/Qwen3-30B-A3B (48 layers, 128 experts, top-8)
    "qwen3-30b-a3b": lambda: Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
        bos_token_id=151643, eos_token_id=151645, architectures=["Qwen3MoeForCausalLM"],
    ),
    # HuggingFaceTB/SmolLM2-135M-Instruct
    "smollm2-135m": lambda: LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, architectures=["LlamaForCausalLM"],
    ),
    # Qwen/Qwen3-0.6B
    "qwen3-0.6b": lambda: Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
        bos_token_id=151643, eos_token_id=151645, architectures=["Qwen3ForCausalLM"],
    ),
    # Qwen/Qwen3-1.7B
    "qwen3-1.7b": lambda: Qwen3Config(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
        bos_token_id=151643, eos_token_id=151645, architectures=["Qwen3ForCausalLM"],
    ),
    # Qwen/Qwen3-8B
    "qwen3-8b": lambda: Qwen3Config(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
        bos_token_id=151643, eos_token_id=151645, architectures=["Qwen3ForCausalLM"],
    ),
}



def _first_layers(cfg, n: int):
    cfg.num_hidden_layers = n
    return cfg


# Qwen3-30B-A3B's first 24 of its 48 layers (30.5 GB in bf16 instead of 61: one H100 holds it and
# a KV cache); per-layer times are the full model's
SHAPES["qwen3-30b-a3b-24l"] = lambda: _first_layers(SHAPES["qwen3-30b-a3b"](), 24)


def _cut(name: str):
    """``qwen3-30b-a3b-<N>l``: the model's first N (1..48) layers, any N (the device scripts
    size the shape to the GPU); None for other names."""
    m = re.fullmatch(r"qwen3-30b-a3b-(\d+)l", name)
    if m is None or not 1 <= int(m.group(1)) <= 48:
        return None
    return lambda: _first_layers(SHAPES["qwen3-30b-a3b"](), int(m.group(1)))


def shape_config(name: str):
    """The ``transformers`` config of a named shape (or ``qwen3-30b-a3b-<N>l``, N in 1..48).

    Raises:
        KeyError: unknown shape (the message lists the known ones).
    """
    build = SHAPES.get(name) or _cut(name)
    if build is None:
        raise KeyError(f"unknown shape {name!r}; known: {sorted(SHAPES)} and qwen3-30b-a3b-<N>l (N in 1..48)")
    return build()


def save_shape(name: str, root: str) -> str:
    """Write ``root/name/config.json`` (no weights, no tokenizer) and return the directory."""
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    shape_config(name).save_pretrained(path)
    return path


def num_params(name: str) -> int:
    """Parameter count of a shape (from a meta-device build; nothing is allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(shape_config(name))
    return sum(p.numel() for p in m.parameters())
