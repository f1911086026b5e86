"""rlserve.loader: checkpoint iteration and model loading.

Submodules: ``checkpoint`` (``iterate_checkpoint``), ``model_loader`` (``load_model``,
``initialize_dummy_weights``, ``process_weights_after_loading``), ``weight_utils``
(``default_weight_loader`` and helpers used by layers/models). Nothing here imports the
layers or models at import time (layers import ``weight_utils``).
"""

from rlserve.loader.checkpoint import checkpoint_files, iterate_checkpoint
from rlserve.loader.model_loader import (
    build_model,
    initialize_dummy_weights,
    load_model,
    process_weights_after_loading,
)
from rlserve.loader.weight_utils import default_weight_loader

__all__ = [
    "build_model",
    "checkpoint_files",
    "default_weight_loader",
    "initialize_dummy_weights",
    "iterate_checkpoint",
    "load_model",
    "process_weights_after_loading",
]
