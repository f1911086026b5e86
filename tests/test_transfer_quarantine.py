"""Issue 24: an update that fails inside an engine-thread command after writing into the
parameters (a staged commit run between two steps; on a GPU also the one-call ipc receive) must
not let the engine step on the broken weights before the failure path ends the requests
(``AsyncEngine.quarantine``)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlserve.transfer import GlooTrainerInitInfo, HTTPWeightSyncClient, ModuleSource, WeightTransferTrainerFactory
from rlserve.transfer.sdk.trainer import WeightSyncHTTPError
from tests.transfer_harness import InProcessServer, free_port


def test_failed_staged_commit_in_the_engine_command_steps_nothing_after(tiny_model, monkeypatch):
    """Staged, one replica: the commit is one engine-thread command between two steps. It fails
    after loading one tensor; the request that was generating ends with 503 and the engine runs
    no step between the failed command and that end (it used to keep stepping the request on
    the part-loaded weights until the event loop's fail_all reached the engine thread)."""
    import rlserve.transfer.server.worker_ext as worker_ext

    path = tiny_model("llama", max_position_embeddings=2048)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # the engine is patched in this process: thread mode (the engine-core process runs the same
    # quarantine through rlserve.transfer.server.engine_calls.worker_rpc)
    with InProcessServer(path, staging="device", max_model_len=2048, kv_cache_bytes=64 << 20,
                         engine_mode="thread") as srv:
        eng = WeightTransferTrainerFactory.trainer_init(
            init_info=GlooTrainerInitInfo(master_port=free_port(), world_size=2, timeout_s=20,
                                          packed_buffer_size_bytes=64 << 10),
            client=HTTPWeightSyncClient(srv.url, timeout_s=60), source=ModuleSource(hf))
        engine = srv.aengine.engines[0]
        state = {"failed": False, "steps_after": 0}
        real_step = engine.step

        def step(*a, **k):
            if state["failed"]:
                state["steps_after"] += 1
            return real_step(*a, **k)

        def failing_commit(worker):
            st = worker_ext._state(worker)
            name, t = next(iter(st.staging.items()))
            worker_ext._load(worker, [(name, t)])  # one tensor of the new weights lands
            state["failed"] = True
            raise RuntimeError("commit failed after one tensor")

        monkeypatch.setattr(engine, "step", step)
        monkeypatch.setattr(worker_ext, "commit", failing_commit)
        result: dict = {}

        def complete():
            result["r"] = httpx.post(srv.url + "/v1/completions", timeout=300, json={
                "prompt": [5, 6, 7], "max_tokens": 2000, "temperature": 0, "ignore_eos": True})

        running = threading.Thread(target=complete)
        running.start()
        deadline = time.monotonic() + 60
        while srv.aengine.num_unfinished < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.aengine.num_unfinished == 1
        with pytest.raises(WeightSyncHTTPError) as ei:
            eng.send_weights()
        assert ei.value.status_code == 500 and "commit failed" in str(ei.value)
        running.join(120)
        r = result["r"]
        assert r.status_code == 503 and "full weight update" in r.json()["error"]["message"], r.text
        assert state["steps_after"] == 0
        assert httpx.get(srv.url + "/health").status_code == 503
        monkeypatch.undo()
        eng.send_weights()  # a full update serves again
        assert httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}).status_code == 200
        eng.shutdown()
