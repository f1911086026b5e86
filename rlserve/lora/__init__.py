"""LoRA adapters served per request (vLLM's ``--enable-lora``): :mod:`~rlserve.lora.adapter` reads
a PEFT adapter directory, :mod:`~rlserve.lora.layers` is the per-row math (CPU grouping; the seam
for a batched GPU kernel), :mod:`~rlserve.lora.model` holds one replica's adapters and hooks its
linears, :mod:`~rlserve.lora.engine_ops` is what the routes run on every replica, and
:mod:`~rlserve.lora.registry` is the API server's table of adapter names."""


def require_peft(setting: str) -> None:
    """Check, at start-up, that PEFT (which :mod:`rlserve.lora.adapter` reads an adapter's config
    with) is installed: ``rlserve serve --enable-lora`` and ``LLM(..., enable_lora=True)`` call it
    before any engine starts (without it every adapter load failed later, ModuleNotFoundError).

    Raises:
        rlserve.errors.MissingExtraError: (an ImportError) ``SETTING needs the peft package: pip
            install 'rlserve[lora]'``."""
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        from rlserve.errors import MissingExtraError

        raise MissingExtraError(f"{setting} needs the peft package: pip install 'rlserve[lora]'")
