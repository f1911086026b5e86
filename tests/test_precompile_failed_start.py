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


@pytest.mark.parametrize("failure", ["model build", "max_model_len"])
def test_a_failed_start_reaps_the_early_sampler_precompile(tiny_model, monkeypatch, failure):
    """On one GPU the sampler's precompile starts before the model is built
    (``engine_setup.start_sampler_precompile``, stood in for here: a real child); a start that then
    fails -- in the model's build, or at a check after it (``max_model_len`` beyond the model's) --
    kills and reaps it, and the engine raises the start's own error."""
    from rlserve.config import EngineConfig
    from rlserve.engine.core import llm_engine
    from rlserve.engine.worker.worker import Worker
    from rlserve.errors import InvalidRequestError

    children = []

    def early(config):
        children.append(_sleeper())
        return tp.Compiling({"recorded": 1, "cached": 0, "compiled": 0, "failed": 0, "workers": 1, "seconds": 0.0},
                            [(children[-1], [{}], tempfile.TemporaryFile())], time.perf_counter())

    monkeypatch.setattr(llm_engine, "start_sampler_precompile", early)
    if failure == "model build":
        def no_model(self, *a, **k):
            raise RuntimeError("forced: the model does not build")

        monkeypatch.setattr(Worker, "__init__", no_model)
    config = EngineConfig(model=tiny_model("llama"), device="cpu", dtype="float32", load_format="dummy",
                          max_model_len=128 if failure == "model build" else 1 << 20, kv_cache_bytes=16 << 20)
    with pytest.raises(RuntimeError if failure == "model build" else InvalidRequestError,
                       match="forced" if failure == "model build" else "max_position_embeddings"):
        llm_engine.LLMEngine(config)
    (child,) = children
    assert child.poll() is not None, "the early precompile child outlived the failed engine start"


def test_early_sampler_precompile_only_for_one_gpu(monkeypatch):
    """``start_sampler_precompile`` starts nothing (None, no Triton touched) without
    ``RLSERVE_GPU_START_OVERLAP=1``, on the CPU, under tensor parallelism, or with ``RLSERVE_TRITON_PRECOMPILE=0``: there the engine starts it after the KV
    cache sizing, as before."""
    from rlserve.config import EngineConfig
    from rlserve.engine.core.engine_setup import start_sampler_precompile

    calls = []
    monkeypatch.setattr(tp, "precompile", lambda *a, **k: calls.append(a))
    monkeypatch.setenv("RLSERVE_TRITON_PRECOMPILE", "1")
    monkeypatch.setenv("RLSERVE_GPU_START_OVERLAP", "0")  # the default: off until measured on a GPU
    assert start_sampler_precompile(EngineConfig(model="/nonexistent", device="cuda")) is None
    monkeypatch.setenv("RLSERVE_GPU_START_OVERLAP", "1")
    assert start_sampler_precompile(EngineConfig(model="/nonexistent", device="cpu")) is None
    assert start_sampler_precompile(EngineConfig(model="/nonexistent", device="cuda", tensor_parallel_size=2)) is None
    monkeypatch.setenv("RLSERVE_TRITON_PRECOMPILE", "0")
    assert start_sampler_precompile(EngineConfig(model="/nonexistent", device="cuda")) is None
    assert calls == []
