"""Tiny random-init Hugging Face checkpoints of every supported architecture, offline.

``make_tiny_model(arch, path)`` writes a float32 ``save_pretrained`` directory
(``config.json``, ``model.safetensors``, ``generation_config.json``) plus a byte-level BPE
tokenizer (``tokenizer.json``, ``tokenizer_config.json`` with a chat template) into
``path`` and returns ``str(path)``. Everything is deterministic for a given
``(arch, seed, overrides)``; a directory already holding the same build is reused, and a
build made earlier in this process at another path is copied instead of rebuilt.

Usage in tests::

    from tests.tiny_models import ARCHS, make_tiny_model
    path = make_tiny_model("llama", tmp_path_factory.mktemp("llama"))
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

# Every architecture variant this module can build.
ARCHS = ["llama", "llama_tied", "qwen2", "qwen3", "mistral", "opt", "opt_proj", "smollm"]
# Mixture-of-experts variants (tests/test_moe*.py; not in ARCHS: their checkpoints name experts
# per expert while the HF modules hold them fused, which ARCHS' generic tests do not expect).
# 8 experts, top-2, moe_intermediate_size 32; qwen3_moe renormalizes the top-k (norm_topk_prob),
# qwen2_moe does not and adds a shared expert of 48.
MOE_ARCHS = ["qwen3_moe", "qwen2_moe"]

# Special tokens: ids 0, 1, 2 of every tiny tokenizer.
BOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
BOS_ID, IM_START_ID, EOS_ID = 0, 1, 2

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_TRAIN_TEXT = (
    "The capital of France is Paris. The capital of Germany is Berlin. "
    "Hello world! Hello there, how are you today? I am fine, thank you. "
    "Reinforcement learning from human feedback trains a policy with rollouts. "
    "The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { } "
    "def main():\n    print('hello')\n    return 0\n"
    "Once upon a time there was a tiny model that generated tiny stories. "
)

_BUILT: dict[str, Path] = {}  # key -> a directory built in this process
_TOKENIZER_CACHE: list = []


def build_tokenizer():
    """A deterministic byte-level BPE tokenizer (~330 tokens) wrapped in
    ``PreTrainedTokenizerFast`` with bos ``<|endoftext|>`` (id 0), eos ``<|im_end|>``
    (id 2), pad = bos, and a ChatML chat template. Built in memory, no network."""
    if _TOKENIZER_CACHE:
        return _TOKENIZER_CACHE[0]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=336,
        special_tokens=[BOS_TOKEN, IM_START, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TRAIN_TEXT] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=BOS_TOKEN,
        unk_token=None,
        model_max_length=256,
    )
    fast.chat_template = CHAT_TEMPLATE
    assert fast.convert_tokens_to_ids(EOS_TOKEN) == EOS_ID and fast.convert_tokens_to_ids(BOS_TOKEN) == BOS_ID
    _TOKENIZER_CACHE.append(fast)
    return fast


def _config(arch: str, vocab: int, overrides: dict):
    from transformers import LlamaConfig, MistralConfig, OPTConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config, \
        Qwen3MoeConfig

    ids = dict(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=BOS_ID)
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        **ids,
    )
    if arch == "llama":
        cls, kw = LlamaConfig, dict(common, architectures=["LlamaForCausalLM"])
    elif arch == "llama_tied":
        cls, kw = LlamaConfig, dict(common, tie_word_embeddings=True, architectures=["LlamaForCausalLM"])
    elif arch == "smollm":
        # SmolLM2 shape: 3 KV heads (GQA 2:1), tied embeddings, head_dim 16.
        kw = dict(common, hidden_size=96, num_attention_heads=6, num_key_value_heads=3, tie_word_embeddings=True)
        cls, kw = LlamaConfig, dict(kw, architectures=["LlamaForCausalLM"])
    elif arch == "qwen2":
        cls, kw = Qwen2Config, dict(common, use_sliding_window=False, architectures=["Qwen2ForCausalLM"])
    elif arch == "qwen3":
        cls, kw = Qwen3Config, dict(common, head_dim=16, use_sliding_window=False, architectures=["Qwen3ForCausalLM"])
    elif arch == "mistral":
        cls, kw = MistralConfig, dict(common, head_dim=16, sliding_window=None, architectures=["MistralForCausalLM"])
    elif arch == "qwen3_moe":
        cls, kw = Qwen3MoeConfig, dict(common, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                       moe_intermediate_size=32, norm_topk_prob=True, use_sliding_window=False,
                                       architectures=["Qwen3MoeForCausalLM"])
    elif arch == "qwen2_moe":
        cls, kw = Qwen2MoeConfig, dict(common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                       shared_expert_intermediate_size=48, norm_topk_prob=False,
                                       use_sliding_window=False, architectures=["Qwen2MoeForCausalLM"])
    elif arch in ("opt", "opt_proj"):
        kw = dict(
            vocab_size=vocab,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
            word_embed_proj_dim=64,
            do_layer_norm_before=True,
            dropout=0.0,
            architectures=["OPTForCausalLM"],
            **ids,
        )
        if arch == "opt_proj":  # opt-350m shape: project_in/out and post-LayerNorm
            kw.update(word_embed_proj_dim=32, do_layer_norm_before=False)
        cls = OPTConfig
    else:
        raise ValueError(f"unknown tiny arch {arch!r}; known: {ARCHS + MOE_ARCHS}")
    kw.update(overrides)
    return cls(**kw)


def _key(arch: str, seed: int, overrides: dict) -> str:
    return json.dumps({"arch": arch, "seed": seed, "overrides": overrides}, sort_keys=True, default=repr)


def make_tiny_model(arch: str, path, seed: int = 0, **overrides) -> str:
    """Build (or reuse) a tiny random-init HF checkpoint + tokenizer in ``path``.

    Args:
        arch: one of :data:`ARCHS` or :data:`MOE_ARCHS`.
        path: target directory (created if missing).
        seed: torch seed for the random init (the global RNG state is restored after).
        **overrides: config fields to override, e.g. ``num_hidden_layers=1`` or
            ``rope_parameters={"rope_type": "llama3", ...}``.

    Returns:
        ``str(path)``.

    Raises:
        ValueError: for an unknown ``arch``.
    """
    from transformers import AutoModelForCausalLM

    if arch not in ARCHS + MOE_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; known: {ARCHS + MOE_ARCHS}")
    path = Path(path)
    key = _key(arch, seed, overrides)
    marker = path / ".tiny_model_key"
    if marker.exists() and marker.read_text() == key:
        return str(path)
    src = _BUILT.get(key)
    if src is not None and (src / ".tiny_model_key").exists() and src.resolve() != path.resolve():
        shutil.copytree(src, path, dirs_exist_ok=True)
        return str(path)

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    config = _config(arch, len(tok), overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    marker.write_text(key)
    _BUILT[key] = path
    return str(path)


if __name__ == "__main__":  # quick manual check: python -m tests.tiny_models /tmp/tiny
    import sys

    root = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/rlserve_tiny")
    for a in ARCHS:
        print(a, make_tiny_model(a, root / a), sorted(os.listdir(root / a)))
