"""TRL 1.16's adapter-only sync, unmodified, against ``rlserve serve --enable-lora``: the async GRPO
trainer's own ``select_adapter_sync`` (reads ``/server_info``'s ``lora_config``) and its
``_sync_weight_lora`` (pause, ``save_lora_adapter`` into ``{lora_name}-v{N}``, ``load_lora_adapter``,
resume, ``unload_lora_adapter`` of the version that left the staleness window), called on a stand-in
for the trainer object that holds only what the method reads; and the async distillation trainer's
client (its own ``VLLMClient.load_lora_adapter`` / ``unload_lora_adapter``). After each sync the
newest version answers with the greedy tokens of the trainer's PEFT model (its own unmerged forward,
float32), and the previous one still answers with the previous policy's.

Needs ``trl==1.16.0`` (and ``vllm``, which TRL's experimental modules import): ``.ci/run`` runs this
file in its second venv; in rlserve's own test venv it is skipped.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import requests
import torch

pytest.importorskip("vllm", reason="TRL's experimental trainers need vllm installed (.ci/run runs this file in a second venv)")
pytest.importorskip("trl", reason="needs trl==1.16.0 (.ci/run runs this file in a second venv)")
pytest.importorskip("peft", reason="needs peft (rlserve's test extras)")

from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer, select_adapter_sync  # noqa: E402
from trl.experimental.async_grpo.vllm_client import VLLMClient  # noqa: E402

from rlserve.server.testing import ServerProcess  # noqa: E402

PROMPT = "The capital of France is"
NEW = 8


@pytest.fixture(scope="module")
def base(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def server(base):
    with ServerProcess(base, "--enable-lora", "--max-loras", "3", "--max-lora-rank", "8",
                       "--max-model-len", "128") as srv:
        yield srv


def _peft_model(base: str):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"],
                     lora_dropout=0.0, init_lora_weights=False)
    return get_peft_model(model, cfg).eval()


def _train_step(model, seed: int) -> None:
    """Stand-in for an optimizer step: new random LoRA factors."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _greedy(model, ids: list[int]) -> list[int]:
    ids = list(ids)
    out = []
    with torch.no_grad():
        for _ in range(NEW):
            tok = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(tok)
            ids.append(tok)
    return out


def _served(srv, model: str) -> tuple[int, list[int] | str]:
    r = requests.post(f"{srv.url}/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": NEW,
                                                         "temperature": 0, "ignore_eos": True,
                                                         "return_token_ids": True}, timeout=120)
    return r.status_code, (r.json()["choices"][0]["token_ids"] if r.status_code == 200 else r.text)


def test_async_grpo_adapter_sync(server, base, tmp_path):
    from accelerate import Accelerator

    client = VLLMClient(server.url)
    model = _peft_model(base)
    args = SimpleNamespace(max_staleness=1)
    assert select_adapter_sync(client.get_server_info(), model, args) is True
    trainer = SimpleNamespace(model_version=0, _lora_dir=str(tmp_path / ".vllm_lora"), _lora_name="trl-policy",
                              accelerator=Accelerator(cpu=True), model=model, _adapter_name="default",
                              vllm_client=client, args=args, rollout_worker=None)
    ids = requests.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    want = {}
    for version in (1, 2, 3):
        _train_step(model, seed=version)
        want[version] = _greedy(model, ids)
        AsyncGRPOTrainer._sync_weight_lora(trainer, time.time())
        assert trainer.model_version == version
        names = [m["id"] for m in requests.get(f"{server.url}/v1/models").json()["data"]][1:]
        assert names == [f"trl-policy-v{v}" for v in range(max(1, version - 1), version + 1)]  # v-2 unloaded
        assert _served(server, f"trl-policy-v{version}") == (200, want[version])
        if version > 1:  # the previous policy still answers as before
            assert _served(server, f"trl-policy-v{version - 1}") == (200, want[version - 1])
    assert len(set(map(tuple, want.values()))) == 3
    assert _served(server, "trl-policy-v1")[0] == 404
    assert requests.get(f"{server.url}/is_paused").json()["is_paused"] is False


def _logprobs(model, ids: list[int], new: list[int]) -> list[float]:
    """log p(new[i] | ids + new[:i]) under ``model`` (float32, one forward)."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids + new])).logits[0].float(), -1)
    return [float(lp[len(ids) - 1 + i, t]) for i, t in enumerate(new)]


def test_rollout_request_on_the_synced_adapter(server, base, tmp_path):
    """The rollout worker's request (its ``_request_model`` name and ``/v1/completions`` payload
    shape: token-id prompt, sampling with a per-request seed, ``logprobs: 0``) on the adapter TRL
    synced: the sampled tokens' logprobs are the trainer's PEFT model's (float32, 1e-4: the bound
    tests/test_engine.py uses against Hugging Face)."""
    from accelerate import Accelerator
    from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop

    client = VLLMClient(server.url)
    model = _peft_model(base)
    _train_step(model, seed=21)
    trainer = SimpleNamespace(model_version=0, _lora_dir=str(tmp_path / ".vllm_lora"), _lora_name="rollout",
                              accelerator=Accelerator(cpu=True), model=model, _adapter_name="default",
                              vllm_client=client, args=SimpleNamespace(max_staleness=1), rollout_worker=None)
    AsyncGRPOTrainer._sync_weight_lora(trainer, time.time())
    worker = SimpleNamespace(lora_name="rollout", model_name=base, model_version=trainer.model_version)
    name = _AsyncRolloutLoop._request_model.fget(worker)  # the name the rollout loop requests
    assert name == "rollout-v1"
    ids = requests.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    r = requests.post(f"{server.url}/v1/completions", json={
        "model": name, "prompt": ids, "max_tokens": NEW, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
        "repetition_penalty": 1.0, "n": 1, "return_token_ids": True, "logprobs": 0, "seed": 1234}, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    want = _logprobs(model, ids, choice["token_ids"])
    torch.testing.assert_close(torch.tensor(choice["logprobs"]["token_logprobs"]), torch.tensor(want),
                               atol=1e-4, rtol=0)
    client.unload_lora_adapter(name)


def test_async_distillation_client(server, base, tmp_path):
    from trl.experimental.async_distillation.vllm_client import VLLMClient as DistillClient

    model = _peft_model(base)
    _train_step(model, seed=7)
    model.save_pretrained(str(tmp_path / "student"))
    client = DistillClient(server.url)
    client.load_lora_adapter("student-v1", str(tmp_path / "student"))
    ids = requests.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert _served(server, "student-v1") == (200, _greedy(model, ids))
    with pytest.raises(Exception, match="Request failed: 400.*already been loaded"):
        client.load_lora_adapter("student-v1", str(tmp_path / "student"))
    client.unload_lora_adapter("student-v1")
    client.unload_lora_adapter("student-v1")  # missing names are not an error for TRL's client
    assert _served(server, "student-v1")[0] == 404
