"""What an :class:`~rlserve.engine.core.llm_engine.LLMEngine` decides once, at construction: its
end-of-sequence token ids (as Hugging Face ``generate`` picks them) and whether it overlaps decode
steps (``EngineConfig.async_scheduling``)."""

from __future__ import annotations


import torch
from transformers import GenerationConfig

from rlserve import envs
from rlserve.config import EngineConfig


def eos_token_ids(model_path: str, get_tokenizer, hf_config) -> set[int]:
    """EOS ids as Hugging Face ``generate`` uses them: generation_config.eos_token_id
    (int or list), else config.eos_token_id, else the tokenizer's eos. ``get_tokenizer``: ``() ->
    tokenizer or None``, called only when neither config names an EOS id (the engine-core process
    loads its tokenizer after ready, :mod:`rlserve.engine.core.core_tokenizer`)."""
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
    tokenizer = None if ids else get_tokenizer()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
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


def start_sampler_precompile(config: EngineConfig):
    """A cold start's compilation of the one-pass sampler's Triton kernels
    (:func:`rlserve.engine.core.fused_sampling.warm_up`), started in child processes
    (:func:`rlserve.engine.worker.triton_precompile.precompile`, ``wait=False``) *before* the model is
    built, so that it runs beside the weights' load, the KV cache sizing and the model's own warm-up
    instead of from the KV cache sizing on: its 4 kernels took 6.3 s on an empty Triton cache (H100,
    session 16), longer than the model's warm-up beside them. Needs only the model's Hugging Face config
    (vocabulary size, dtype) and the device: one GPU (TP = 1), ``RLSERVE_TRITON_PRECOMPILE`` on, and
    ``RLSERVE_GPU_START_OVERLAP=1`` (off by default until measured on a GPU).

    Returns:
        the running ``Compiling`` (``kill()`` it if the start fails), or None: not that case, nothing
        to compile, or anything failed here (logged at debug level: the engine then compiles them
        after the KV cache sizing, as before, and reports the real error itself).
    """
    if (config.tensor_parallel_size != 1 or not envs.RLSERVE_TRITON_PRECOMPILE
            or not envs.RLSERVE_GPU_START_OVERLAP):
        return None
    try:
        from transformers import AutoConfig

        from rlserve.config import resolve_device, resolve_dtype

        device = resolve_device(config.device)
        if device.type != "cuda":
            return None
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)  # (the worker sets the same device next)
        hf_config = AutoConfig.from_pretrained(config.model)
        dtype = resolve_dtype(config.dtype, device, hf_config)
        from rlserve.engine.core import fused_sampling
        from rlserve.engine.worker import triton_precompile

        dtypes = (torch.float32,) + ((dtype,) if dtype.is_floating_point else ())
        vocab = int(hf_config.vocab_size)
        return triton_precompile.precompile(lambda: fused_sampling.warm_up(device, vocab, dtypes), device,
                                            max_workers=4, wait=False)
    except Exception:  # noqa: BLE001 -- see Returns
        import logging

        logging.getLogger(__name__).debug("early sampler precompile not started", exc_info=True)
        return None
