"""A weight sync that runs out of device memory (issue 36: s14's GPU benchmark got an HTTP 500 from a
``torch.OutOfMemoryError`` mid-sync): the answer is a 507 ``weight_update_out_of_memory`` with an
OpenAI-style body; staged, the served model is untouched and keeps serving; in place, generation
answers 503 until a full sync lands; a staging copy that cannot fit is refused before a byte moves.
CPU, gloo, the engine in this process (``engine_mode="thread"``) so that a fake allocation failure
can be injected into the worker's receive."""

from __future__ import annotations

import httpx
import pytest
import torch

from rlserve.transfer import WeightSyncHTTPError
from rlserve.transfer import finite
from rlserve.transfer.server import worker_ext, worker_load
from tests.transfer_harness import InProcessServer, load_hf
from tests.transfer_sync import PROMPT_IDS, checksums, hf_greedy, llama, server_greedy, trainer  # noqa: F401

OOM_MESSAGE = "CUDA out of memory. Tried to allocate 1.16 GiB (a fake failure of this test)"


def _fail_on_call(monkeypatch, module, name: str, n: int) -> list:
    """``module.name`` raises ``torch.OutOfMemoryError`` on its ``n``-th call (1-based), as an
    allocation inside it would; the calls are counted in the returned list."""
    real, calls = getattr(module, name), []

    def fake(*a, **k):
        calls.append(1)
        if len(calls) == n:
            raise torch.OutOfMemoryError(OOM_MESSAGE)
        return real(*a, **k)

    monkeypatch.setattr(module, name, fake)
    return calls


def _greedy(url) -> list:
    r = server_greedy(url)
    assert r.status_code == 200, r.text
    return r.json()["completion_ids"]


def _synced(srv, hf) -> tuple[dict, list]:
    """One full sync of ``hf`` into ``srv`` (trainer shut down after): the served checksums and the
    greedy tokens it must serve (``hf``'s)."""
    good = trainer(srv.url, hf)
    good.send_weights()
    good.shutdown()
    want = [hf_greedy(hf, p) for p in PROMPT_IDS]
    assert _greedy(srv.url) == want
    return checksums(srv.url), want


def _assert_507(ei, *words):
    e = ei.value
    assert e.status_code == 507 and e.code == "weight_update_out_of_memory", (e.status_code, e.code, str(e))
    for w in words:
        assert w in str(e), str(e)


@pytest.fixture
def server(llama):  # noqa: F811
    servers = []

    def start(staging):
        servers.append(InProcessServer(llama[0], staging=staging, engine_mode="thread", max_model_len=256))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def test_staged_sync_out_of_memory_mid_update_keeps_the_served_model(llama, server, monkeypatch):  # noqa: F811
    """``--weight-staging device``: the second bucket's staging copy fails to allocate: 507 naming the
    out-of-memory error, the served weights are the previous sync's bit for bit (checksums) and
    serve its greedy tokens; the next sync lands."""
    path, hf = llama
    srv = server("device")
    before, want = _synced(srv, hf)
    failures0 = httpx.get(srv.url + "/weight_info").json()["num_failures"]
    other = load_hf(path, scale=0.5, seed=7)
    calls = _fail_on_call(monkeypatch, worker_ext, "_stage", 2)
    eng = trainer(srv.url, other)
    with pytest.raises(WeightSyncHTTPError) as ei:
        eng.send_weights()
    _assert_507(ei, "OutOfMemoryError", "out of memory")
    assert len(calls) == 2  # failed mid-update: one bucket was staged before
    info = httpx.get(srv.url + "/weight_info").json()
    assert info["num_failures"] == failures0 + 1 and not srv.aengine.is_paused()
    assert checksums(srv.url) == before and _greedy(srv.url) == want
    monkeypatch.undo()
    eng.send_weights()  # re-initialises the torn-down group
    assert _greedy(srv.url) == [hf_greedy(other, p) for p in PROMPT_IDS]
    eng.shutdown()


def test_in_place_sync_out_of_memory_answers_507_then_503_until_a_full_sync(llama, server, monkeypatch):  # noqa: F811
    """In place (``--weight-staging none``): the second bucket's load fails to allocate after the first
    was written: 507; the half-updated model is never served (503) until a full sync lands."""
    path, hf = llama
    srv = server("none")
    calls = _fail_on_call(monkeypatch, worker_load, "_load", 2)
    eng = trainer(srv.url, hf)
    with pytest.raises(WeightSyncHTTPError) as ei:
        eng.send_weights()
    _assert_507(ei, "OutOfMemoryError")
    assert len(calls) == 2
    r = server_greedy(srv.url)
    assert r.status_code == 503 and "full weight update" in r.json()["error"]["message"]
    monkeypatch.undo()
    eng.send_weights()
    assert _greedy(srv.url) == [hf_greedy(hf, p) for p in PROMPT_IDS]
    eng.shutdown()


def test_a_staging_copy_that_cannot_fit_is_refused_before_a_byte_moves(llama, server, monkeypatch):  # noqa: F811
    """The worker's room check (:func:`worker_load.check_staging_room`; on CUDA the card's free memory,
    here a fake 1 KB of room): 507 saying what the copy needs, nothing staged, the served model
    unchanged and serving; with room the same trainer syncs."""
    path, hf = llama
    srv = server("device")
    before, want = _synced(srv, hf)
    monkeypatch.setattr(worker_load, "device_room_bytes", lambda dev: 1000)
    staged = _fail_on_call(monkeypatch, worker_ext, "_stage", 10**9)  # counts only
    other = load_hf(path, scale=0.5, seed=7)
    eng = trainer(srv.url, other)
    with pytest.raises(WeightSyncHTTPError) as ei:
        eng.send_weights()
    _assert_507(ei, "GiB is free", "nothing was received")
    assert staged == []
    assert checksums(srv.url) == before and _greedy(srv.url) == want
    monkeypatch.undo()
    eng.send_weights()
    assert _greedy(srv.url) == [hf_greedy(other, p) for p in PROMPT_IDS]
    eng.shutdown()


def test_check_staging_room_counts_only_new_buffers():
    """The bytes it asks for: each tensor's elements x the staging dtype's size (float tensors cast to
    the model's dtype, others kept), less the buffers a previous sync left at the same shape/dtype."""
    from rlserve.transfer.server.worker_state import WorkerTransferState
    from rlserve.transfer.wire.protocol import UpdateInfo

    st = WorkerTransferState()
    info = UpdateInfo(names=["a", "b", "c"], dtype_names=["float32", "float32", "int64"], shapes=[[4, 8], [10], [3]])
    need = 4 * 8 * 2 + 10 * 2 + 3 * 8  # a, b as bfloat16; c int64
    dev = torch.device("cpu")
    seen = []
    real = worker_load.device_room_bytes
    try:
        worker_load.device_room_bytes = lambda d: seen.append(d) or need
        worker_load.check_staging_room(st, info, torch.bfloat16, dev)  # exactly fits
        worker_load.device_room_bytes = lambda d: need - 1
        with pytest.raises(worker_load.DeviceOutOfMemoryError, match="needs 0.00 GiB"):
            worker_load.check_staging_room(st, info, torch.bfloat16, dev)
        st.staging_bufs["a"] = torch.empty(4, 8, dtype=torch.bfloat16)  # reused: only b and c are new
        worker_load.device_room_bytes = lambda d: need - 64
        worker_load.check_staging_room(st, info, torch.bfloat16, dev)
        worker_load.device_room_bytes = lambda d: need - 65
        with pytest.raises(worker_load.DeviceOutOfMemoryError):
            worker_load.check_staging_room(st, info, torch.bfloat16, dev)
    finally:
        worker_load.device_room_bytes = real
    assert seen == [dev]
    assert real(dev) is None  # no check off CUDA


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_torch_nonfinite_in_slices_equals_the_whole_tensor_test(dtype, monkeypatch):
    """:func:`finite.torch_nonfinite` tests big tensors in slices of ``SCAN_CHUNK`` elements (bounded
    scratch): with slices of 7, a NaN / inf at either end of any slice, or none, is found exactly as
    ``isfinite`` says."""
    monkeypatch.setattr(finite, "SCAN_CHUNK", 7)
    base = torch.linspace(-3, 3, 50, dtype=torch.float64).to(dtype)
    assert not bool(finite.torch_nonfinite(base))
    for pos in (0, 6, 7, 13, 14, 49):
        for bad in (float("nan"), float("inf"), float("-inf")):
            t = base.clone()
            t[pos] = bad
            assert bool(finite.torch_nonfinite(t)) and not bool(torch.isfinite(t).all()), (pos, bad)
            assert bool(finite.torch_nonfinite(t.view(5, 10)))
