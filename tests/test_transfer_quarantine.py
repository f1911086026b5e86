"""Issue 24 / 17: an update that fails inside an engine command after writing into the parameters
(a staged commit run between two steps; on a GPU also the one-call ipc receive) must not let the
engine step on the broken weights before the failure path ends the requests (the replica is
quarantined in the same command: ``rlserve.transfer.server.engine_calls.worker_rpc``). Run in
both engine modes: through the engine-core process boundary (the server's default) and on a
thread of the API process."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlserve.transfer import GlooTrainerInitInfo, HTTPWeightSyncClient, ModuleSource, WeightTransferTrainerFactory
from rlserve.transfer.sdk.trainer import WeightSyncHTTPError
from tests.transfer_harness import InProcessServer

HERE = "tests.test_transfer_quarantine"  # this module as the engine-core process imports it
#: where the engine is (the engine-core process, or this one in thread mode): the next staged
#: commit fails after loading one tensor; steps the engine ran after that failure
STATE = {"armed": True, "failed": False, "steps_after": 0}


def break_next_commit(setattr=setattr) -> None:
    """``RLSERVE_ENGINE_CORE_INIT`` hook (also called here in thread mode, with
    ``monkeypatch.setattr``): the next ``worker_ext.commit`` loads one staged tensor into the
    model, then raises; every ``LLMEngine.step`` after that failure is counted in :data:`STATE`."""
    import rlserve.transfer.server.worker_ext as worker_ext
    from rlserve.engine.core.llm_engine import LLMEngine

    real_commit, real_step = worker_ext.commit, LLMEngine.step

    def step(self, *a, **k):
        if STATE["failed"]:
            STATE["steps_after"] += 1
        return real_step(self, *a, **k)

    def commit(worker):
        if not STATE["armed"]:
            return real_commit(worker)
        STATE["armed"] = False
        st = worker_ext._state(worker)
        name, t = next(iter(st.staging.items()))
        worker_ext._load(worker, [(name, t)])  # one tensor of the new weights lands
        STATE["failed"] = True
        raise RuntimeError("commit failed after one tensor")

    setattr(worker_ext, "commit", commit)
    setattr(LLMEngine, "step", step)


def state(core) -> dict:
    """Engine call: :data:`STATE` where the engine runs."""
    return dict(STATE)


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_failed_staged_commit_in_the_engine_command_steps_nothing_after(tiny_model, monkeypatch, mode):
    """Staged, one replica: the commit is one engine command between two steps. It fails after
    loading one tensor; the request that was generating ends with 503, /health answers 503 and
    the engine runs no step between the failed command and that end (in thread mode it used to
    keep stepping the request on the part-loaded weights until the event loop's fail_all reached
    the engine thread). The next full update serves again, stamped with its version."""
    path = tiny_model("llama", max_position_embeddings=2048)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    monkeypatch.setitem(STATE, "armed", True)
    monkeypatch.setitem(STATE, "failed", False)
    monkeypatch.setitem(STATE, "steps_after", 0)
    if mode == "process":
        monkeypatch.setenv("RLSERVE_ENGINE_CORE_INIT", f"{HERE}:break_next_commit")
    else:
        break_next_commit(monkeypatch.setattr)
    with InProcessServer(path, staging="device", max_model_len=2048, kv_cache_bytes=64 << 20,
                         engine_mode=mode) as srv:
        assert srv.aengine.engine_mode == mode and bool(srv.aengine.core_pids()) == (mode == "process")
        eng = WeightTransferTrainerFactory.trainer_init(
            init_info=GlooTrainerInitInfo(world_size=2, timeout_s=20,
                                          packed_buffer_size_bytes=64 << 10),
            client=HTTPWeightSyncClient(srv.url, timeout_s=60), source=ModuleSource(hf))
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
        assert httpx.get(srv.url + "/health").status_code == 503
        after_failure = httpx.post(srv.url + "/v1/completions", timeout=60, json={"prompt": [5, 6, 7], "max_tokens": 4})
        assert after_failure.status_code == 503, after_failure.text
        if mode == "process":
            (seen,) = asyncio.run(srv.aengine.call_engines(f"{HERE}:state"))
        else:  # this process (pytest may import this module under another name than HERE)
            seen = dict(STATE)
        assert seen["failed"] and not seen["armed"] and seen["steps_after"] == 0, seen
        fin = eng.send_weights(weight_version="full-2")  # a full update serves again
        assert fin["weight_version"] == "full-2"
        r = httpx.post(srv.url + "/v1/completions", timeout=60, json={"prompt": [5, 6, 7], "max_tokens": 4,
                                                                      "temperature": 0})
        assert r.status_code == 200 and r.json()["weight_version"] == "full-2", r.text
        assert httpx.get(srv.url + "/health").status_code == 200
        eng.shutdown()
