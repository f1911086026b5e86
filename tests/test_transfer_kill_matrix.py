"""Issue 24: a trainer process that dies at any phase of an update never leaves a half-updated
model in service. Each cell kills a real trainer process (``tests/kill_trainer.py``) and checks
``/weight_checker``, ``/health``, ``/weight_info`` and greedy tokens against the last good
version (``tests/kill_matrix.py``: the whole matrix, also runnable as a script that prints it).
CI runs the issue's case and a selection of cells (each cell costs about ``timeout_s``: a
trainer that died mid-message is noticed when the receive times out), on one server per server
configuration."""

from __future__ import annotations

import contextlib

import pytest

from tests.kill_matrix import BAD_SEED, CONFIGS, Good, cpu_server, expected, model_meta, run_config, verdict

TIMEOUT_S = 2.0
BY_NAME = {c.name: c for c in CONFIGS}


@pytest.fixture(scope="module")
def llama384(tiny_model):
    """A tiny llama whose loads are byte copies (vocabulary 384: no padding rows), so packed
    in-place updates are received straight into the parameters; and its tensors' metadata."""
    path = tiny_model("llama", vocab_size=384)
    return path, model_meta(path)


@pytest.fixture(scope="module")
def server(llama384):
    """``run_config``'s ``server``: one in-process server per distinct server configuration
    (backend, direct receive, staging), shared by the cells that use it (each cell starts with
    a full sync of the good weights, so what an earlier cell left behind does not carry over)."""
    started: dict = {}

    def get(path, cfg, timeout_s):
        key = (path, cfg.backend, cfg.direct, cfg.staging, timeout_s)
        if key not in started:
            started[key] = cpu_server(path, cfg, timeout_s)
        return contextlib.nullcontext(started[key])

    yield get
    for srv in started.values():
        srv.close()


def test_direct_receive_killed_inside_its_only_bucket_is_not_served(llama384, server):
    """The issue's case: in place, direct receive on (the default), the trainer synced before so
    the update is received straight into the parameters, the whole model is one bucket (the
    default 1 GiB buckets) and the trainer dies with that bucket half on the wire. No bucket
    completed, yet half of the parameters' bytes changed: the model must answer 503 (it served
    200 with the old version label and changed text)."""
    path, meta = llama384
    out = run_config(path, meta, BY_NAME["gloo packed, in place, direct"], TIMEOUT_S, phases=["first_bucket"],
                     bucket_bytes=1 << 30, server=server)
    assert out == {"first_bucket": "503"}


def test_a_landed_unlabelled_update_between_cells_is_served_and_not_relabelled(llama384, server):
    """What the GPU's ipc per-tensor cells do (2026-12-06: 409 ``weight_version_in_use`` on one
    H200, deterministic): the killed trainer's one ``/sync_weights`` call completes before its
    death, so its update lands under the automatic label, which the next cell's good sync then
    asked for by hand. Here with gloo on the CPU (no ipc): the good sync, a complete update of
    the killed trainers' weights with no label, the verdict ``updated`` under a label that is
    not the good one, then the good sync again, served unchanged. Fails on the harness before
    (labels "good-N": the second good sync got 409 for the first one's automatic successor)."""
    from rlserve.transfer import HTTPWeightSyncClient, TensorListSource, WeightTransferTrainerFactory
    from tests.kill_trainer import random_weights, trainer_init_info

    path, meta = llama384
    cfg = BY_NAME["gloo unpacked, staged"]
    with server(path, cfg, TIMEOUT_S) as srv:
        good = Good(meta)
        good.sync(srv, cfg, 64 << 10)
        first = good.version
        eng = WeightTransferTrainerFactory.trainer_init(
            init_info=trainer_init_info("gloo", False, 64 << 10, 30),
            client=HTTPWeightSyncClient(srv.url, timeout_s=60), source=TensorListSource(random_weights(meta, BAD_SEED)))
        try:
            landed = eng.send_weights()["weight_version"]
        finally:
            eng.shutdown()
        assert landed not in (first, None)
        assert verdict(srv.url, good) == "updated"
        good.sync(srv, cfg, 64 << 10)
        assert good.version != first and verdict(srv.url, good) == "unchanged"


CI_CELLS = {
    "gloo packed, in place, direct": ("between_buckets", "finish"),
    "gloo packed, in place, buffered": ("first_bucket", "last_bucket"),  # first: nothing loaded, still served
    "gloo unpacked, in place": ("between_buckets",),
    "TRL per-tensor, in place": ("between_buckets", "finish"),
    "TRL per-tensor, staged": ("between_buckets",),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CI_CELLS))
def test_killed_trainer_never_leaves_mixed_weights_in_service(llama384, server, name):
    """Per receive path, the phases whose outcome differs: ``503`` once the parameters may
    have changed, else the last good weights served unchanged (``tests/kill_matrix.py``)."""
    path, meta = llama384
    cfg = BY_NAME[name]
    out = run_config(path, meta, cfg, TIMEOUT_S, phases=CI_CELLS[name], server=server)
    wrong = {p: v for p, v in out.items() if v not in expected(cfg, p)}
    assert not wrong, (out, {p: expected(cfg, p) for p in wrong})
