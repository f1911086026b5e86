"""Thread placement of CPU engines (rlserve/engine/cpu_threads.py)."""

from __future__ import annotations

import pytest
import torch

from rlserve.config import EngineConfig
from rlserve.engine import cpu_threads


@pytest.fixture
def clean_env(monkeypatch):
    for k in (cpu_threads.THREADS_ENV, cpu_threads.RESERVED_ENV, "OMP_NUM_THREADS"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


@pytest.mark.parametrize("cpus,tp,dp,want", [(1, 1, 1, 1), (2, 1, 1, 1), (4, 1, 1, 3), (16, 1, 1, 15),
                                            (16, 2, 1, 7), (16, 2, 2, 3), (2, 2, 1, 1)])
def test_default_leaves_one_cpu_and_splits_the_rest(clean_env, cpus, tp, dp, want):
    clean_env.setattr(cpu_threads, "usable_cpus", lambda: cpus)
    cfg = EngineConfig(model="unused", tensor_parallel_size=tp, data_parallel_size=dp)
    assert cpu_threads.engine_cpu_threads(cfg) == want


def test_overrides_in_order(clean_env):
    clean_env.setattr(cpu_threads, "usable_cpus", lambda: 8)
    cfg = EngineConfig(model="unused")
    clean_env.setenv(cpu_threads.RESERVED_ENV, "0")
    assert cpu_threads.engine_cpu_threads(cfg) == 8
    clean_env.setenv(cpu_threads.RESERVED_ENV, "3")
    assert cpu_threads.engine_cpu_threads(cfg) == 5
    clean_env.setenv("OMP_NUM_THREADS", "2")
    assert cpu_threads.engine_cpu_threads(cfg) == 2
    clean_env.setenv(cpu_threads.THREADS_ENV, "6")
    assert cpu_threads.engine_cpu_threads(cfg) == 6
    cfg.extra["cpu_threads"] = 4
    assert cpu_threads.engine_cpu_threads(cfg) == 4


@pytest.mark.parametrize("env,value", [(cpu_threads.THREADS_ENV, "0"), (cpu_threads.THREADS_ENV, "two"),
                                       (cpu_threads.RESERVED_ENV, "-1")])
def test_bad_overrides_are_named(clean_env, env, value):
    clean_env.setenv(env, value)
    with pytest.raises(ValueError, match=env):
        cpu_threads.engine_cpu_threads(EngineConfig(model="unused"))


def test_configure_sets_torch_threads_of_the_calling_thread(clean_env):
    old = torch.get_num_threads()
    try:
        clean_env.setenv(cpu_threads.THREADS_ENV, "1")
        assert cpu_threads.configure_engine_threads(EngineConfig(model="unused")) == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(old)
