"""``GET /server_info``: rlserve's own flat fields plus ``vllm_config``, the subset of vLLM's
resolved ``VllmConfig`` tree (``vllm/entrypoints/serve/dev/server_info``) that clients read:
TRL's ``VLLMClient.get_server_info()`` returns ``vllm_config`` and reads
``weight_transfer_config`` (None = no weight sync) and ``model_config.logprobs_mode`` (GRPO's
importance-sampling check); TRL's async trainers read ``lora_config`` and
``parallel_config.data_parallel_size``. Field names and value sets are vLLM's; values are
rlserve's (e.g. ``cache_config.cache_dtype`` is ``--kv-cache-dtype`` as given: "auto" or an fp8
name).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import weakref

import rlserve
from rlserve.server.state import ServerState


def _world_size(state: ServerState) -> int:
    cfg = state.aengine.config
    return int(cfg.tensor_parallel_size) * int(cfg.data_parallel_size)


def _dtype_name(state: ServerState) -> str:
    dt = getattr(state.aengine.engine, "dtype", None)
    return str(dt).replace("torch.", "") if dt is not None else str(state.aengine.config.dtype)


def _torch_dtype_name(state: ServerState) -> str:
    """The dtype as vLLM's ``/server_info`` prints its ``torch.dtype`` (``str()``: ``torch.float32``)."""
    return f"torch.{_dtype_name(state)}"


def _lora_config(state: ServerState) -> dict | None:
    """vLLM's ``lora_config`` (None without ``--enable-lora``: TRL's capability probe, which reads
    ``max_lora_rank`` and ``max_loras``). ``max_cpu_loras`` equals ``max_loras``: every loaded
    adapter can be in every batch."""
    cfg = state.aengine.config
    if not getattr(cfg, "enable_lora", False):
        return None
    return {"max_lora_rank": cfg.max_lora_rank, "max_loras": cfg.max_loras, "max_cpu_loras": cfg.max_loras,
            "fully_sharded_loras": False, "lora_dtype": _dtype_name(state), "target_modules": None}


def vllm_config(state: ServerState) -> dict:
    """The ``vllm_config`` object (JSON-ready)."""
    cfg = state.aengine.config
    eng = state.aengine.engine
    return {
        "model_config": {
            "model": state.settings.model,
            "tokenizer": cfg.tokenizer or cfg.model,
            "served_model_name": state.model_name,
            "dtype": _torch_dtype_name(state),
            "max_model_len": state.max_model_len,
            "max_logprobs": state.max_logprobs,
            "logprobs_mode": getattr(cfg, "logprobs_mode", "raw_logprobs"),
            "seed": cfg.seed,
            "quantization": cfg.quantization,
            "enforce_eager": cfg.enforce_eager,
            "skip_tokenizer_init": cfg.skip_tokenizer_init,
            "enable_sleep_mode": bool(getattr(cfg, "enable_sleep_mode", False)),
            "trust_remote_code": False,
            "revision": None,
            "runner_type": "generate",
            "model_impl": state.settings.model_impl,
            "vocab_size": state.vocab_size,
            "tokenizer_mode": "auto",
            "generation_config": state.settings.generation_config,
            "override_generation_config": {},
        },
        "cache_config": {
            "block_size": cfg.block_size,
            "gpu_memory_utilization": cfg.gpu_memory_utilization,
            "cache_dtype": getattr(cfg, "kv_cache_dtype", "auto"),
            "calculate_kv_scales": bool(getattr(cfg, "calculate_kv_scales", False)),
            "enable_prefix_caching": cfg.enable_prefix_caching,
        },
        "parallel_config": {
            "tensor_parallel_size": cfg.tensor_parallel_size,
            "data_parallel_size": cfg.data_parallel_size,
            "pipeline_parallel_size": 1,
            "world_size": _world_size(state),
            "distributed_executor_backend": "mp" if _world_size(state) > 1 else "uni",
        },
        "scheduler_config": {
            "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "max_model_len": state.max_model_len,
            "enable_chunked_prefill": bool(getattr(cfg, "enable_chunked_prefill", False)),
            "long_prefill_token_threshold": int(getattr(cfg, "long_prefill_token_threshold", 0)),
        },
        "device_config": {"device": str(getattr(eng, "device", cfg.device))},
        "load_config": {"load_format": cfg.load_format},
        "lora_config": _lora_config(state),
        "speculative_config": None,
        "structured_outputs_config": {"backend": "xgrammar" if importlib.util.find_spec("xgrammar") else None},
        "weight_transfer_config": state.settings.weight_transfer_config,
    }


def system_fingerprint(state: ServerState) -> str:
    """The answers' ``system_fingerprint``, in the form of vLLM 0.32's default
    (``--fingerprint-mode full``, ``vllm/entrypoints/serve/utils/fingerprint.py``) with rlserve's
    name: ``rlserve-<version>[-tp<N>][-dp<N>]-<hash8>``, ``hash8`` the first 8 hex digits of the
    SHA-256 of :func:`vllm_config` as JSON (sorted keys): another model, dtype, parallelism or
    cache configuration gives another fingerprint (vLLM hashes its ``VllmConfig`` alike).
    Computed once per server state (the configuration does not change while it serves)."""
    fp = _FINGERPRINTS.get(state)
    if fp is None:
        fp = _FINGERPRINTS[state] = _fingerprint(state)
    return fp


#: state -> its fingerprint; entries go with their state
_FINGERPRINTS: weakref.WeakKeyDictionary[ServerState, str] = weakref.WeakKeyDictionary()


def _fingerprint(state: ServerState) -> str:
    cfg = state.aengine.config
    parts = [f"rlserve-{rlserve.__version__}"]
    parts += [f"{name}{size}" for name, size in (("tp", cfg.tensor_parallel_size), ("dp", cfg.data_parallel_size))
              if int(size) > 1]
    tree = json.dumps(vllm_config(state), sort_keys=True, default=str)
    return "-".join(parts + [hashlib.sha256(tree.encode()).hexdigest()[:8]])


def _text(tree: dict, prefix: str = "") -> str:
    """vLLM's ``config_format=text`` rendering: ``key=value`` pairs, nested with dots."""
    parts = []
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            parts.append(_text(v, f"{prefix}{k}."))
        else:
            parts.append(f"{prefix}{k}={v!r}")
    return ", ".join(parts)


def server_info(state: ServerState, config_format: str | None = None, sleep: dict | None = None) -> dict:
    """What ``GET /server_info`` answers. ``config_format``: absent or "json" give
    ``vllm_config`` as an object; "text" as vLLM's one-line string. ``sleep``: sleep mode's
    state (``AsyncSleep.info()``: ``is_sleeping``, ``level``, ``tags``, ``bytes``,
    ``bytes_discarded``, ``bytes_released``, counts and last times), None without
    ``--enable-sleep-mode``."""
    cfg = state.aengine.config
    eng = state.aengine.engine
    vc = vllm_config(state)
    return {
        "model": state.settings.model,
        "served_model_name": state.model_name,
        "served_model_names": list(state.settings.served_model_names),
        "version": rlserve.__version__,
        "rlserve_version": rlserve.__version__,
        "weight_version": state.aengine.weight_version,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "data_parallel_size": cfg.data_parallel_size,
        "world_size": _world_size(state),
        "dtype": _dtype_name(state),
        "quantization": cfg.quantization,
        "device": str(getattr(eng, "device", cfg.device)),
        "max_model_len": state.max_model_len,
        "vocab_size": state.vocab_size,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "logprobs_mode": vc["model_config"]["logprobs_mode"],
        "max_logprobs": state.max_logprobs,
        "weight_transfer_config": state.settings.weight_transfer_config,
        "weight_staging": state.settings.weight_staging,
        "weight_check_finite": state.settings.weight_check_finite,
        "is_paused": state.aengine.is_paused(),
        "enable_sleep_mode": bool(getattr(cfg, "enable_sleep_mode", False)),
        "is_sleeping": bool(sleep and sleep["is_sleeping"]),
        "sleep": sleep,
        "unavailable_reason": state.aengine.unavailable_reason,
        "engine_mode": getattr(state.aengine, "engine_mode", "thread"),
        "engine_core_pids": state.aengine.core_pids() if hasattr(state.aengine, "core_pids") else [],
        "lora_adapters": [dataclasses.asdict(r) for r in state.lora.adapters.values()] if state.lora else None,
        "engine_restarts": (state.aengine.restarter.info()
                            if getattr(state.aengine, "restarter", None) is not None else None),
        "vllm_config": _text(vc) if config_format == "text" else vc,
    }
