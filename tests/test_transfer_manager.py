"""Weight sync through the real control plane, in one process: AsyncEngine + LLMEngine (tiny
model, CPU, dummy weights) + the real FastAPI app on a uvicorn thread; the trainer SDK talks
HTTP to it and broadcasts over gloo from the test thread. The server-process end-to-end tests
are in test_transfer_e2e.py.

A server start is most of a test's time on 2 cores, so the tests share one server per (model,
staging) (:func:`shared`); a test with a server setting of its own (admin key, data
parallelism, a transfer config) starts its own. A test on a shared server reads the weight
version and counters it starts from and asserts relative to them, and makes the server's
weights differ from its trainer's first where it asserts that a sync changed them
(:func:`scramble`)."""

from __future__ import annotations

import contextlib
import re
import threading
import time

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlserve.transfer import (
    GlooTrainerInitInfo,
    HTTPWeightSyncClient,
    ModuleSource,
    TensorListSource,
    WeightSyncConflictError,
    WeightSyncHTTPError,
    WeightTransferTrainerFactory,
    hf_state_checksums,
)
from rlserve.transfer.sdk.trl import TRLWeightSyncClient
from tests.transfer_harness import (
    InProcessServer,
    free_port,
    greedy_continuation,
    load_hf,
    wrong_second_bucket_sum,
)

PROMPT_IDS = [[5, 17, 42, 9, 77, 3], [100, 101, 7]]
N_TOK = 6


def hf_greedy(model, prompt_ids, n=N_TOK):
    return greedy_continuation(model, prompt_ids, n)


def server_greedy(url, prompt_ids=PROMPT_IDS, n=N_TOK):
    r = httpx.post(url + "/generate/", json={"prompt_ids": prompt_ids, "max_tokens": n, "temperature": 0,
                                             "generation_kwargs": {"ignore_eos": True}}, timeout=60)
    return r


def checksums(url):
    r = httpx.post(url + "/weight_checker", json={}, timeout=60)
    r.raise_for_status()
    return r.json()["checksums"]


@pytest.fixture(scope="module")
def llama(tiny_model):
    path = tiny_model("llama")
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


#: The shared servers' settings: max_model_len 256 for the request that runs through a failed
#: update (test_failed_in_place_update_ends_requests_in_flight), else InProcessServer's.
SHARED_KW = {"max_model_len": 256}


@pytest.fixture(scope="module")
def shared():
    """``with shared(path, staging="none", fresh=False) as srv``: the module's
    :class:`InProcessServer` for ``(path, staging)``, started on first use and stopped at the
    module's end (not at the ``with``'s).

    Each hand-out first shuts the transfer engine down (every test starts from
    ``state == "uninitialized"``, as on a new server); a server left paused or unavailable (a
    test that failed half way) is replaced by a new one, so one failure does not spread.
    ``fresh=True``: a server no test has used yet (a used one is replaced), for a test that
    needs a new server's state (weight version "0", no direct-receive layout)."""
    started: dict = {}

    def get(path, staging="none", fresh=False):
        srv = started.get((path, staging))
        if srv is not None:
            HTTPWeightSyncClient(srv.url, timeout_s=30).shutdown_weight_transfer_engine()
            if fresh or srv.aengine.is_paused() or srv.aengine.unavailable_reason is not None:
                srv.close()
                srv = None
        if srv is None:
            srv = started[path, staging] = InProcessServer(path, staging=staging, **SHARED_KW)
        return contextlib.nullcontext(srv)  # `with shared(path) as srv:` does not stop it

    yield get
    for srv in started.values():
        srv.close()


def version(url) -> str:
    """The server's current weight version."""
    return httpx.get(url + "/weight_info", timeout=30).json()["weight_version"]


def bumped(weight_version: str, n: int = 1) -> str:
    """``weight_version`` after ``n`` syncs that name no version: the server adds ``n`` to its
    trailing number (``"7"`` -> ``"8"``, ``"step-7"`` -> ``"step-8"``)."""
    head, num = re.fullmatch(r"(.*?)(\d+)", weight_version).groups()
    return f"{head}{int(num) + n}"


def scramble(url, path):
    """One full sync of other weights than any trainer model of this module pushes (the tiny
    checkpoint plus noise of a seed no test uses), so that a test's own sync visibly changes
    the server's outputs and checksums, as the dummy weights of a new server would. The
    trainer engine is shut down afterwards (``state == "uninitialized"``)."""
    eng = trainer(url, load_hf(path, scale=0.5, seed=1234))
    eng.send_weights()
    eng.shutdown()


def direct_trainer(url, hf):
    """A trainer engine that has synced twice: the second sync was received directly."""
    eng = trainer(url, hf)
    eng.send_weights()
    eng.send_weights()
    assert eng.last_stats["server"]["direct_receive"] is True
    return eng


def trainer(url, model_or_source, **kw):
    src = model_or_source if hasattr(model_or_source, "named_tensors") else ModuleSource(model_or_source)
    kw.setdefault("timeout_s", 20)
    kw.setdefault("packed_buffer_size_bytes", 64 << 10)  # several buckets for the tiny model
    return WeightTransferTrainerFactory.trainer_init(
        init_info=GlooTrainerInitInfo(master_port=free_port(), world_size=2, **kw),
        client=HTTPWeightSyncClient(url, timeout_s=30), source=src)


@pytest.mark.parametrize("staging,packed", [("none", True), ("none", False), ("device", True), ("host", True)])
def test_sync_matches_hf_and_checksums(llama, shared, staging, packed):
    path, hf = llama
    own = staging == "host"  # the only test with host staging: a server of its own
    with InProcessServer(path, staging=staging, **SHARED_KW) if own else shared(path, staging) as srv:
        scramble(srv.url, path)
        v0, updates0 = version(srv.url), httpx.get(srv.url + "/weight_info").json()["num_updates"]
        before = server_greedy(srv.url).json()
        assert before["weight_version"] == v0
        eng = trainer(srv.url, hf, packed=packed)
        fin = eng.send_weights()
        assert fin["weight_version"] == bumped(v0) and fin["full"] is True
        after = server_greedy(srv.url).json()
        assert after["completion_ids"] == [hf_greedy(hf, p) for p in PROMPT_IDS]
        assert after["completion_ids"] != before["completion_ids"]  # the scrambled weights were different
        assert after["weight_version"] == bumped(v0)
        mine = hf_state_checksums(ModuleSource(hf).named_tensors(), torch.float32)
        rep = eng.client.weight_checker(compare=mine)
        assert rep["compare"]["match"] and rep["compare"]["compared"] == len(mine), rep["compare"]
        # an explicit version, and the stats
        fin = eng.send_weights(weight_version="step-7")
        assert fin["weight_version"] == "step-7"
        assert server_greedy(srv.url).json()["weight_version"] == "step-7"
        assert eng.send_weights()["weight_version"] == "step-8"
        info = httpx.get(srv.url + "/weight_info").json()
        assert info["state"] == "ready" and info["num_updates"] == updates0 + 3 and info["last_update"]["ok"]
        assert not srv.aengine.is_paused()
        eng.shutdown()
        assert httpx.get(srv.url + "/weight_info").json()["state"] == "uninitialized"


def _named(hf):
    return [(n, t.clone()) for n, t in ModuleSource(hf).named_tensors()]


@pytest.mark.parametrize("case", ["unknown", "shape", "dtype", "missing"])
def test_bad_metadata_refused_before_any_change(llama, shared, case):
    path, hf = llama
    named = _named(hf)
    if case == "unknown":
        named.append(("model.layers.0.mlp.extra.weight", torch.zeros(3)))
    elif case == "shape":
        named[1] = (named[1][0], torch.zeros(named[1][1].shape[0] + 1, *named[1][1].shape[1:]))
    elif case == "dtype":
        named[2] = (named[2][0], torch.zeros(named[2][1].shape, dtype=torch.int32))
    else:
        named = named[:-3]
    with shared(path) as srv:
        scramble(srv.url, path)
        v0 = version(srv.url)
        base = checksums(srv.url)
        eng = trainer(srv.url, TensorListSource(named))
        with pytest.raises(WeightSyncHTTPError) as ei:
            eng.send_weights()
        assert ei.value.status_code == 400, ei.value
        assert {"unknown": "unknown parameter", "shape": "shape", "dtype": "not a float type",
                "missing": "missing 3 required"}[case] in str(ei.value)
        assert checksums(srv.url) == base
        assert httpx.get(srv.url + "/weight_info").json()["weight_version"] == v0
        assert server_greedy(srv.url).status_code == 200  # not paused, not unavailable
        # the refusal came before any data moved: the same group still works for a good update
        eng.source = ModuleSource(hf)
        assert eng.send_weights()["weight_version"] == bumped(v0)
        assert checksums(srv.url) != base
        # a raw vLLM-style bad update_weights (no declaration) is refused too, nothing changes
        c = eng.client
        c.start_weight_update()
        after = checksums(srv.url)
        with pytest.raises(WeightSyncHTTPError) as ei:
            c.update_weights({"names": ["nope"], "dtype_names": ["float32"], "shapes": [[1]]})
        assert ei.value.status_code == 400 and "torn down" in str(ei.value)
        assert checksums(srv.url) == after
        assert server_greedy(srv.url).status_code == 200


def test_out_of_order_calls_409(llama, shared):
    path, hf = llama
    with shared(path) as srv:
        v0 = version(srv.url)
        c = HTTPWeightSyncClient(srv.url, timeout_s=10)
        with pytest.raises(WeightSyncConflictError, match="init_weight_transfer_engine"):
            c.start_weight_update()
        with pytest.raises(WeightSyncConflictError):
            c.update_weights({"names": [], "dtype_names": [], "shapes": []})
        with pytest.raises(WeightSyncConflictError, match="without start"):
            c.finish_weight_update()
        eng = trainer(srv.url, hf)
        with pytest.raises(WeightSyncConflictError, match="without start_weight_update"):
            c.update_weights({"names": [], "dtype_names": [], "shapes": [], "partial": True})
        with pytest.raises(WeightSyncConflictError, match="without start"):
            c.finish_weight_update()
        c.start_weight_update()
        with pytest.raises(WeightSyncConflictError, match="twice"):
            c.start_weight_update()
        assert srv.aengine.is_paused()  # in-place mode: the server paused for the update
        c.finish_weight_update()  # an empty update: just a version bump
        assert not srv.aengine.is_paused()
        # bad JSON shapes -> 400, not 500
        r = httpx.post(srv.url + "/init_weight_transfer_engine", json={"init_info": {"backend": "nccl"}})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = httpx.post(srv.url + "/init_weight_transfer_engine", json={"init_info": {"backend": "gloo",
                                                                                     "master_port": 1, "world_size": 5}})
        assert r.status_code == 400 and "world_size must be 2" in r.json()["error"]["message"]
        assert eng.send_weights()["weight_version"] == bumped(v0, 2)
        # a second call while update_weights runs -> 409; shutdown aborts the running one
        import threading

        c.start_weight_update()
        meta = ModuleSource(hf).metadata()
        body = {"names": [m[0] for m in meta], "dtype_names": ["float32"] * len(meta),
                "shapes": [list(m[2]) for m in meta]}
        first = {}
        th = threading.Thread(target=lambda: first.setdefault("r", httpx.post(
            srv.url + "/update_weights", json={"update_info": body}, timeout=60)))
        th.start()
        deadline = time.monotonic() + 10
        while httpx.get(srv.url + "/weight_info").json()["state"] != "update" and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(WeightSyncConflictError, match="still running"):
            c.update_weights(body)
        with pytest.raises(WeightSyncConflictError, match="still running"):
            c.finish_weight_update()
        t0 = time.monotonic()
        c.shutdown_weight_transfer_engine()
        th.join(30)
        assert time.monotonic() - t0 < 10
        assert first["r"].status_code == 500, first["r"].text  # aborted, nothing was loaded
        assert httpx.get(srv.url + "/weight_info").json()["state"] == "uninitialized"
        assert server_greedy(srv.url).status_code == 200 and not srv.aengine.is_paused()


class FlakySource:
    """Yields the model's tensors; from the ``corrupt_pass``-th pass on, one tensor differs
    (so the checksums announced from the first pass do not match the data)."""

    def __init__(self, hf, corrupt_pass=2):
        self.inner = ModuleSource(hf)
        self.passes = 0
        self.corrupt_pass = corrupt_pass

    def metadata(self):
        return self.inner.metadata()

    def named_tensors(self):
        self.passes += 1
        for i, (n, t) in enumerate(self.inner.named_tensors()):
            if self.passes >= self.corrupt_pass and i == 5:
                t = t.clone()
                t.view(-1)[0] += 1.0
            yield n, t


@pytest.mark.parametrize("staging,mode", [("none", "after_data"), ("device", "after_data"),
                                          ("none", "announced"), ("device", "announced")])
def test_checksum_mismatch_fails_safely_then_recovers(llama, shared, staging, mode, monkeypatch):
    """A checksum that disagrees with the data fails the update, whether it was announced before
    the data (unpacked: per tensor, from a first pass over a source whose data then changes) or
    sent after it (packed, the SDK's default: the trainer's second bucket sum is made wrong): the
    group is torn down; in place the server answers 503 (what came before was loaded), staged it
    keeps the old weights; the next full sync restores everything."""

    path, hf = llama
    with shared(path, staging) as srv:
        failures0 = httpx.get(srv.url + "/weight_info").json()["num_failures"]
        good = trainer(srv.url, hf)
        good.send_weights()
        base = checksums(srv.url)
        good.shutdown()
        if mode == "announced":
            eng = trainer(srv.url, FlakySource(hf), packed=False)
        else:
            calls = wrong_second_bucket_sum(monkeypatch)
            eng = trainer(srv.url, hf)
        t0 = time.monotonic()
        with pytest.raises(WeightSyncHTTPError) as ei:
            eng.send_weights()
        assert time.monotonic() - t0 < 15
        assert ei.value.status_code == 500 and "checksum" in str(ei.value)
        info = httpx.get(srv.url + "/weight_info").json()
        assert info["state"] == "uninitialized" and info["num_failures"] == failures0 + 1
        assert not srv.aengine.is_paused()
        r = server_greedy(srv.url)
        if staging == "none":
            # bucket 0 (before the corrupt tensor) was loaded in place: never serve mixed weights
            assert r.status_code == 503 and "full weight update" in r.json()["error"]["message"]
        else:
            assert r.status_code == 200 and checksums(srv.url) == base  # old weights kept
        if mode == "after_data":
            assert len(calls) > 2 and "after the data" in str(ei.value)
        # a fresh init (automatic on the next send) and a full sync bring everything back
        monkeypatch.undo()
        eng.source = ModuleSource(hf)
        eng.send_weights()
        assert server_greedy(srv.url).status_code == 200
        assert checksums(srv.url) == base




@pytest.fixture(scope="module")
def llama384(tiny_model):
    """A tiny llama whose vocabulary (384) needs no padding rows: its loads are byte copies, so
    packed updates can be received straight into the parameters (rlserve.transfer.server.direct)."""
    path = tiny_model("llama", vocab_size=384)
    return path, load_hf(path, seed=1)  # less degenerate greedy outputs


def test_direct_receive_matches_hf_and_fails_safely(llama384, shared, monkeypatch):
    """In place on a CPU model: the first packed update goes through the receive buffers and lays
    the parameters out like the buckets; the next ones land straight in them. Outputs and
    checksums equal the trainer's after each; a wrong checksum sent after the data fails the
    update (503 until a full one lands), and the next full update is direct again."""

    path, hf = llama384
    with shared(path, fresh=True) as srv:  # no layout yet: its first update takes the buffers
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


class StallingSource:
    """The model's tensors; before yielding the ``stall_at``-th one it sets ``reached`` and waits
    for ``go`` (the trainer then has some buckets on the wire and the rest still to send)."""

    def __init__(self, hf, stall_at: int):
        self.inner = ModuleSource(hf)
        self.stall_at = stall_at
        self.reached, self.go = threading.Event(), threading.Event()

    def metadata(self):
        return self.inner.metadata()

    def named_tensors(self):
        for i, (n, t) in enumerate(self.inner.named_tensors()):
            if i == self.stall_at:
                self.reached.set()
                self.go.wait(30)
            yield n, t


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
        assert src.reached.wait(30)
        time.sleep(0.5)  # buckets 0-2 land
        eng.client.shutdown_weight_transfer_engine()  # the server gives up mid-update
        assert server_greedy(srv.url).status_code == 503
        after_abort = checksums(srv.url)
        assert after_abort != good  # buckets 0-2 were loaded in place
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


def test_failed_in_place_update_ends_requests_in_flight(llama, shared):
    """An in-place update that fails after loading some buckets: the request that was running
    (frozen by the update's pause) and the one held by that pause both end with 503, not with
    text from part-old, part-new weights. While the update is open, /resume and
    /pause?mode=wait (which would step the model) are refused with 409; an abort-free keep pause
    is taken. A full sync then serves again."""
    from rlserve.transfer.wire.packing import plan_buckets

    path, hf = llama
    with shared(path) as srv:  # max_model_len 256 (SHARED_KW)
        eng = trainer(srv.url, hf)
        eng.send_weights()
        meta = ModuleSource(hf).metadata()
        plan = plan_buckets([m[0] for m in meta], [m[1] for m in meta], [m[2] for m in meta], 64 << 10)
        src = StallingSource(hf, stall_at=plan[2].slots[0].index)  # buckets 0-1 land in place
        results: dict = {}

        def complete(key):
            results[key] = httpx.post(srv.url + "/v1/completions", timeout=120, json={
                "prompt": [5, 6, 7], "max_tokens": 250, "temperature": 0, "ignore_eos": True})

        running = threading.Thread(target=complete, args=("running",))
        running.start()
        deadline = time.monotonic() + 30
        while srv.aengine.num_unfinished < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        eng.source = src
        sent: list = []

        def send():
            try:
                eng.send_weights()
                sent.append("no error")
            except Exception as e:  # noqa: BLE001 - expected: the server gave up on this update
                sent.append(e)

        sender = threading.Thread(target=send)
        sender.start()
        assert src.reached.wait(30)
        assert srv.aengine.is_paused() and srv.aengine.num_unfinished == 1, "the long request ended too early"
        held = threading.Thread(target=complete, args=("held",))
        held.start()
        while srv.aengine.num_held < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        for route in ("/resume", "/pause?mode=wait"):
            r = httpx.post(srv.url + route, timeout=30)
            assert r.status_code == 409 and "in progress in place" in r.json()["error"]["message"], r.text
        assert srv.aengine.is_paused()
        eng.client.shutdown_weight_transfer_engine()  # the update fails with buckets 0-1 loaded
        src.go.set()
        for t in (running, held, sender):
            t.join(60)
        assert len(sent) == 1 and isinstance(sent[0], WeightSyncHTTPError), sent  # the sync failed
        for key in ("running", "held"):
            r = results[key]
            assert r.status_code == 503 and "full weight update" in r.json()["error"]["message"], (key, r.text)
        assert server_greedy(srv.url).status_code == 503
        assert not srv.aengine.is_paused()
        eng.source = ModuleSource(hf)
        eng.send_weights()
        assert server_greedy(srv.url).json()["completion_ids"] == [hf_greedy(hf, p) for p in PROMPT_IDS]
        eng.shutdown()
    # the abandoned groups' teardown waits for their pending operations (up to timeout_s): let it
    # end here, not in the interpreter's exit
    for th in threading.enumerate():
        if th.name == "transfer-teardown":
            th.join(40)


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


def test_idle_session_is_abandoned(llama, shared):
    path, hf = llama
    with shared(path) as srv:
        eng = trainer(srv.url, hf, timeout_s=1.0)
        eng.client.start_weight_update()
        assert srv.aengine.is_paused()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and httpx.get(srv.url + "/weight_info").json()["state"] != "uninitialized":
            time.sleep(0.1)
        assert not srv.aengine.is_paused()  # the watchdog resumed generation
        assert server_greedy(srv.url).status_code == 200  # nothing was loaded: still available


def test_trl_protocol(llama, shared):
    path, hf = llama
    with shared(path) as srv:
        scramble(srv.url, path)
        v0 = version(srv.url)
        base = checksums(srv.url)
        c = TRLWeightSyncClient(srv.url, group_port=free_port(), timeout_s=20)
        c.init_communicator()
        c.update_model_params(hf)
        c.reset_prefix_cache()  # lands the queued tensors before it answers
        assert server_greedy(srv.url).json()["completion_ids"] == [hf_greedy(hf, p) for p in PROMPT_IDS]
        mine = hf_state_checksums(ModuleSource(hf).named_tensors(), torch.float32)
        assert checksums(srv.url) == mine != base
        with pytest.raises(WeightSyncHTTPError) as ei:  # bad name: refused before the broadcast
            c.http.update_named_param("nope.weight", "torch.float32", [2])
        assert ei.value.status_code == 400
        c.close_communicator()  # flushes: the batch is committed with a new version
        info = httpx.get(srv.url + "/weight_info").json()
        assert info["state"] == "uninitialized" and info["weight_version"] == bumped(v0), info
        assert info["last_update"]["ok"] and info["last_update"]["full"]


def test_admin_key_protects_weight_routes(llama):
    path, hf = llama
    with InProcessServer(path, admin_key="s3cret") as srv:
        for method, route in [("get", "/weight_info"), ("post", "/start_weight_update"),
                              ("post", "/init_weight_transfer_engine"), ("post", "/init_communicator/"),
                              ("post", "/weight_checker")]:
            r = getattr(httpx, method)(srv.url + route, **({"json": {}} if method == "post" else {}))
            assert r.status_code == 401, (route, r.status_code)
        with pytest.raises(WeightSyncHTTPError) as ei:
            HTTPWeightSyncClient(srv.url).weight_info()
        assert ei.value.status_code == 401
        eng = WeightTransferTrainerFactory.trainer_init(
            init_info=GlooTrainerInitInfo(master_port=free_port(), world_size=2, timeout_s=20),
            client=HTTPWeightSyncClient(srv.url, admin_key="s3cret"), source=ModuleSource(hf))
        assert eng.send_weights()["weight_version"] == "1"


def test_data_parallel_two_replicas(llama):
    """DP=2: both replicas' workers are ranks 1 and 2 of the group; both get the weights."""
    path, hf = llama
    with InProcessServer(path, data_parallel_size=2) as srv:
        eng = WeightTransferTrainerFactory.trainer_init(
            init_info=GlooTrainerInitInfo(master_port=free_port(), world_size=3, timeout_s=20,
                                          packed_buffer_size_bytes=64 << 10),
            client=HTTPWeightSyncClient(srv.url), source=ModuleSource(hf))
        eng.send_weights()
        rep = eng.client.weight_checker(compare=hf_state_checksums(ModuleSource(hf).named_tensors(), torch.float32))
        assert rep["replicas"] == 2 and rep["replicas_consistent"] and rep["compare"]["match"]
        for _ in range(3):  # requests land on both replicas
            assert server_greedy(srv.url).json()["completion_ids"] == [hf_greedy(hf, p) for p in PROMPT_IDS]


def test_finished_op_answers_until_forgotten():
    """With data parallelism the manager polls every replica until all are done: a replica that
    finished first must keep answering its result (not "unknown op") until ``forget``."""
    from types import SimpleNamespace

    from rlserve.transfer.server import worker_ext

    worker = SimpleNamespace(extension_state={})
    st = worker_ext._state(worker)
    worker_ext._submit(st, "op1", "test", lambda op: {"x": 1})
    first = worker_ext.poll(worker, "op1", wait_s=5)
    again = worker_ext.poll(worker, "op1")
    assert first["done"] and first["ok"] and first["result"] == {"x": 1}
    assert again["ok"] and again["result"] == {"x": 1}
    worker_ext.forget(worker, "op1")
    gone = worker_ext.poll(worker, "op1")
    assert gone["done"] and not gone["ok"] and gone["error_type"] == "TransferAbortedError"


def test_sync_weights_one_call(llama, shared):
    """``POST /sync_weights``: start + update + finish in one call (the broadcast runs while it
    is open, as with update_weights); same result and version as the three calls; a refused
    body is a 400 that leaves no session open."""
    import concurrent.futures as cf

    from rlserve.transfer.sdk.sender import send_packed

    path, hf = llama
    with shared(path) as srv:
        eng = trainer(srv.url, hf)
        info = eng._metadata_info(False)
        info.checksums = eng._checksum_pass(info)
        with cf.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(eng.client.sync_weights, info.to_dict(), "one-call-7")
            send_packed(eng.group, info, ModuleSource(hf).named_tensors(), torch.device("cpu"))
            fin = fut.result(timeout=60)
        assert fin["weight_version"] == "one-call-7" and fin["full"] is True
        assert fin["update"]["tensors"] == len(info.names) and fin["update"]["bytes"] > 0
        assert server_greedy(srv.url).json()["completion_ids"] == [hf_greedy(hf, p) for p in PROMPT_IDS]
        assert httpx.get(srv.url + "/weight_info").json()["state"] == "ready"
        assert not srv.aengine.is_paused()
        for body, msg in (({"update_info": "x"}, "update_info"), ([], "JSON object")):
            r = httpx.post(srv.url + "/sync_weights", json=body, timeout=30)
            assert r.status_code == 400 and msg in r.json()["error"]["message"], r.text
        bad = {**info.to_dict(), "names": ["no.such.weight"] + info.names[1:]}
        r = httpx.post(srv.url + "/sync_weights", json={"update_info": bad}, timeout=30)
        assert r.status_code == 400 and "unknown parameter" in r.json()["error"]["message"]
        st = httpx.get(srv.url + "/weight_info").json()
        assert st["session"] is None and not srv.aengine.is_paused()
        assert server_greedy(srv.url).json()["weight_version"] == "one-call-7"
        eng.shutdown()


# --------------------------------------------------------------------------- found by an adversarial pass
@contextlib.contextmanager
def synced_server(shared, path, hf):
    """The shared server after one full sync: ``(server, trainer engine, client, the version
    before that sync)``."""
    with shared(path) as srv:
        v0 = version(srv.url)
        eng = trainer(srv.url, hf)
        eng.send_weights()
        yield srv, eng, HTTPWeightSyncClient(srv.url, timeout_s=30), v0


def test_sdk_reinitialises_after_the_server_dropped_its_engine(llama, shared):
    """The server's transfer engine goes away between two syncs (an operator's shutdown; the
    idle watchdog and a restart look the same): the next ``send_weights()`` gets 409
    ``no_transfer_engine`` at its start, joins again on its own and syncs."""
    path, hf = llama
    with synced_server(shared, path, hf) as (srv, eng, c, v0):
        c.shutdown_weight_transfer_engine()
        with pytest.raises(WeightSyncHTTPError) as ei:
            c.start_weight_update()
        assert ei.value.status_code == 409 and ei.value.code == "no_transfer_engine"
        assert eng.send_weights()["weight_version"] == bumped(v0, 2)
        assert checksums(srv.url) == hf_state_checksums(ModuleSource(hf).named_tensors(), torch.float32)
        eng.shutdown()


def test_control_route_inputs_refused_with_400(llama, shared):
    """Inputs that used to give 500 or wedge a session: a weight version of 5000 digits (its
    increment overflowed int()), one with control characters, a body nested 100000 deep, and a
    timeout that overflows the store. Each is a 400 and a bad version leaves the session open."""
    path, hf = llama
    with synced_server(shared, path, hf) as (srv, eng, c, _v0):
        c.start_weight_update()
        for bad in ("9" * 5000, "v\x001", ""):
            with pytest.raises(WeightSyncHTTPError) as ei:
                c.finish_weight_update(bad)
            assert ei.value.status_code == 400 and "weight_version" in ei.value.message, ei.value
            assert ("control characters" in ei.value.message) == ("\x00" in bad), ei.value.message
        r = httpx.post(srv.url + "/finish_weight_update", json={"weight_version": True}, timeout=30)
        assert r.status_code == 400 and "weight_version" in r.text, r.text  # not read as "1"
        assert c.finish_weight_update("9" * 200)["weight_version"] == "9" * 200  # still open
        c.start_weight_update()
        assert c.finish_weight_update()["weight_version"] == "1" + "0" * 200
        for route in ("/update_weights", "/sync_weights"):
            r = httpx.post(srv.url + route, content="[" * 100000 + "]" * 100000, timeout=30)
            assert r.status_code == 400 and "nested" in r.json()["error"]["message"], (route, r.text)
        r = httpx.post(srv.url + "/init_weight_transfer_engine", timeout=30, json={"init_info": {
            "master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2, "timeout_s": 1e308}})
        assert r.status_code == 400 and "timeout_s" in r.json()["error"]["message"], r.text
        for route in ("/init_weight_transfer_engine", "/init_communicator/", "/update_named_param/"):
            r = httpx.post(srv.url + route, timeout=30)  # no body at all
            assert r.status_code == 400 and r.json()["error"]["message"] == "the request needs a JSON body", r.text
        assert server_greedy(srv.url).status_code == 200
        eng.shutdown()


def test_close_communicator_during_an_update_releases_the_pause(llama, shared):
    """TRL's ``/close_communicator/`` while a start / update / finish session holds the server's
    keep-pause: the session fails (nothing was loaded: no 503), the pause is released and a
    new init + sync work."""
    path, hf = llama
    with synced_server(shared, path, hf) as (srv, eng, c, v0):
        c.start_weight_update()
        assert srv.aengine.is_paused()
        assert httpx.post(srv.url + "/close_communicator/", timeout=30).status_code == 200
        info = c.weight_info()
        assert info["state"] == "uninitialized" and not srv.aengine.is_paused(), info
        assert server_greedy(srv.url).status_code == 200
        assert eng.send_weights()["weight_version"] == bumped(v0, 2)
        eng.shutdown()


def test_trl_reset_reports_a_failed_transfer_as_504(llama):
    """TRL's ``/reset_prefix_cache/`` lands the queued tensors first; one that never arrives (the
    trainer announced it and never broadcast) is a timeout: 504, not a 400 'invalid request'."""
    path, _hf = llama
    with InProcessServer(path, transfer_config={"backend": "gloo", "timeout_s": 2}) as srv:
        trl = TRLWeightSyncClient(srv.url, group_port=free_port(), timeout_s=20)
        trl.init_communicator()
        trl.http.update_named_param("model.norm.weight", "torch.float32", [64])  # no broadcast follows
        r = httpx.post(srv.url + "/reset_prefix_cache/", timeout=60)
        assert r.status_code == 504 and r.json()["error"]["code"] == "weight_transfer_timeout", r.text
        trl.close_communicator()
        assert server_greedy(srv.url).status_code == 200  # nothing was loaded


def test_a_replaced_trainer_is_refused_without_harming_the_current_one(llama, shared):
    """Trainer B initialised, then trainer A (its init replaces B's group). B's next sync is
    refused at its start with 409 ``stale_session``: it neither pauses the server nor opens a
    session on A's group (which used to freeze generation for timeout_s and then tear A's group
    down). A syncs as before."""
    path, hf = llama
    with shared(path) as srv:
        v0 = version(srv.url)
        eng_b = trainer(srv.url, hf)
        eng_b.send_weights()
        eng_a = trainer(srv.url, hf)
        with pytest.raises(WeightSyncHTTPError) as ei:
            eng_b.send_weights()
        assert ei.value.status_code == 409 and ei.value.code == "stale_session", ei.value
        info = httpx.get(srv.url + "/weight_info").json()
        assert info["state"] == "ready" and not srv.aengine.is_paused(), info
        assert eng_a.send_weights()["weight_version"] == bumped(v0, 2)
        assert checksums(srv.url) == hf_state_checksums(ModuleSource(hf).named_tensors(), torch.float32)
        eng_a.shutdown()
        eng_b.shutdown()


def test_a_pending_init_is_cancelled_by_shutdown_and_by_a_newer_init(llama, shared):
    """An init whose trainer never joins used to hold the control plane until its timeout:
    ``/shutdown_weight_transfer_engine`` blocked for all of it and every other init got 409. Now
    both cancel it at once; the cancelled call answers 409 and names what cancelled it."""
    path, hf = llama
    with shared(path) as srv:
        out: dict = {}

        def bogus_init():
            out["r"] = httpx.post(srv.url + "/init_weight_transfer_engine", timeout=120, json={"init_info": {
                "master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2, "timeout_s": 30}})

        def pending() -> threading.Thread:
            th = threading.Thread(target=bogus_init)
            th.start()
            deadline = time.monotonic() + 60
            while httpx.get(srv.url + "/weight_info").json()["state"] != "init":
                assert time.monotonic() < deadline
                time.sleep(0.02)
            return th

        th = pending()
        t0 = time.monotonic()
        assert httpx.post(srv.url + "/shutdown_weight_transfer_engine", timeout=60).status_code == 200
        assert time.monotonic() - t0 < 25  # not the pending init's 30 s (a busy machine may take seconds)
        th.join(30)
        r = out["r"]
        assert r.status_code == 409 and "cancelled by shutdown" in r.json()["error"]["message"], r.text

        th = pending()
        t0 = time.monotonic()
        eng = trainer(srv.url, hf)  # its init cancels the pending one
        eng.send_weights()
        assert time.monotonic() - t0 < 25
        th.join(30)
        assert out["r"].status_code == 409 and "cancelled by a new init" in out["r"].json()["error"]["message"]
        assert checksums(srv.url) == hf_state_checksums(ModuleSource(hf).named_tensors(), torch.float32)
        eng.shutdown()
    for t in threading.enumerate():  # the abandoned rendezvous end at their own timeout (30 s)
        if t.name == "rlserve-transfer-rendezvous":
            t.join(60)


def test_data_that_disagrees_with_update_info_is_refused_with_400(llama, shared):
    """The trainer broadcasts buckets of another size than the update_info it sent (a bug in a
    custom trainer; with gloo a longer message than the receive buffer used to abort the whole
    server process): the layout header that starts the data is compared first, the update is
    refused with 400 naming both layouts, nothing was loaded (no 503, checksums unchanged), and
    the next correct sync re-initialises and works."""
    import copy

    path, hf = llama
    with shared(path) as srv:
        v0 = version(srv.url)
        eng = trainer(srv.url, hf)
        eng.send_weights()
        base = checksums(srv.url)
        honest = eng._send

        def lying(info, declared):
            other = copy.copy(info)
            other.packed_buffer_size_bytes = info.packed_buffer_size_bytes * 4
            return honest(other, declared)

        eng._send = lying
        with pytest.raises(WeightSyncHTTPError) as ei:
            eng.send_weights()
        assert ei.value.status_code == 400 and "does not match update_info" in ei.value.message, ei.value
        assert srv.aengine.unavailable_reason is None and not srv.aengine.is_paused()
        assert checksums(srv.url) == base and server_greedy(srv.url).status_code == 200
        eng._send = honest
        assert eng.send_weights()["weight_version"] == bumped(v0, 2)
        assert checksums(srv.url) == hf_state_checksums(ModuleSource(hf).named_tensors(), torch.float32)
        eng.shutdown()
