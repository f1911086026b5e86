"""A start that fails while Triton's precompile children compile (:mod:`rlserve.engine.worker.
triton_precompile`) reaps them: they used to run on, orphaned, until their share was compiled (a
review finding of session 15). Reproduced on CPU with forced failures; the children are real
processes (``sleep``, standing in for a child's long compile), no Triton or GPU needed."""

from __future__ import annotations

import subprocess
import tempfile
import time

import pytest

from rlserve.engine.worker import triton_precompile as tp

T = 60.0  # bound on every wait (seconds): only catches a hang
_POPEN = subprocess.Popen  # the real one (the first test patches the module's)


class _Target:  # what compile_specs reads of a triton GPUTarget
    backend, arch, warp_size = "cuda", 90, 32


_SLEEPERS: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_sleeper_left():
    yield
    while _SLEEPERS:  # a test that failed (the old code) leaves none running either
        p = _SLEEPERS.pop()
        if p.poll() is None:
            p.kill()
            p.wait(T)


def _sleeper(**kw) -> subprocess.Popen:
    _SLEEPERS.append(_POPEN(["sleep", "600"], **kw))
    return _SLEEPERS[-1]


def test_children_started_before_a_failed_spawn_are_reaped(monkeypatch):
    """compile_specs starts child 1, child 2's start fails: the error is raised and child 1 is
    killed and reaped (before: left compiling)."""
    started = []

    def popen(cmd, **kw):
        if started:
            raise OSError("forced: no second child")
        started.append(_sleeper(stdin=subprocess.PIPE))
        return started[-1]

    monkeypatch.setattr(tp.subprocess, "Popen", popen)
    monkeypatch.setattr(tp.os, "cpu_count", lambda: 4)
    specs = [{"module": "no_such_module_x", "name": f"k{i}", "data": "{}"} for i in range(2)]
    with pytest.raises(OSError, match="forced"):
        tp.compile_specs(specs, target=_Target(), max_workers=2)
    (child,) = started
    assert child.poll() is not None, "the first precompile child outlived the failed start"


def test_a_failed_engine_start_reaps_the_sampler_precompile_children(tiny_model, monkeypatch):
    """LLMEngine starts the sampler's precompile children (wait=False) before the KV cache is
    allocated; an allocation that raises (forced here; an out-of-memory KV cache on a GPU) fails
    the start, and the children are killed and reaped with it (before: they ran on)."""
    from rlserve.config import EngineConfig
    from rlserve.engine.core.llm_engine import LLMEngine
    from rlserve.engine.worker.worker import Worker

    children = []

    def precompile(fn, device, max_workers=tp.MAX_WORKERS, wait=True):
        children.append(_sleeper())
        return tp.Compiling({"recorded": 1, "cached": 0, "compiled": 0, "failed": 0, "workers": 1, "seconds": 0.0},
                            [(children[-1], [{}], tempfile.TemporaryFile())], time.perf_counter())

    def no_kv_cache(self, num_blocks):
        raise RuntimeError("forced: the KV cache does not fit")

    monkeypatch.setenv("RLSERVE_TRITON_PRECOMPILE", "1")
    monkeypatch.setattr(LLMEngine, "_sampler_warm_up", lambda self, executor: (lambda: None))
    monkeypatch.setattr(tp, "precompile", precompile)
    monkeypatch.setattr(Worker, "init_kv_cache", no_kv_cache)
    config = EngineConfig(model=tiny_model("llama"), device="cpu", dtype="float32", load_format="dummy",
                          max_model_len=128, kv_cache_bytes=16 << 20)
    with pytest.raises(RuntimeError, match="forced"):
        LLMEngine(config)
    (child,) = children
    assert child.poll() is not None, "the precompile child outlived the failed engine start"


def test_kill_is_idempotent_and_wait_after_it_returns():
    child = _sleeper()
    running = tp.Compiling({"recorded": 1, "cached": 0, "compiled": 0, "failed": 0, "workers": 1, "seconds": 0.0},
                           [(child, [{}, {}], tempfile.TemporaryFile())], time.perf_counter())
    running.kill()
    running.kill()
    assert child.poll() is not None and running.stats["failed"] == 2
    t0 = time.monotonic()
    assert running.wait(T)["compiled"] == 0 and time.monotonic() - t0 < T
