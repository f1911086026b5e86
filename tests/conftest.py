"""Shared fixtures: tiny random-init checkpoints, built once per test session."""

import pytest

from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """``tiny_model(arch, **overrides) -> path``: a cached tiny HF checkpoint directory."""
    cache: dict = {}

    def get(arch: str, **overrides) -> str:
        key = (arch, repr(sorted(overrides.items())))
        if key not in cache:
            cache[key] = make_tiny_model(arch, tmp_path_factory.mktemp(arch), **overrides)
        return cache[key]

    return get
