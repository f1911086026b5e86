"""LoRA adapters served per request (vLLM's ``--enable-lora``): :mod:`~rlserve.lora.adapter` reads
a PEFT adapter directory, :mod:`~rlserve.lora.layers` is the per-row math (CPU grouping; the seam
for a batched GPU kernel), :mod:`~rlserve.lora.model` holds one replica's adapters and hooks its
linears, :mod:`~rlserve.lora.engine_ops` is what the routes run on every replica, and
:mod:`~rlserve.lora.registry` is the API server's table of adapter names."""


#: the model's attribute holding its :class:`~rlserve.lora.model.LoRAModel` (set with ``--enable-lora``)
ATTR = "rlserve_lora"


def lora_of(model):
    """The model's :class:`~rlserve.lora.model.LoRAModel`, or None without ``--enable-lora``. Here, not in
    :mod:`rlserve.lora.model`, so that the worker and the model runner, which ask it every step, do not import
    the adapter code (:mod:`~rlserve.lora.adapter`, ``layers``, ``merge``, ``slots``) in a start without LoRA
    (issue 37: the engine-core process's start-up imports)."""
    return getattr(model, ATTR, None)


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
