"""The KV cache's size checked against ``max_model_len`` (vLLM's start-up check), and
``--kv-cache-bytes`` checked before any engine starts (``rlserve serve``): the bytes of one KV
block and of one ``max_model_len`` sequence, from the checkpoint's ``config.json`` (no torch import:
the API process hands its config to the engine-core process before it imports torch).

The size is :func:`rlserve.engine.worker.model_runner.kv_cache_bytes_per_block`'s, on one TP rank:
2 (K and V) x layers x ``block_size`` x the rank's KV heads x ``head_dim`` x the cache's bytes per
value (``--kv-cache-dtype`` fp8: 1; else the model's dtype on the CPU: ``--dtype``, ``auto`` is
float32 there, :func:`rlserve.config.resolve_dtype`). Every attention layer of the model families
rlserve serves (Llama, Qwen2/3, Qwen-MoE, OPT) holds a cache of this shape.
"""

from __future__ import annotations

import json
import logging
import os

from rlserve.errors import InvalidRequestError

logger = logging.getLogger(__name__)

#: the CPU KV cache's size when ``--kv-cache-bytes`` is unset (the worker cuts it to ``max_num_seqs``
#: sequences of ``max_model_len`` tokens)
CPU_KV_CACHE_BYTES = 512 * 1024**2

_ITEM_BYTES = {"float32": 4, "fp32": 4, "float": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2}


def kv_bytes_per_block(cfg: dict, block_size: int, dtype: str = "auto", kv_cache_dtype: str = "auto",
                       tensor_parallel_size: int = 1) -> int | None:
    """Bytes one KV block of ``block_size`` tokens takes on one CPU rank, from a ``config.json``
    dict; None when ``cfg`` lacks the layer or head counts (the engine's start then checks)."""
    from rlserve.distributed.head_partition import attention_head_partition_sizes

    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    layers, q = text.get("num_hidden_layers"), text.get("num_attention_heads")
    if not (isinstance(layers, int) and isinstance(q, int) and layers > 0 and q > 0):
        return None
    kv = text.get("num_key_value_heads") or q
    head_dim = text.get("head_dim") or (text.get("hidden_size") or 0) // q
    if not (isinstance(kv, int) and isinstance(head_dim, int) and head_dim > 0):
        return None
    try:
        kv_rank = max(k for _q, k in attention_head_partition_sizes(q, kv, max(1, tensor_parallel_size)))
    except ValueError:  # (a head count TP cannot split: the engine's start says so)
        return None
    item = 1 if kv_cache_dtype.startswith("fp8") else _ITEM_BYTES.get(dtype, 4)  # auto on the CPU: float32
    return 2 * layers * block_size * kv_rank * head_dim * item


def blocks_for(tokens: int, block_size: int) -> int:
    """KV blocks of ``block_size`` tokens that ``tokens`` tokens take (rounded up)."""
    return -(-int(tokens) // block_size)


def check_cache_holds_one_sequence(num_blocks: int, block_size: int, max_model_len: int, source: str,
                                   per_block: int | None = None) -> None:
    """vLLM's start-up check (``_check_enough_kv_cache_memory``, ``vllm/v1/core/kv_cache_utils.py``):
    the KV cache must hold one sequence of ``max_model_len`` tokens, ``ceil(max_model_len /
    block_size)`` blocks; a request within ``max_model_len`` then always fits (vLLM caps
    ``max_model_len`` to the cache only when it is given as -1: :func:`fit_max_model_len`, before this check).

    ``source``: the flag that sized the cache, as the message names it (``--kv-cache-bytes N``,
    ``--num-kv-blocks N``, ``--gpu-memory-utilization F``); ``per_block``: one block's bytes, for the
    message (None: blocks and tokens only).

    Raises:
        InvalidRequestError: the cache is smaller (one line: vLLM's wording, the blocks, tokens and bytes
            needed and held, the bytes of one block, the longest ``--max-model-len`` that fits)."""
    need = blocks_for(max_model_len, block_size)
    if num_blocks >= need:
        return
    def size(blocks: int) -> str:
        tokens = f"{blocks} blocks of {block_size} tokens"
        return tokens if per_block is None else f"{tokens}, {blocks * per_block} bytes"
    raise InvalidRequestError(
        f"To serve at least one request with the model's max seq len ({max_model_len}), KV cache for {need} "
        f"blocks is needed ({size(need)}), which is larger than the available KV cache memory ({source}: "
        f"{size(num_blocks)}{'' if per_block is None else f'; {per_block} bytes per block'}); the longest "
        f"--max-model-len it holds is {num_blocks * block_size}. Raise "
        f"{source.split()[0]} or lower --max-model-len")


def fit_max_model_len(num_blocks: int, block_size: int, max_model_len: int, memory: str) -> int:
    """vLLM's auto-fit (``--max-model-len -1`` / ``auto``: ``_auto_fit_max_model_len``,
    ``vllm/v1/core/kv_cache_utils.py``): the model's length ``max_model_len``, cut to the tokens the
    cache holds (``num_blocks x block_size``), with vLLM's log line either way (``memory``: what sized
    the cache, as the line shows it)."""
    fits = num_blocks * block_size
    if fits >= max_model_len:
        logger.info("Auto-fit max_model_len: full model context length %d fits in available KV cache memory (%s)",
                    max_model_len, memory)
        return max_model_len
    logger.info("Auto-fit max_model_len: reduced from %d to %d to fit in available KV cache memory (%s)",
                max_model_len, fits, memory)
    return fits


def check_kv_cache_bytes(kv_cache_bytes: int | None, model_dir: str, block_size: int, max_model_len: int | None,
                         dtype: str = "auto", kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1,
                         num_kv_blocks: int | None = None, default_bytes: int | None = None) -> None:
    """``rlserve serve``'s check of the CPU KV cache's size before any engine starts: ``--num-kv-blocks``
    when set, else ``--kv-cache-bytes`` (``default_bytes`` when unset: None skips the check); nothing when
    ``model_dir/config.json`` is unreadable or lacks the counts (the engine's start checks again).

    Raises:
        InvalidRequestError: it holds no block (one line naming the flag, the bytes of one block,
            and of one sequence of ``max_model_len`` tokens when known: the smallest useful value), or
            fewer blocks than one sequence of ``max_model_len`` tokens needs
            (:func:`check_cache_holds_one_sequence`)."""
    if num_kv_blocks is not None:
        if max_model_len:
            check_cache_holds_one_sequence(num_kv_blocks, block_size, max_model_len, f"--num-kv-blocks {num_kv_blocks}")
        return
    nbytes = default_bytes if kv_cache_bytes is None else kv_cache_bytes
    if nbytes is None:
        return
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return
    per_block = kv_bytes_per_block(cfg, block_size, dtype, kv_cache_dtype, tensor_parallel_size) \
        if isinstance(cfg, dict) else None
    if per_block is None:
        return
    flag = f"--kv-cache-bytes {nbytes}" + (" (the default)" if kv_cache_bytes is None else "")
    if nbytes < per_block:
        longest = ""
        if max_model_len:
            longest = (f"; one sequence of --max-model-len {max_model_len} tokens needs "
                       f"{blocks_for(max_model_len, block_size) * per_block} bytes")
        raise InvalidRequestError(f"{flag} holds no KV-cache block: one block of {block_size} "
                                  f"tokens takes {per_block} bytes for this model{longest}")
    if max_model_len:
        check_cache_holds_one_sequence(nbytes // per_block, block_size, max_model_len, flag, per_block)
