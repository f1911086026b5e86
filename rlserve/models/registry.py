"""Map a Hugging Face config's ``architectures`` onto rlserve's model classes."""

from __future__ import annotations

import importlib

from rlserve.errors import UnsupportedArchitectureError

# HF architecture name -> (module, class). Imported lazily.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("rlserve.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("rlserve.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("rlserve.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("rlserve.models.llama", "Qwen3ForCausalLM"),
    "OPTForCausalLM": ("rlserve.models.opt", "OPTForCausalLM"),
    "Qwen2MoeForCausalLM": ("rlserve.models.qwen_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("rlserve.models.qwen_moe", "Qwen3MoeForCausalLM"),
}


def supported_architectures() -> list[str]:
    """The HF ``architectures`` names rlserve can serve."""
    return sorted(_MODELS)


def get_model_class(hf_config) -> type:
    """The model class for ``hf_config.architectures`` (the first supported entry).

    Raises:
        UnsupportedArchitectureError: none of the listed architectures is supported (the
            message lists the supported ones).
    """
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in _MODELS:
            module, cls = _MODELS[arch]
            return getattr(importlib.import_module(module), cls)
    raise UnsupportedArchitectureError(
        f"model architecture {archs or '(none)'} (model_type={getattr(hf_config, 'model_type', None)!r}) is not "
        f"supported; supported architectures: {', '.join(supported_architectures())}"
    )
