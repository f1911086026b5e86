"""LoRA adapters across an engine-core restart (session 21's adversarial pass): the API's adapter table
outlives the engine-core process, the adapters the dead core held do not. A restarted core gets every
adapter loaded from a file again, under the same ids, before it is swapped in, so a request naming one
answers as before the crash; an adapter pushed by an adapter-only weight sync (no file) died with the
process and is dropped from the table: 404 ``model_not_found``, gone from ``/v1/models``, its name free
for a new load. Before the fix every adapter stayed listed and a request naming it answered 400
``invalid_request`` ("LoRA adapter id 1 is not loaded on this engine").

A real ``rlserve serve`` process (CPU, tiny llama, gloo weight sync, ``--serve-checkpoint-after-restart``
so that the base model serves right after the restart); the core is SIGKILLed; every wait is on a state."""

from __future__ import annotations

import httpx
import pytest

from rlserve.server.testing import ServerProcess
from tests.lora_adapters import make_adapter
from tests.test_engine_restart import ARGS, T, _kill_and_wait_back

PROMPT = [5, 17, 42, 9, 77, 3]


def _complete(url: str, model: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                                     "ignore_eos": True, "return_token_ids": True}, timeout=T)


def _tokens(url: str, model: str) -> list[int]:
    r = _complete(url, model)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _models(url: str) -> list[str]:
    return [m["id"] for m in httpx.get(url + "/v1/models", timeout=T).json()["data"]]


@pytest.mark.slow
def test_restart_reloads_file_adapters_and_drops_synced_ones(tiny_model, tmp_path):
    from rlserve.transfer import GlooTrainerInitInfo, HTTPWeightSyncClient, LoRASource, WeightTransferTrainerFactory
    from tests.test_lora_sync import _peft

    base = tiny_model("llama", max_position_embeddings=4096)
    a1 = make_adapter(base, tmp_path / "a1", seed=3)
    a2 = make_adapter(base, tmp_path / "a2", seed=4)
    with ServerProcess(base, *ARGS, "--enable-lora", "--max-loras", "3", "--max-lora-rank", "16",
                       "--serve-checkpoint-after-restart", startup_timeout_s=600) as srv:
        url = srv.url
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": a1}, timeout=T)
        assert r.status_code == 200, r.text
        trainer = WeightTransferTrainerFactory.trainer_init(
            init_info=GlooTrainerInitInfo(world_size=2, timeout_s=60),
            client=HTTPWeightSyncClient(url), source=LoRASource(_peft(base, r=8, seed=1), "policy"))
        try:
            assert trainer.send_weights()["lora_name"] == "policy"
        finally:
            trainer.shutdown()
        before = {m: _tokens(url, m) for m in (base, "a1", "policy")}
        assert len({tuple(t) for t in before.values()}) == 3  # three different models (else the test shows little)
        assert _models(url) == [base, "a1", "policy"]

        _seconds, health = _kill_and_wait_back(srv)
        assert health.status_code == 200, health.text
        assert _tokens(url, base) == before[base]
        assert _tokens(url, "a1") == before["a1"]  # main: 400 invalid_request "LoRA adapter id 1 is not loaded"
        r = _complete(url, "policy")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        assert _models(url) == [base, "a1"]
        held = [(a["name"], a["path"]) for a in httpx.get(url + "/server_info", timeout=T).json()["lora_adapters"]]
        assert held == [("a1", a1)]
        # the synced adapter's name is free again; a1 still loads in place; both serve
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "policy", "lora_path": a2}, timeout=T)
        assert r.status_code == 200, r.text
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": a1, "load_inplace": True},
                       timeout=T)
        assert r.status_code == 200, r.text
        assert _tokens(url, "a1") == before["a1"]
        assert _tokens(url, "policy") not in (before["a1"], before[base])
