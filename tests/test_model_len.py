"""The longest ``max_model_len`` a checkpoint allows (:mod:`rlserve.model_len`, vLLM 0.32's rule): the
smallest length key, times a linear RoPE factor, ``model_max_length`` winning; the same answer from
``config.json`` (``rlserve serve``'s check before any engine starts) and from the HF config object
(the engine's); vLLM's message and its ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` escape; a linearly scaled
model serves positions past ``max_position_embeddings`` (the RoPE table covers factor x positions)."""

from __future__ import annotations

import json
import logging
import math

import pytest

from rlserve.errors import InvalidRequestError
from rlserve.model_len import derived_max_model_len, verify_max_model_len


@pytest.mark.parametrize("cfg,length,key", [
    ({"max_position_embeddings": 2048}, 2048, "max_position_embeddings"),
    ({"n_positions": 1024}, 1024, "n_positions"),  # GPT-2
    ({"max_position_embeddings": 4096, "seq_length": 2048}, 2048, "seq_length"),  # the smallest counts
    ({"max_position_embeddings": 4096, "model_max_length": 8192}, 8192, "model_max_length"),  # wins (Command-R)
    ({"max_position_embeddings": 2048, "rope_scaling": {"type": "linear", "factor": 4.0}}, 8192,
     "max_position_embeddings"),
    ({"max_position_embeddings": 2048, "rope_parameters": {"rope_type": "linear", "factor": 2.0}}, 4096,
     "max_position_embeddings"),
    ({"max_position_embeddings": 2048, "rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0},
                                                           "sliding_attention": {"rope_type": "default"}}},
     4096, "max_position_embeddings"),  # per layer type
    ({"max_position_embeddings": 131072, "rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, 131072,
     "max_position_embeddings"),  # llama3 / yarn: already scaled
    ({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": None}}, 4096,
     "max_position_embeddings"),  # a null factor reads as 1
    ({"text_config": {"max_position_embeddings": 512}}, 512, "max_position_embeddings"),
    ({"hidden_size": 8}, math.inf, None),
])
def test_derived_length(cfg, length, key):
    assert derived_max_model_len(cfg) == (length, key)


def test_dict_and_config_object_agree(tiny_model):
    from transformers import AutoConfig

    path = tiny_model("llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    with open(f"{path}/config.json") as f:
        as_json = json.load(f)
    assert derived_max_model_len(as_json) == derived_max_model_len(AutoConfig.from_pretrained(path)) == (
        2 * as_json["max_position_embeddings"], "max_position_embeddings")


def test_verify_message_and_escape(monkeypatch, caplog):
    cfg = {"max_position_embeddings": 256}
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    assert verify_max_model_len(None, cfg) == 256 and verify_max_model_len(256, cfg) == 256
    assert verify_max_model_len(None, {"max_position_embeddings": 32768}) == 8192  # the default's cap
    assert verify_max_model_len(None, {}) == 8192
    with pytest.raises(InvalidRequestError) as e:
        verify_max_model_len(99999999, cfg)
    msg = str(e.value)
    assert msg.startswith("User-specified max_model_len (99999999) is greater than the derived max_model_len "
                          "(max_position_embeddings=256 or model_max_length=None in model's config.json). To allow "
                          "overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. "), msg
    assert "\n" not in msg
    with pytest.raises(InvalidRequestError, match=r"^max_model_len must be >= 1, got 0$"):
        verify_max_model_len(0, cfg)
    for on in ("1", "true", " TRUE "):
        monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", on)
        with caplog.at_level(logging.WARNING, logger="rlserve.model_len"):
            assert verify_max_model_len(1000, cfg) == 1000
        assert "must be used with extreme caution" in caplog.text
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0")
    with pytest.raises(InvalidRequestError):
        verify_max_model_len(1000, cfg)


def test_engine_refuses_with_the_same_message(tiny_model):
    from rlserve import LLM

    with pytest.raises(InvalidRequestError, match=r"User-specified max_model_len \(257\) is greater than the derived "
                                                  r"max_model_len \(max_position_embeddings=256 "):
        LLM(tiny_model("llama"), device="cpu", max_model_len=257)


def test_linear_rope_scaling_serves_factor_times_the_positions(tiny_model):
    """A checkpoint with linear RoPE scaling (factor 2, 256 positions): max_model_len 512 is served
    (the old check refused it: "exceeds the model's max_position_embeddings 256"), and a 400-token
    prompt gives Hugging Face's greedy tokens (HF scales the same way; the RoPE table now has 512 rows)."""
    from rlserve import LLM, SamplingParams
    from tests.test_engine import hf_greedy

    path = tiny_model("llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=512)
    assert llm.engine.max_model_len == 512
    prompt = [5 + (i * 7) % 300 for i in range(400)]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4))
    assert out[0].outputs[0].token_ids == hf_greedy(path, [prompt], 4)[0]


def test_long_max_model_len_escape_computes_rope_past_the_table(tiny_model, monkeypatch):
    """``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`` with ``max_model_len`` 512 on a 256-position RoPE model:
    the RoPE table grows to 512 rows (RoPE is defined at every position), so a 400-token prompt
    gives Hugging Face's greedy tokens (HF computes cos / sin from the positions). The old table had
    256 rows and the CPU kernels read past its end (a 200 with undefined tokens, session 19)."""
    from rlserve import LLM, SamplingParams
    from rlserve.layers.rotary import RotaryEmbedding
    from tests.test_engine import hf_greedy

    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    path = tiny_model("llama")
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=512)
    ropes = [m for m in llm.engine.executor.model.modules() if isinstance(m, RotaryEmbedding)]
    assert ropes and {tuple(m.cos_cache.shape) for m in ropes} == {(512, 16)}
    prompt = [5 + (i * 7) % 300 for i in range(400)]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4))
    assert out[0].outputs[0].token_ids == hf_greedy(path, [prompt], 4)[0]


def test_long_max_model_len_escape_refuses_past_a_learned_position_table(tiny_model, monkeypatch):
    """OPT's positions are a learned table (256 rows here): nothing can compute row 300, so the
    escape cannot raise it: the engine's start refuses, naming the table and the longest length
    (the old code started, and a long prompt read past the table)."""
    from rlserve import LLM

    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    with pytest.raises(ValueError, match=r"max_model_len 512 is past the model's learned position table \(256 "
                                         r"positions: OPTLearnedPositionalEmbedding\).* --max-model-len 256 or less"):
        LLM(tiny_model("opt"), device="cpu", dtype="float32", max_model_len=512)
