"""The one-GPU NCCL emulation (``tests/gpu/nccl_over_gloo.py``) on the CPU: its patch reaches
the process that builds the server's transfer group, which is the engine-core process, not the
API process the launcher patches (before: the trainer built gloo, the server's core real NCCL,
and every gloo-cuda sync on the H200 failed after 90 s in the rendezvous)."""

from __future__ import annotations

import asyncio
import os
import threading
from datetime import timedelta

import pytest

from tests.gpu import nccl_over_gloo


def test_gloo_for_nccl_swaps_only_nccl_and_passes_keywords():
    calls = []

    def real(backend, store, rank, world_size, timeout, nccl_async_error_handling=None, gloo_address=None):
        calls.append((backend, rank, world_size, timeout, nccl_async_error_handling, gloo_address))
        return backend

    patched = nccl_over_gloo.gloo_for_nccl(real)
    td = timedelta(seconds=90)
    assert patched("nccl", None, 1, 2, td, nccl_async_error_handling="2", gloo_address=None) == "gloo"
    assert patched("gloo", None, 0, 2, td, nccl_async_error_handling="2", gloo_address="10.0.0.1") == "gloo"
    # NCCL's async-error-handling setting means nothing to gloo: dropped; gloo_address passes through
    assert calls == [("gloo", 1, 2, td, None, None), ("gloo", 0, 2, td, None, "10.0.0.1")]
    assert patched.gloo_for_nccl is True


@pytest.fixture
def clean_env(monkeypatch):
    """Whatever :func:`install` changes in this process is restored afterwards."""
    import rlserve.transfer.backends.group as group

    monkeypatch.setattr(group, "new_backend", group.new_backend)
    monkeypatch.setattr(group.TransferGroup, "order", group.TransferGroup.order)
    monkeypatch.setenv("RLSERVE_ENGINE_CORE_INIT", "")
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    return monkeypatch


def test_install_reaches_the_engine_core_process(tiny_model, clean_env):
    from rlserve.config import EngineConfig
    from rlserve.engine.front.async_engine import AsyncEngine

    nccl_over_gloo.install()
    nccl_over_gloo.install()  # idempotent
    assert nccl_over_gloo.installed()
    assert os.environ["RLSERVE_ENGINE_CORE_INIT"] == nccl_over_gloo.CORE_INIT
    assert os.environ["PYTHONPATH"].split(os.pathsep).count(nccl_over_gloo.ROOT) == 1
    engine = AsyncEngine(EngineConfig(model=tiny_model("llama"), device="cpu", dtype="float32", max_model_len=128),
                         engine_mode="process")
    try:
        assert engine.core_pids() and engine.core_pids()[0] != os.getpid()
        assert asyncio.run(engine.call_engines("tests.gpu.nccl_over_gloo:installed", timeout_s=60)) == [True]
    finally:
        engine.shutdown()


def test_install_refuses_to_replace_another_core_hook(clean_env):
    clean_env.setenv("RLSERVE_ENGINE_CORE_INIT", "tests.test_engine_core_isolation:faulty_add")
    with pytest.raises(RuntimeError, match="faulty_add"):
        nccl_over_gloo.install()
    assert not nccl_over_gloo.installed()


class _Pending:
    """A work handle that never completes; its blocking ``wait`` is a test failure."""

    def is_completed(self) -> bool:
        return False

    def wait(self):
        raise AssertionError("work.wait() called on a pending work: it would block the host")


def test_order_is_abortable_under_the_emulation(clean_env):
    """A receive blocked on a dead trainer ends on the liveness watch's abort: ``order`` on a
    "nccl" group built as gloo polls like ``wait`` instead of blocking in gloo's ``work.wait()``."""
    import torch

    from rlserve.transfer.backends.group import TransferGroup
    from rlserve.transfer.errors import TransferAbortedError, WeightTransferFailedError

    g = TransferGroup("nccl", "127.0.0.1", 1, 1, 2, timeout_s=60, device=torch.device("cpu"))
    with pytest.raises(WeightTransferFailedError, match="would block"):  # NCCL's order: work.wait() at once
        g.order(_Pending(), what="bucket 1/3")
    nccl_over_gloo.install()
    threading.Timer(0.2, g.abort, args=("the trainer is gone",)).start()
    # (the deadline, 60 s, would raise TransferTimeoutError)
    with pytest.raises(TransferAbortedError, match="bucket 1/3 aborted: the trainer is gone"):
        g.order(_Pending(), what="bucket 1/3")


class _Failed:
    """A completed work handle whose ``wait`` raises the backend's error ``msg``."""

    def __init__(self, msg: str):
        self.msg = msg

    def is_completed(self) -> bool:
        return True

    def wait(self):
        raise RuntimeError(self.msg)


def test_wait_maps_the_backends_own_timeout_to_504_and_other_errors_to_500():
    """gloo's recv deadline firing inside ``work.wait()`` is a timeout (TransferTimeoutError: HTTP 504), not a
    failure (500): the message is gloo's own (torch 2.x, gloo/transport/tcp/pair.cc); a closed peer stays a 500."""
    import torch

    from rlserve.transfer.backends.group import TransferGroup
    from rlserve.transfer.errors import TransferTimeoutError, WeightTransferFailedError

    g = TransferGroup("gloo", "127.0.0.1", 1, 1, 2, timeout_s=60, device=torch.device("cpu"))
    gloo_timeout = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Timed out waiting 60000ms for recv "
                    "operation to complete")
    with pytest.raises(TransferTimeoutError, match="bucket 2/3 timed out in the gloo backend"):
        g.wait(_Failed(gloo_timeout), what="bucket 2/3")
    closed = "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:1234"
    with pytest.raises(WeightTransferFailedError, match="bucket 2/3 failed") as err:
        g.wait(_Failed(closed), what="bucket 2/3")
    assert not isinstance(err.value, TransferTimeoutError)
