"""Build a model on its device and dtype and fill it: real checkpoint weights or dummy ones."""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from rlserve.loader.checkpoint import iterate_checkpoint
from rlserve.loader.weight_utils import expand_expert_names

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Temporarily ``torch.set_default_dtype(dtype)``."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(hf_config, device: torch.device | str, dtype: torch.dtype, quant_config=None) -> nn.Module:
    """Instantiate the registry's class for ``hf_config`` directly on ``device`` in ``dtype``
    (parameters uninitialized except norms / embeddings), in eval mode, no grads.

    Raises:
        UnsupportedArchitectureError: unknown architecture.
    """
    from rlserve.models.registry import get_model_class

    cls = get_model_class(hf_config)
    with torch.device(device), default_dtype(dtype):
        model = cls(hf_config, quant_config=quant_config)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int = 0, low: float = -1e-3, high: float = 1e-3) -> None:
    """Random weights of the right shapes, like vLLM's ``--load-format dummy``: every
    parameter ~ U(low, high) from a generator seeded with ``seed`` (in ``named_parameters``
    order, so the result is reproducible), except norm weights = 1 and norm biases = 0."""
    from rlserve.layers.norm import RMSNorm

    norm_params = set()
    for module in model.modules():
        if isinstance(module, (RMSNorm, nn.LayerNorm)):
            if getattr(module, "weight", None) is not None:
                module.weight.data.fill_(1.0)
                norm_params.add(id(module.weight))
            if getattr(module, "bias", None) is not None:
                module.bias.data.zero_()
                norm_params.add(id(module.bias))
    generators: dict[torch.device, torch.Generator] = {}
    for _, param in model.named_parameters():
        if id(param) in norm_params or not torch.is_floating_point(param):
            continue
        if getattr(param, "not_in_checkpoint", False):  # derived (fp8 scales): set by its weight's loader
            continue
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        if param.element_size() < 2:  # fp8 and friends: draw in float16, then cast
            tmp = torch.empty(param.shape, dtype=torch.float16, device=param.device).uniform_(low, high, generator=gen)
            dummy_loader = getattr(param, "dummy_weight_loader", None)  # fp8: quantize, set scales
            if dummy_loader is not None:
                dummy_loader(tmp)
            else:
                param.data.copy_(tmp)
        else:
            param.data.uniform_(low, high, generator=gen)


def process_weights_after_loading(model: nn.Module) -> None:
    """Run every layer's ``quant_method.process_weights_after_loading`` (after the initial load;
    a weight sync must call it again after each update). The layers whose method overrides the
    base class's no-op are found once per model and kept (a weight sync of an unquantized 8B
    model otherwise walked ~600 modules for nothing)."""
    from rlserve.layers.linear import LinearMethodBase

    layers = getattr(model, "_rlserve_post_load_layers", None)
    if layers is None:
        base = LinearMethodBase.process_weights_after_loading
        layers = [m for m in model.modules() if getattr(m, "quant_method", None) is not None
                  and getattr(type(m.quant_method), "process_weights_after_loading", base) is not base]
        model._rlserve_post_load_layers = layers
    for module in layers:
        module.quant_method.process_weights_after_loading(module)


def process_worker_weights(worker) -> None:
    """:func:`process_weights_after_loading` of ``worker.model`` (an rpc target: runs inside
    the worker's TP context)."""
    process_weights_after_loading(worker.model)


def load_model(config, hf_config, device: torch.device | str, dtype: torch.dtype, quant_config=None) -> nn.Module:
    """Build the model for ``hf_config`` on ``device`` in ``dtype`` and load its weights.

    Args:
        config: :class:`rlserve.config.EngineConfig` (``model`` = checkpoint directory,
            ``load_format``, ``seed``).
        hf_config: the Hugging Face config.
        device / dtype: where and in which dtype the parameters live.
        quant_config: optional quantization config passed to the model (default: from
            ``config.quantization``, e.g. :class:`rlserve.layers.fp8.Fp8Config` for "fp8").

    Returns:
        The model in eval mode. With ``load_format="dummy"`` its weights are random
        (:func:`initialize_dummy_weights`, seeded by ``config.seed``); otherwise they come from
        the checkpoint through ``model.load_weights``.

    Raises:
        UnsupportedArchitectureError: unknown architecture.
        FileNotFoundError: no checkpoint files.
        KeyError / ValueError: a checkpoint tensor the model does not know / of the wrong shape.
        ValueError: the checkpoint lacks required tensors (all missing names are listed); a
            ``max_model_len`` past a learned position table (:func:`rlserve.layers.rotary.cover_positions`:
            RoPE tables grow to ``max_model_len`` instead).
        InvalidRequestError: ``max_model_len`` past the model's without ``VLLM_ALLOW_LONG_MAX_MODEL_LEN``
            (:func:`rlserve.model_len.verify_max_model_len`).
    """
    from rlserve.layers.rotary import cover_positions
    from rlserve.model_len import verify_max_model_len

    if quant_config is None and getattr(config, "quantization", None):
        from rlserve.layers.fp8 import get_quant_config

        quant_config = get_quant_config(config.quantization)
    model = build_model(hf_config, device, dtype, quant_config)
    cover_positions(model, verify_max_model_len(getattr(config, "max_model_len", None), hf_config, warn=False))
    fill_weights(model, config)
    return model


def fill_weights(model: nn.Module, config) -> None:
    """Write the weights ``config`` names into ``model``'s existing parameters, in place: the
    checkpoint at ``config.model`` (``config.load_format``) through ``model.load_weights``, or
    the seeded dummy weights; then ``process_weights_after_loading``. The initial load, and the
    reload after a level-2 sleep that no weight sync refilled.

    Raises:
        FileNotFoundError, KeyError, ValueError: as :func:`load_model`.
    """
    if config.load_format == "dummy":
        initialize_dummy_weights(model, seed=config.seed)
    else:
        loaded = model.load_weights(iterate_checkpoint(config.model, config.load_format))
        normalize = getattr(model, "normalize_checkpoint_name", lambda n: n)
        loaded = expand_expert_names({normalize(n) for n in loaded}, model.checkpoint_spec())  # MoE: fused names
        missing = sorted(model.required_checkpoint_names() - loaded)
        if missing:
            raise ValueError(f"checkpoint {config.model!r} is missing {len(missing)} required tensor(s): "
                             + ", ".join(missing))
        logger.info("loaded %d tensors from %s", len(loaded), config.model)
    process_weights_after_loading(model)
