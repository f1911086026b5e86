"""Thread placement of CPU engines (rlserve/engine/cpu/cpu_threads.py)."""

from __future__ import annotations

import os

import pytest
import torch

from rlserve.config import EngineConfig
from rlserve.engine.cpu import cpu_threads


@pytest.fixture
def clean_env(monkeypatch):
    for k in ("RLSERVE_CPU_THREADS", "RLSERVE_CPU_RESERVED_CPUS", "OMP_NUM_THREADS", "RLSERVE_CPU_OMP_THREADS_BIND"):
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
    clean_env.setenv("RLSERVE_CPU_RESERVED_CPUS", "0")
    assert cpu_threads.engine_cpu_threads(cfg) == 8
    clean_env.setenv("RLSERVE_CPU_RESERVED_CPUS", "3")
    assert cpu_threads.engine_cpu_threads(cfg) == 5
    clean_env.setenv("OMP_NUM_THREADS", "2")
    assert cpu_threads.engine_cpu_threads(cfg) == 2
    clean_env.setenv("RLSERVE_CPU_THREADS", "6")
    assert cpu_threads.engine_cpu_threads(cfg) == 6
    cfg.extra["cpu_threads"] = 4
    assert cpu_threads.engine_cpu_threads(cfg) == 4


@pytest.mark.parametrize("env,value", [("RLSERVE_CPU_THREADS", "0"), ("RLSERVE_CPU_THREADS", "two"),
                                       ("RLSERVE_CPU_RESERVED_CPUS", "-1")])
def test_bad_overrides_are_named(clean_env, env, value):
    clean_env.setenv(env, value)
    with pytest.raises(ValueError, match=env):
        cpu_threads.engine_cpu_threads(EngineConfig(model="unused"))


def test_configure_sets_torch_threads_of_the_calling_thread(clean_env):
    old = torch.get_num_threads()
    try:
        clean_env.setenv("RLSERVE_CPU_THREADS", "1")
        assert cpu_threads.configure_engine_threads(EngineConfig(model="unused")) == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(old)


def test_cpu_list_parsing():
    assert cpu_threads.parse_cpu_list("0-3,6") == [0, 1, 2, 3, 6]
    assert cpu_threads.parse_cpu_list("1") == [1]
    with pytest.raises(ValueError, match="RLSERVE_CPU_OMP_THREADS_BIND"):
        cpu_threads.parse_cpu_list("0-x")


def test_claimed_cpus_are_not_claimed_twice(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_threads, "_held_locks", [])
    cpus = sorted(os.sched_getaffinity(0), reverse=True)
    first = cpu_threads._claim_cpus(1, str(tmp_path))
    assert first == cpus[:1]
    # another engine (here: a second open file, as another process would hold) gets the next CPU, or none
    second = cpu_threads._claim_cpus(len(cpus), str(tmp_path))
    assert second == []  # only len(cpus) - 1 are left
    if len(cpus) > 1:
        assert cpu_threads._claim_cpus(1, str(tmp_path)) == cpus[1:2]
    for f in cpu_threads._held_locks:
        f.close()


def test_binding_only_where_allowed_and_asked(clean_env, monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_threads.os, "sched_setaffinity", lambda pid, cpus: calls.append(list(cpus)))
    monkeypatch.setattr(cpu_threads, "_bind_allowed", False)
    clean_env.setenv("RLSERVE_CPU_THREADS", "1")
    old = torch.get_num_threads()
    try:
        monkeypatch.setattr(cpu_threads, "_bind_allowed", True)
        cpu_threads.configure_engine_threads(EngineConfig(model="unused"))
        assert calls == []  # off by default
        clean_env.setenv("RLSERVE_CPU_OMP_THREADS_BIND", "0")
        monkeypatch.setattr(cpu_threads, "_bind_allowed", False)
        cpu_threads.configure_engine_threads(EngineConfig(model="unused"))
        assert calls == []  # an offline LLM / a thread of another program: never pinned
        monkeypatch.setattr(cpu_threads, "_bind_allowed", True)
        cpu_threads.configure_engine_threads(EngineConfig(model="unused"))
        assert calls == [[0]]
        clean_env.setenv("RLSERVE_CPU_OMP_THREADS_BIND", "nobind")
        cpu_threads.configure_engine_threads(EngineConfig(model="unused"))
        assert calls == [[0]]
        clean_env.setenv("RLSERVE_CPU_OMP_THREADS_BIND", "auto")  # several ranks: they place their own
        cpu_threads.configure_engine_threads(EngineConfig(model="unused", tensor_parallel_size=2))
        assert calls == [[0]]
    finally:
        torch.set_num_threads(old)
