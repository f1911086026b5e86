"""Shared fixtures: tiny random-init checkpoints, built once per test session; the weight-sync
tests' shared in-process servers."""

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


_shared_servers: list = []  # the session's tests.transfer_sync.SharedServers, once `shared` was set up
_last_shared_user: dict = {}  # session -> the last collected item that uses `shared`


@pytest.fixture(scope="session")
def shared():
    """``with shared(path, staging="none", fresh=False) as srv``: the weight-sync tests' shared
    in-process server of ``(path, staging)`` (:class:`tests.transfer_sync.SharedServers`), one
    for all the test files that use it. Closed right after the last collected test that uses
    this fixture (:func:`pytest_runtest_teardown`), not at the end of the whole run."""
    from tests.transfer_sync import SharedServers

    servers = SharedServers()
    _shared_servers.append(servers)
    yield servers.get
    servers.close()
    _shared_servers.remove(servers)


def pytest_runtest_teardown(item, nextitem):
    """Stop the shared weight-sync servers after the last test that uses ``shared`` (the files
    that do are consecutive in a run, so none is started twice)."""
    if not _shared_servers:
        return
    session = item.session
    if session not in _last_shared_user:
        users = [it for it in session.items if "shared" in getattr(it, "fixturenames", ())]
        _last_shared_user[session] = users[-1] if users else None
    if item is _last_shared_user[session]:
        for servers in _shared_servers:
            servers.close()
