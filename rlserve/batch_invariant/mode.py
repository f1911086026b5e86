"""The process-wide batch-invariant switch (``--batch-invariant``, ``VLLM_BATCH_INVARIANT=1``).

The layers read :func:`enabled` at each call (one list read); the model runner sets it from
its config before every forward step (:func:`from_config`), so two engines of one process with
different settings each run their own mode. Nothing here imports the layers: they import this.
"""

from __future__ import annotations

from rlserve import envs

_ON = [False]


def enabled() -> bool:
    """Whether the batch-invariant kernels run in this process now."""
    return _ON[0]


def set_enabled(on: bool) -> bool:
    """Switch the mode for this process; returns the previous setting."""
    prev = _ON[0]
    _ON[0] = bool(on)
    return prev


def from_config(config) -> bool:
    """The mode an engine with ``config`` runs: ``config.batch_invariant`` (``--batch-invariant``,
    ``LLM(batch_invariant=True)``), or the environment variable ``VLLM_BATCH_INVARIANT=1`` (vLLM's
    switch, read through :mod:`rlserve.envs`). ``config`` may be ``None`` (the variable decides)."""
    return bool(getattr(config, "batch_invariant", False)) or bool(envs.VLLM_BATCH_INVARIANT)


def check_config_supported(config, hf_config=None) -> None:
    """Raise ``ValueError`` naming what an engine with ``config`` (and the model's Hugging Face
    config ``hf_config``) runs that the mode does not cover: fp8 quantization, an fp8 KV cache
    (``--kv-cache-dtype``), LoRA adapters,
    tensor parallelism > 1 (the all-reduce's summation order follows the message size, hence the
    batch), mixture-of-experts layers (``num_experts`` in the model config). Their GEMMs and
    reductions do not go through the batch-invariant forms, so the mode would not hold."""
    bad = []
    if getattr(config, "quantization", None):
        bad.append(f"--quantization {config.quantization}")
    kv = getattr(config, "kv_cache_dtype", None)
    if kv not in (None, "auto"):  # the batch-invariant prefill kernel reads a cache of the model dtype
        bad.append(f"--kv-cache-dtype {kv}")
    if getattr(config, "enable_lora", False):
        bad.append("--enable-lora")
    if getattr(config, "tensor_parallel_size", 1) > 1:
        bad.append(f"--tensor-parallel-size {config.tensor_parallel_size}")
    if getattr(hf_config, "num_experts", None) or getattr(hf_config, "n_routed_experts", None):
        bad.append("a mixture-of-experts model")
    if bad:
        raise ValueError("--batch-invariant does not cover " + ", ".join(bad) + " yet (docs/batch_invariant.md)")


class active:
    """``with active(on): ...`` runs the block in mode ``on`` and restores the previous one."""

    def __init__(self, on: bool):
        self.on = bool(on)

    def __enter__(self):
        self.prev = set_enabled(self.on)
        return self

    def __exit__(self, *exc):
        set_enabled(self.prev)
        return False
