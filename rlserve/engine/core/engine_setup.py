"""What an :class:`~rlserve.engine.core.llm_engine.LLMEngine` decides once, at construction: its
end-of-sequence token ids (as Hugging Face ``generate`` picks them) and whether it overlaps decode
steps (``EngineConfig.async_scheduling``)."""

from __future__ import annotations


import torch
from transformers import GenerationConfig

from rlserve import envs
from rlserve.config import EngineConfig


def eos_token_ids(model_path: str, tokenizer, hf_config) -> set[int]:
    """EOS ids as Hugging Face ``generate`` uses them: generation_config.eos_token_id
    (int or list), else config.eos_token_id, plus the tokenizer's eos."""
    ids: set[int] = set()
    try:
        gen = GenerationConfig.from_pretrained(model_path)
        e = gen.eos_token_id
    except (OSError, ValueError):
        e = None
    if e is None:
        e = getattr(hf_config, "eos_token_id", None)
    if isinstance(e, int):
        ids.add(e)
    elif e:
        ids.update(int(x) for x in e)
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def want_async_scheduling(config: EngineConfig, executor) -> bool:
    """Whether the engine overlaps decode steps (``EngineConfig.async_scheduling``):
    ``config.async_scheduling`` when set, else ``config.extra["async_scheduling"]`` when
    present, else ``RLSERVE_ASYNC_SCHEDULING=0/1`` when set, else on exactly when the
    executor runs on a CUDA device. Never for an executor that cannot take device-side input
    ids (``supports_device_input_ids``: the multi-process TP executor)."""
    if not getattr(executor, "supports_device_input_ids", False):
        return False
    if config.async_scheduling is not None:
        return bool(config.async_scheduling)
    extra = config.extra or {}
    if "async_scheduling" in extra:
        return bool(extra["async_scheduling"])
    if envs.RLSERVE_ASYNC_SCHEDULING is not None:
        return envs.RLSERVE_ASYNC_SCHEDULING
    return torch.device(executor.device).type == "cuda"
