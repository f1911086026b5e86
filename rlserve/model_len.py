"""A model's context length: the longest ``max_model_len`` its checkpoint's ``config.json`` allows,
derived as vLLM derives it, and the check of a requested one (vLLM's message, and its escape
``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``).

The rule is vLLM 0.32's ``_get_and_verify_max_len`` (``vllm/config/model.py``) with
``derive_max_model_len_and_key`` (``vllm/transformers_utils/model_arch_config_convertor.py``):

- the smallest of the length keys present (:data:`LENGTH_KEYS`: ``max_position_embeddings``,
  GPT-2's ``n_positions``, ...); a ``model_max_length`` key, where present, wins;
- times the RoPE scaling ``factor`` of a rope type that does not already count it in
  ``max_position_embeddings`` (``linear``, ``dynamic``; not ``llama3``, ``yarn``, ``longrope``, ...:
  :data:`PRESCALED_ROPE_TYPES`);
- a requested length above it is refused (vLLM's ``ValueError`` message, here
  :class:`~rlserve.errors.InvalidRequestError`) unless it is at most the config's own
  ``model_max_length`` or ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`` is set (then vLLM's warning). With the
  escape, the RoPE tables grow to ``max_model_len`` rows (:func:`rlserve.layers.rotary.cover_positions`:
  vLLM's table stops at ``max_position_embeddings`` and its kernels read past it, undefined); a
  learned position table (OPT) cannot grow, so the engine's start refuses such a length.
- the tokenizer's ``model_max_length`` (``tokenizer_config.json``) is not read: vLLM 0.32 reads it
  only for pooling models with absolute position embeddings (``ModelConfig.get_and_verify_max_len``),
  and rlserve serves generative models only.

Read from the JSON (``config.json``, no torch or transformers import) by ``rlserve serve`` before
any engine starts, and from the loaded HF config by the engine (the same function on either).
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

from rlserve import envs
from rlserve.errors import InvalidRequestError

logger = logging.getLogger(__name__)

#: the default ``max_model_len`` at most, when none is given (the derived length above it is cut)
MAX_DEFAULT_MODEL_LEN = 8192

#: ``max_model_len`` -1 (``--max-model-len -1`` / ``auto``): vLLM's auto-fit, the derived length cut to the KV cache
AUTO_MAX_MODEL_LEN = -1

#: vLLM's keys of a model's length, in its order (the smallest present counts)
LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
               "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")

#: rope types whose ``factor`` is already in ``max_position_embeddings`` (vLLM's list)
PRESCALED_ROPE_TYPES = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")

_WARNING = ("VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used with extreme caution. If the model uses relative position "
            "encoding (RoPE), positions exceeding derived_max_model_len lead to nan. If the model uses absolute "
            "position encoding, positions exceeding derived_max_model_len will cause a CUDA array out-of-bounds "
            "error.")


def _getter(hf):
    """``get(key)`` of a ``config.json`` dict or a HF config object (its text config where it nests one)."""
    text = hf.get("text_config") if isinstance(hf, dict) else getattr(hf, "text_config", None)
    if text is not None and text is not hf:
        hf = text
    if isinstance(hf, dict):
        return hf.get
    return lambda key: getattr(hf, key, None)


def _rope_factor(get) -> float:
    """The scaling factor of the config's RoPE settings (1.0 without one or for a prescaled type)."""
    params: list[dict[str, Any]] = []
    rp = get("rope_parameters")
    if isinstance(rp, dict) and rp:
        nested = [v for v in rp.values() if isinstance(v, dict)]  # per layer type: {"full_attention": {...}}
        params += nested if nested and len(nested) == len(rp) else [rp]
    scaling = get("rope_scaling")
    if isinstance(scaling, dict) and scaling and not params:
        params.append(scaling)
    if not params or "gemma3" in str(get("model_type") or ""):  # (vLLM: Gemma3's length is scaled already)
        return 1.0
    factor = 1.0
    for p in params:
        if (p.get("rope_type") or p.get("type") or "default") not in PRESCALED_ROPE_TYPES:
            factor = p.get("factor", factor)
    return 1.0 if factor is None else float(factor)


def derived_max_model_len(hf) -> tuple[float, str | None]:
    """``(length, key)``: the longest context ``hf`` (a ``config.json`` dict or a HF config object)
    allows, and the key it came from; ``(inf, None)`` when it has none of :data:`LENGTH_KEYS`."""
    get = _getter(hf)
    length, key = math.inf, None
    for k in LENGTH_KEYS:
        v = get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if v < length:
                key = k
            length = min(length, v)
    if isinstance(get("model_max_length"), (int, float)) and get("model_max_length"):  # (vLLM: Command-R)
        length, key = get("model_max_length"), "model_max_length"
    if length != math.inf:
        length *= _rope_factor(get)
    return length, key


def verify_max_model_len(max_model_len: int | None, hf, warn: bool = True) -> int:
    """The ``max_model_len`` to run with: ``None`` gives the derived length (:func:`derived_max_model_len`)
    at most :data:`MAX_DEFAULT_MODEL_LEN`, -1 (:data:`AUTO_MAX_MODEL_LEN`) the derived length itself (the
    engine cuts it to its KV cache); a given one is checked against it.

    ``warn``: log vLLM's warning when the escape lets a longer length through (False: a second
    reading of the same settings, the model loader's).

    Raises:
        InvalidRequestError: below 1, or above the derived length (vLLM's message, one line) while
            ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` is not set."""
    derived, key = derived_max_model_len(hf)
    if max_model_len is None:
        return int(min(derived, MAX_DEFAULT_MODEL_LEN))
    if max_model_len == AUTO_MAX_MODEL_LEN:  # vLLM's -1: the derived length, which the engine then fits to its
        return int(derived)                  # KV cache (rlserve.kv_size.fit_max_model_len)
    if max_model_len < 1:
        raise InvalidRequestError(f"max_model_len must be >= 1, got {max_model_len}")
    if max_model_len > derived:
        get = _getter(hf)
        model_max_length = get("model_max_length")
        if model_max_length is None or max_model_len > model_max_length:
            shown = int(derived) if float(derived).is_integer() else derived
            msg = (f"User-specified max_model_len ({max_model_len}) is greater than the derived max_model_len "
                   f"({key}={shown} or model_max_length={model_max_length} in model's config.json).")
            if envs.VLLM_ALLOW_LONG_MAX_MODEL_LEN:
                if warn:  # (warn=False: a second reading of the same settings, the model loader's)
                    logger.warning("%s %s", msg, _WARNING)
            else:
                raise InvalidRequestError(f"{msg} To allow overriding this maximum, set the env var "
                                          f"VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. {_WARNING}")
    return int(max_model_len)


def check_checkpoint_max_model_len(max_model_len: int | None, model_dir: str) -> int | None:
    """:func:`verify_max_model_len` on ``model_dir/config.json`` (``rlserve serve``'s check before any
    engine starts): the ``max_model_len`` the engine will run with (None given: the default); None
    when the directory has no readable ``config.json`` (the engine's load says why).

    Raises:
        InvalidRequestError: as :func:`verify_max_model_len`."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    return verify_max_model_len(max_model_len, cfg) if isinstance(cfg, dict) else None
