"""The multi-server SDK's pieces without servers: rank offsets, the fan-out's failure rules, the
common next version, and the server's check of ``rank_offset`` / ``world_size``."""

from __future__ import annotations

import threading

import pytest

from rlserve.errors import WeightUpdateError
from rlserve.transfer.sdk.client import WeightSyncConflictError, WeightSyncHTTPError
from rlserve.transfer.sdk.fanout import FanOutClient, FanOutConflictError, FanOutError
from rlserve.transfer.sdk.multi_server import common_next_version
from rlserve.transfer.wire.protocol import InitInfo


class FakeClient:
    """Records calls; ``fail[route]`` is raised, ``block[route]`` is waited on first."""

    def __init__(self, url: str, world_size: int):
        self.url, self.world_size, self.session = url, world_size, None
        self.calls: list = []
        self.fail: dict = {}
        self.block: dict = {}

    def _do(self, route, *args):
        self.calls.append((route, args))
        if route in self.block:
            assert self.block[route].wait(30)
        if route in self.fail:
            raise self.fail[route]
        return {"url": self.url, "args": args}

    def get_world_size(self):
        return self.world_size

    def __getattr__(self, route):
        return lambda *args: self._do(route, *args)


def _fanout(sizes):
    fakes = {}

    def make(url):
        fakes[url] = FakeClient(url, sizes[url])
        return fakes[url]

    return FanOutClient(list(sizes), client_factory=make), fakes


def test_rank_offsets_follow_each_servers_workers():
    fo, fakes = _fanout({"http://a:1": 2, "http://b:1": 4, "http://c:1": 1})
    assert fo.get_world_size() == 7
    assert fo.rank_offsets() == {"http://a:1": 1, "http://b:1": 3, "http://c:1": 7}
    fo.init_weight_transfer_engine({"backend": "gloo", "world_size": 8, "rank_offset": 1}, 30.0)
    sent = {u: f.calls[-1][1][0]["rank_offset"] for u, f in fakes.items()}
    assert sent == {"http://a:1": 1, "http://b:1": 3, "http://c:1": 7}
    assert all(f.calls[-1][1][0]["world_size"] == 8 and f.calls[-1][1][0]["shared_group"] for f in fakes.values())
    fo.session = "s1"
    assert {f.session for f in fakes.values()} == {"s1"}
    fo.drop(["http://b:1"])
    assert fo.rank_offsets() == {"http://a:1": 1, "http://c:1": 3} and fo.get_world_size() == 3
    fo.close()


def test_a_failed_part_is_raised_at_once_while_the_others_run():
    fo, fakes = _fanout({"http://a:1": 1, "http://b:1": 1})
    release = threading.Event()
    fakes["http://a:1"].block["update_weights"] = release
    fakes["http://b:1"].fail["update_weights"] = WeightSyncHTTPError("/update_weights", 500, "broken")
    with pytest.raises(FanOutError) as ei:
        fo.update_weights({"names": []}, 10.0)  # a is still blocked: not waited for
    assert set(ei.value.failures) == {"http://b:1"} and ei.value.status_code == 500
    assert "http://a:1" not in fo.last_results
    release.set()
    fo.close()


def test_no_transfer_engine_everywhere_is_a_conflict_with_its_code():
    fo, fakes = _fanout({"http://a:1": 1, "http://b:1": 1})
    for f in fakes.values():
        f.fail["start_weight_update"] = WeightSyncConflictError("/start_weight_update", 409, "none",
                                                                code="no_transfer_engine")
    with pytest.raises(FanOutConflictError) as ei:
        fo.start_weight_update({"names": []})
    assert isinstance(ei.value, WeightSyncConflictError) and ei.value.code == "no_transfer_engine"
    fakes["http://b:1"].fail["finish_weight_update"] = WeightSyncHTTPError("/finish_weight_update", 500, "x")
    with pytest.raises(FanOutError):
        fo.finish_weight_update("3")  # wait_all: both parts ran
    assert set(fo.last_results) == {"http://a:1", "http://b:1"}
    fo.close()


@pytest.mark.parametrize("versions,want", [
    (["7", "7"], "8"), (["step-41"], "step-42"), (["abc", "abc"], "abc.1"), (["3", "0"], "4"),
    (["v2", "x"], "v3"), (["a", "b"], "a.1"),
])
def test_common_next_version(versions, want):
    assert common_next_version(versions) == want


@pytest.mark.parametrize("versions,nexts,want", [
    (["0", "0"], ["5", "5"], "5"),  # a server back on its checkpoint's "0" after using "1".."4"
    (["0", "3"], ["5", "4"], "5"), (["a", "b"], ["a.1", "b.1"], "a.1"), (["s-1", "s-2"], ["s-9", "s-3"], "s-9"),
    (["7", "7"], ["8", None], "8"),  # a server without next_weight_version: the current ones decide
])
def test_common_next_version_uses_the_servers_next_labels(versions, nexts, want):
    assert common_next_version(versions, nexts) == want


def test_init_info_rank_offset_range():
    InitInfo(backend="gloo", master_port=1, rank_offset=5, world_size=6).validate()
    assert InitInfo(backend="gloo", master_port=1, rank_offset=5, world_size=6).src_rank == 0
    assert InitInfo(backend="gloo", master_port=1, rank_offset=0, world_size=3).src_rank == 2
    with pytest.raises(WeightUpdateError, match="rank_offset"):
        InitInfo(backend="gloo", master_port=1, rank_offset=6, world_size=6).validate()


def test_server_checks_its_workers_fit_after_rank_offset():
    import asyncio

    from rlserve.transfer.server.manager import WeightTransferManager

    class Cfg:
        tensor_parallel_size, data_parallel_size = 2, 1

    class Eng:
        config = Cfg()

    m = WeightTransferManager(Eng(), {"backend": "gloo"})
    base = {"backend": "gloo", "master_address": "127.0.0.1", "master_port": 1}
    with pytest.raises(WeightUpdateError, match="exceeds init_info.world_size 4"):
        asyncio.run(m.init_engine({**base, "rank_offset": 3, "world_size": 4}))  # workers 3 and 4 of 0..3
    with pytest.raises(WeightUpdateError, match="exceeds init_info.world_size 2"):
        asyncio.run(m.init_engine({**base, "rank_offset": 1, "world_size": 2, "shared_group": True}))
    with pytest.raises(WeightUpdateError, match="world_size must be 3"):  # one server: the strict check
        asyncio.run(m.init_engine({**base, "rank_offset": 1, "world_size": 5}))
    with pytest.raises(WeightUpdateError, match="world_size must be 3"):
        asyncio.run(m.init_engine({**base, "rank_offset": 0, "world_size": 4}))  # TRL's layout: this server only
    with pytest.raises(WeightUpdateError, match="shared_group needs the trainer on rank 0"):
        asyncio.run(m.init_engine({**base, "rank_offset": 0, "world_size": 4, "shared_group": True}))
