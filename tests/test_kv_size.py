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
    check_kv_cache_bytes(want, path, 16, 16, dtype, kv_dtype)  # one block: enough for --max-model-len 16
    with pytest.raises(InvalidRequestError, match=f"--kv-cache-bytes {want - 1} holds no KV-cache block: one block "
                                                  f"of 16 tokens takes {want} bytes"):
        check_kv_cache_bytes(want - 1, path, 16, 256, dtype, kv_dtype)


def test_a_cache_must_hold_one_sequence_of_max_model_len(tiny_model):
    """vLLM's start-up rule: ``ceil(max_model_len / block_size)`` blocks at least, from the bytes, the
    blocks or the CPU default (tiny llama: 8192 bytes a block of 16 tokens)."""
    path = tiny_model("llama")
    check_kv_cache_bytes(16 * 8192, path, 16, 256)  # exactly one sequence
    check_kv_cache_bytes(8 * 8192, path, 16, 128)
    check_kv_cache_bytes(None, path, 16, 256, num_kv_blocks=16)
    check_kv_cache_bytes(None, path, 16, 256, default_bytes=16 * 8192)
    with pytest.raises(InvalidRequestError, match=r"max seq len \(256\), KV cache for 16 blocks is needed .* "
                                                  r"\(--kv-cache-bytes 131071: 15 blocks of 16 tokens, 122880 bytes; 8192 bytes per block\); "
                                                  r"the longest --max-model-len it holds is 240\."):
        check_kv_cache_bytes(16 * 8192 - 1, path, 16, 256)
    with pytest.raises(InvalidRequestError, match=r"\(--num-kv-blocks 15: 15 blocks of 16 tokens\)"):
        check_kv_cache_bytes(1 << 30, path, 16, 256, num_kv_blocks=15)  # the blocks win over the bytes
    with pytest.raises(InvalidRequestError, match=r"\(--kv-cache-bytes 8192 \(the default\): 1 blocks"):
        check_kv_cache_bytes(None, path, 16, 17, default_bytes=8192)


def test_the_engine_refuses_a_cache_below_one_sequence(tiny_model):
    """``LLM`` (and the engine-core process of ``rlserve serve`` on a GPU, where the cache's size is known only
    there) refuses at start: a ValueError (InvalidRequestError) naming the setting and the bytes (session 22: the
    engine's message had blocks only; a block of 4 tokens of the tiny llama: 2 x 2 layers x 4 x 2 KV heads x 16 x
    4 bytes = 2048), no RuntimeError later."""
    from rlserve import LLM

    path = tiny_model("llama")
    with pytest.raises(ValueError, match=r"max seq len \(256\), KV cache for 64 blocks is needed \(64 blocks of 4 "
                                         r"tokens, 131072 bytes\), .*\(--num-kv-blocks 14: 14 blocks of 4 tokens, 28672 "
                                         r"bytes; 2048 bytes per block\); the longest --max-model-len it holds is 56\. "
                                         r"Raise --num-kv-blocks"):
        LLM(path, dtype="float32", device="cpu", block_size=4, num_kv_blocks=14)
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, num_kv_blocks=14, max_model_len=56)
    assert llm.engine.block_manager.num_blocks == 14
    assert llm.engine.max_model_len == 56


def test_max_model_len_auto_fits_the_cache(tiny_model, caplog):
    """``max_model_len=-1`` (``--max-model-len auto``): vLLM's auto-fit, the model's length (256) cut to the
    tokens the cache holds, with vLLM's log line; the model's length where the cache holds it."""
    import logging

    from rlserve import LLM, SamplingParams

    path = tiny_model("llama")
    with caplog.at_level(logging.INFO, logger="rlserve.kv_size"):
        llm = LLM(path, dtype="float32", device="cpu", block_size=4, num_kv_blocks=14, max_model_len=-1)
    assert llm.engine.max_model_len == llm.engine.config.max_model_len == 56
    assert "Auto-fit max_model_len: reduced from 256 to 56 to fit in available KV cache memory (--num-kv-blocks 14)" \
        in caplog.text
    out = llm.generate([list(range(5, 45))], SamplingParams(temperature=0, ignore_eos=True))[0]  # the rest: 16
    assert len(out.outputs[0].token_ids) == 16
    # max_tokens beyond the fitted context: clamped to the room left (16), as vLLM
    out = llm.generate([list(range(5, 45))], SamplingParams(max_tokens=17, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 16 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="maximum context length is 56"):  # a prompt that fills it
        llm.generate([list(range(5, 61))], SamplingParams(max_tokens=1))
    assert LLM(path, dtype="float32", device="cpu", max_model_len=-1).engine.max_model_len == 256


def test_the_engine_refuses_a_cache_of_no_block_as_a_setting(tiny_model):
    """Less than one block (here ``LLM``, which has no check before the engine; on a GPU,
    ``--gpu-memory-utilization``): a ValueError (InvalidRequestError, exit 2 from ``rlserve serve``) as
    vLLM's "No available memory for the cache blocks", not a RuntimeError."""
    from rlserve import LLM

    with pytest.raises(InvalidRequestError, match=r"^no memory left for the KV cache \(10 bytes for blocks of 8192 "
                                                  r"bytes\); raise --kv-cache-bytes to at least one block$"):
        LLM(tiny_model("llama"), dtype="float32", device="cpu", kv_cache_bytes=10)


@pytest.mark.parametrize("given", [None, 20000])
def test_max_model_len_auto_recomputes_the_default_step_budget_after_the_fit(tiny_model, monkeypatch, given):
    """CUDA without chunked prefill (the device type stood in at the budget's decision; a CPU engine): the
    default ``max_num_batched_tokens`` is ``max(8192, max_model_len)`` of the length AFTER
    ``--max-model-len auto`` cut it to the KV cache (here 56, so 8192), not of the model's 16384; the
    scheduler and the executor (``set_token_limits``) get that. A budget the user gave stays as given."""
    from rlserve import LLM
    from rlserve.engine.core import llm_engine

    monkeypatch.setattr(llm_engine, "_budget_device_type", lambda executor: "cuda")
    path = tiny_model("llama", max_position_embeddings=16384)
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, num_kv_blocks=14, max_model_len=-1,
              enable_chunked_prefill=False, max_num_batched_tokens=given)
    engine = llm.engine
    assert engine.max_model_len == 56
    want = 8192 if given is None else given
    assert engine.config.max_num_batched_tokens == want
    assert engine.scheduler.max_num_batched_tokens == want
    assert engine.executor.config.max_num_batched_tokens == want
    assert engine.executor.config.max_model_len == 56
    # without the fit (the model's length, 16384, fits a cache of 4096 blocks), the budget is that length
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, num_kv_blocks=4096, max_model_len=-1,
              enable_chunked_prefill=False, max_num_batched_tokens=given)
    assert llm.engine.max_model_len == 16384
    assert llm.engine.config.max_num_batched_tokens == (16384 if given is None else given)
