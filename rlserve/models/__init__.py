"""rlserve.models: our own model implementations (see ``registry.get_model_class``)."""

from rlserve.models.registry import get_model_class, supported_architectures

__all__ = ["get_model_class", "supported_architectures"]
