"""Direct receive through the real control plane (:mod:`tests.transfer_sync`): packed updates
received straight into the parameters of a CPU model once they are laid out like the buckets,
equal to the trainer's weights; partial updates between full ones; an abandoned direct receive
cannot write into the model later; direct receive off, and not taken for checksums announced
before the data."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rlserve.transfer import HTTPWeightSyncClient, ModuleSource, WeightSyncHTTPError, hf_state_checksums
from tests.transfer_harness import InProcessServer, wait_buckets_done, wrong_second_bucket_sum
from tests.transfer_sync import (  # noqa: F401 (llama384: a fixture)
    PROMPT_IDS,
    StallingSource,
    checksums,
    direct_trainer,
    hf_greedy,
    llama384,
    server_greedy,
    trainer,
)


def test_direct_receive_matches_hf_and_fails_safely(llama384, shared, monkeypatch):
    """In place on a CPU model: the first packed update goes through the receive buffers and lays
    the parameters out like the buckets; the next ones land straight in them. Outputs and
    checksums equal the trainer's after each; a wrong checksum sent after the data fails the
    update (503 until a full one lands), and the next full update is direct again."""

    import rlserve.transfer.server.direct as direct

    copied = []  # the layout's own copies (the first update is received into the layout's buffer: none)
    real_copy = direct.host_copy_many
    monkeypatch.setattr(direct, "host_copy_many", lambda pairs, *a, **k: (copied.append(len(pairs)),
                                                                          real_copy(pairs, *a, **k)))
    path, hf = llama384
    with shared(path, fresh=True) as srv:  # no layout yet: its first update lays the parameters out
        eng = trainer(srv.url, hf)
        g = torch.Generator().manual_seed(0)
        base = {n: p.detach().clone() for n, p in hf.named_parameters()}
        for v in range(1, 4):
            with torch.no_grad():
                for n, p in hf.named_parameters():
                    p.copy_(base[n] + 0.05 * torch.randn(p.shape, generator=g))
            assert eng.send_weights()["weight_version"] == str(v)
            stats = eng.last_stats["server"]
            assert stats["direct_receive"] is (v > 1), stats
            assert copied == [], copied
            if v == 1:  # received into the flat buffer that became the layout: no round-robin buffers
                assert stats["worker_phases_s"]["receive_load"] > 0, stats
            if v > 1:
                assert stats["replayed_loads"] == 0  # no load copy at all
            expected = [hf_greedy(hf, p) for p in PROMPT_IDS]
            assert len({t for e in expected for t in e}) > 3
            assert server_greedy(srv.url).json()["completion_ids"] == expected
            mine = hf_state_checksums(ModuleSource(hf).named_tensors(), torch.float32)
            assert checksums(srv.url) == mine
        good = checksums(srv.url)
        wrong_second_bucket_sum(monkeypatch)
        with pytest.raises(WeightSyncHTTPError) as ei:
            eng.send_weights()
        assert ei.value.status_code == 500 and "after the data" in str(ei.value)
        r = server_greedy(srv.url)
        assert r.status_code == 503 and "full weight update" in r.json()["error"]["message"]
        monkeypatch.undo()
        eng.send_weights()  # re-initialises the group; the layout of the parameters is kept
        assert eng.last_stats["server"]["direct_receive"] is True
        assert checksums(srv.url) == good
        assert server_greedy(srv.url).json()["completion_ids"] == expected
        eng.shutdown()


def test_partial_updates_between_full_ones(llama384, shared):
    """Partial updates (``ModuleSource(include=...)``, ``send_weights(partial=True)``) change only
    the parameters they carry; after each one the server's checksums and greedy tokens equal the
    trainer's. They take the buffered path and leave the parameters laid out for the full
    update, so every full update after the first two is received directly."""
    path, hf = llama384
    with shared(path) as srv:
        eng = direct_trainer(srv.url, hf)
        g = torch.Generator().manual_seed(3)
        for step in range(2):
            with torch.no_grad():
                for n, p in hf.named_parameters():
                    if ".layers.0." in n:
                        p.add_(0.2 * torch.randn(p.shape, generator=g))
            before = checksums(srv.url)
            eng.source = ModuleSource(hf, include=lambda n: ".layers.0." in n)
            eng.send_weights(partial=True)
            stats = eng.last_stats["server"]
            assert stats["direct_receive"] is False and 0 < stats["tensors"] < len(before), stats
            after = checksums(srv.url)
            changed = {n for n in after if after[n] != before[n]}
            assert changed and all(".layers.0." in n for n in changed), changed
            assert after == hf_state_checksums(ModuleSource(hf).named_tensors(), torch.float32)
            assert server_greedy(srv.url).json()["completion_ids"] == [hf_greedy(hf, p) for p in PROMPT_IDS]
            with torch.no_grad():
                for p in hf.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=g))
            eng.source = ModuleSource(hf)
            eng.send_weights()
            assert eng.last_stats["server"]["direct_receive"] is True, (step, eng.last_stats["server"])
            assert checksums(srv.url) == hf_state_checksums(ModuleSource(hf).named_tensors(), torch.float32)
            assert server_greedy(srv.url).json()["completion_ids"] == [hf_greedy(hf, p) for p in PROMPT_IDS]
        eng.shutdown()


def test_direct_receive_abandoned_update_cannot_write_later(llama384, shared):
    """The server gives up on a direct receive while the trainer is alive (shutdown mid-update):
    the broadcasts it had posted into the parameters stay pending in gloo. The trainer then
    sends the next bucket anyway; it must land in the abandoned buffer, not in the model."""
    from rlserve.transfer.wire.packing import plan_buckets

    path, hf = llama384
    with shared(path) as srv:
        eng = direct_trainer(srv.url, hf)
        good = checksums(srv.url)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g))  # every byte of this update differs
        meta = ModuleSource(hf).metadata()
        plan = plan_buckets([m[0] for m in meta], [m[1] for m in meta], [m[2] for m in meta], 64 << 10)
        assert len(plan) >= 4
        src = StallingSource(hf, stall_at=plan[3].slots[0].index)  # buckets 0-2 sent, then a stall
        eng.source = src
        err: list = []

        def send():
            try:
                eng.send_weights()
            except Exception as e:  # noqa: BLE001 - expected: the server gave up
                err.append(repr(e))

        t = threading.Thread(target=send)
        t.start()
        try:
            assert src.reached.wait(300)
            # buckets 0-2 landed (a state: a sleep here let a loaded machine abort before any had)
            wait_buckets_done(srv.url, 3)
            eng.client.shutdown_weight_transfer_engine()  # the server gives up mid-update
            assert server_greedy(srv.url).status_code == 503
            after_abort = checksums(srv.url)
            assert after_abort != good  # buckets 0-2 were loaded in place
        finally:
            src.go.set()  # the trainer packs and posts bucket 3 into the old group, then sees the failure
        t.join(60)
        assert err and not t.is_alive()
        time.sleep(0.5)
        assert checksums(srv.url) == after_abort  # nothing landed in the model afterwards
        eng.source = ModuleSource(hf)
        eng.send_weights()  # a full update: the buffered path, which lays the parameters out again
        assert eng.last_stats["server"]["direct_receive"] is False
        eng.send_weights()
        assert eng.last_stats["server"]["direct_receive"] is True
        assert checksums(srv.url) == hf_state_checksums(ModuleSource(hf).named_tensors(), torch.float32)
        assert server_greedy(srv.url).json()["completion_ids"] == [hf_greedy(hf, p) for p in PROMPT_IDS]
        eng.shutdown()


def test_direct_receive_off_and_not_for_announced_checksums(llama384, shared):
    path, hf = llama384
    with InProcessServer(path, transfer_config={"backend": "gloo", "direct_receive": False}) as srv:
        eng = trainer(srv.url, hf)
        for _ in range(2):
            eng.send_weights()
        assert eng.last_stats["server"]["direct_receive"] is False
        assert eng.last_stats["server"]["replayed_loads"] > 0
        eng.shutdown()
    with shared(path) as srv:
        # checksums announced before the data must be compared before anything is loaded
        c = HTTPWeightSyncClient(srv.url, timeout_s=30)
        eng = direct_trainer(srv.url, hf)
        eng._checksums_after_data = lambda info: False  # vLLM style: bucket checksums announced
        eng.send_weights()
        assert eng.last_stats["server"]["direct_receive"] is False
        assert server_greedy(srv.url).json()["completion_ids"] == [hf_greedy(hf, p) for p in PROMPT_IDS]
        eng.init_info.checksums = False  # no checksums at all: direct again
        eng.send_weights()
        assert eng.last_stats["server"]["direct_receive"] is True
        assert checksums(srv.url) == hf_state_checksums(ModuleSource(hf).named_tensors(), torch.float32)
        eng.shutdown()
        assert c.weight_info()["state"] == "uninitialized"
    from rlserve.transfer.server.manager import WeightTransferManager

    with pytest.raises(ValueError, match="direct_receive"):
        WeightTransferManager(None, {"backend": "gloo", "direct_receive": "yes"})
