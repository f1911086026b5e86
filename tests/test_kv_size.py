"""``rlserve serve``'s early ``--kv-cache-bytes`` check (:mod:`rlserve.kv_size`) computes the bytes
of a KV block as the engine does (:func:`~rlserve.engine.worker.model_runner.kv_cache_bytes_per_block`
on the built model), for every model family and cache dtype; one block's bytes pass the check."""

from __future__ import annotations

import json
import os

import pytest
import torch

from rlserve.errors import InvalidRequestError
from rlserve.kv_size import check_kv_cache_bytes, kv_bytes_per_block


@pytest.mark.parametrize("arch", ["llama", "smollm", "qwen3", "qwen3_moe", "opt"])
@pytest.mark.parametrize("kv_dtype,dtype", [("auto", "auto"), ("auto", "bfloat16"), ("fp8", "auto")])
def test_block_bytes_match_the_engines(tiny_model, arch, kv_dtype, dtype):
    from rlserve.config import resolve_dtype
    from rlserve.engine.worker.model_runner import kv_cache_bytes_per_block
    from rlserve.layers.kv_quant import KV_CACHE_DTYPES
    from rlserve.loader.model_loader import build_model
    from transformers import AutoConfig

    path = tiny_model(arch)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    hf = AutoConfig.from_pretrained(path)
    model_dtype = resolve_dtype(dtype, torch.device("cpu"), hf)
    model = build_model(hf, "meta", model_dtype)
    want = kv_cache_bytes_per_block(model, 16, KV_CACHE_DTYPES[kv_dtype] or model_dtype)
    assert kv_bytes_per_block(cfg, 16, dtype, kv_dtype) == want > 0
    check_kv_cache_bytes(want, path, 16, 256, dtype, kv_dtype)  # one block: enough
    with pytest.raises(InvalidRequestError, match=f"--kv-cache-bytes {want - 1} holds no KV-cache block: one block "
                                                  f"of 16 tokens takes {want} bytes"):
        check_kv_cache_bytes(want - 1, path, 16, 256, dtype, kv_dtype)
