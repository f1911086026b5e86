"""A real ``rlserve serve`` process on a tiny random Llama, driven by the official
``openai`` client and raw HTTP: completions, chat, streaming, n, logprobs, echo, TRL's
/generate/, info routes, metrics, and every bad-input case (OpenAI error JSON, right
status, server still healthy)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from rlserve.engine.sampling_params import SamplingParams
from rlserve.server.testing import ServerProcess

TIMEOUT = 60.0
MODEL = "tiny"


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerProcess(model_dir, "--served-model-name", MODEL, "--max-model-len", "128",
                       "--weight-version", "v0", "--disable-access-log", "--device", "cpu") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


@pytest.fixture(scope="module")
def offline(model_dir):
    from rlserve import LLM

    return LLM(model_dir, device="cpu", max_model_len=128)


def _greedy(offline, prompt, max_tokens):
    out = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))[0]
    return out.outputs[0].token_ids, out.outputs[0].text


def test_models_and_info(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    info = httpx.get(server.url + "/server_info", timeout=TIMEOUT).json()
    assert info["weight_version"] == "v0" and info["tensor_parallel_size"] == 1 and info["dtype"] == "float32"
    assert info["max_model_len"] == 128 and info["weight_transfer_config"] is None
    for path in ("/get_world_size", "/get_world_size/"):
        assert httpx.get(server.url + path, timeout=TIMEOUT).json() == {"world_size": 1}
    for path in ("/health", "/health/"):
        assert httpx.get(server.url + path, timeout=TIMEOUT).status_code == 200
    assert httpx.get(server.url + "/is_paused", timeout=TIMEOUT).json()["is_paused"] is False


def test_completion_greedy_matches_offline(client, offline):
    prompt = "The capital of France is"
    ref_ids, ref_text = _greedy(offline, prompt, 16)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    c = r.choices[0]
    assert c.text == ref_text
    assert c.model_extra["token_ids"] == ref_ids
    assert c.finish_reason == "length"
    assert r.usage.completion_tokens == 16 and r.usage.prompt_tokens == len(c.model_extra["prompt_token_ids"])
    assert r.model_extra["weight_version"] == "v0" and c.model_extra["weight_version"] == "v0"


def test_completion_prompt_forms(client, offline, model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.encode("Hello world")
    ref_ids, _ = _greedy(offline, "Hello world", 6)
    extra = {"ignore_eos": True, "return_token_ids": True}
    r = client.completions.create(model=MODEL, prompt=["Hello world", "Hello world"], max_tokens=6, temperature=0,
                                  extra_body=extra)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.model_extra["token_ids"] == ref_ids for c in r.choices)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, extra_body=extra)
    assert r.choices[0].model_extra["token_ids"] == ref_ids
    r = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=6, temperature=0, extra_body=extra)
    assert len(r.choices) == 2 and r.choices[1].model_extra["token_ids"] == ref_ids
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith("Hello world")


def test_completion_stream_equals_non_stream(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_greedy_stream_and_role(client, offline, model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "Hello there, how are you today?"}]
    prompt_ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)
    ref_ids, ref_text = _greedy(offline, prompt_ids, 10)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref_text
    assert r.choices[0].model_extra["token_ids"] == ref_ids
    assert r.model_extra["prompt_token_ids"] == prompt_ids and r.usage.prompt_tokens == len(prompt_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ref_text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n4_seeded_and_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, n=4, temperature=1.0, seed=123,
                                  logprobs=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert len({c.text for c in r.choices}) > 1  # four different samples
    r2 = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, n=4, temperature=1.0, seed=123,
                                   logprobs=3, extra_body={"ignore_eos": True})
    assert [c.text for c in r.choices] == [c.text for c in r2.choices]  # seeded: reproducible
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
        assert all(x <= 0 for x in lp.token_logprobs)
        assert all(1 <= len(t) <= 4 for t in lp.top_logprobs)
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # greedy: the sampled token is the most likely one
    g = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logprobs=2)
    for lp, top in zip(g.choices[0].logprobs.token_logprobs, g.choices[0].logprobs.top_logprobs):
        assert lp == pytest.approx(max(top.values()), abs=1e-5)
    # chat logprobs
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       n=4, temperature=1.0, logprobs=True, top_logprobs=2)
    assert len(r.choices) == 4
    for c in r.choices:
        assert len(c.logprobs.content) == r.usage.completion_tokens // 4 or c.finish_reason == "stop"
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in c.logprobs.content)


def test_echo_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=3, temperature=0, echo=True,
                                  logprobs=1, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 3
    assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])


def test_trl_generate(server, offline):
    ref_ids, _ = _greedy(offline, "Hello world", 5)
    body = {"prompts": ["Hello world", "The capital"], "n": 2, "temperature": 0.0, "max_tokens": 5,
            "generation_kwargs": {"ignore_eos": True}}
    r = httpx.post(server.url + "/generate/", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    d = r.json()
    assert len(d["prompt_ids"]) == 2 and len(d["completion_ids"]) == 4 and len(d["logprobs"]) == 4
    assert d["completion_ids"][0] == d["completion_ids"][1] == ref_ids
    assert all(len(lp) == 5 for lp in d["logprobs"]) and d["weight_version"] == "v0"
    r = httpx.post(server.url + "/generate/", json={"prompts": [d["prompt_ids"][0]], "temperature": 0.0,
                                                     "max_tokens": 5, "generation_kwargs": {"ignore_eos": True}},
                   timeout=TIMEOUT)
    assert r.json()["completion_ids"] == [ref_ids]
    r = httpx.post(server.url + "/reset_prefix_cache/", timeout=TIMEOUT)
    assert r.status_code == 200 and "True" in r.json()["message"]


def test_metrics(server, client):
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    text = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
    for name in ("rlserve_requests_total", "rlserve_prompt_tokens_total", "rlserve_generation_tokens_total",
                 "rlserve_e2e_request_latency_seconds_bucket", "rlserve_time_to_first_token_seconds_bucket",
                 "rlserve_kv_cache_usage_perc", "rlserve_num_requests_running", "rlserve_num_requests_waiting",
                 'rlserve_weight_version_info{model_name="tiny",version="v0"}'):
        assert name in text, name


# ---- bad input ---------------------------------------------------------------------------

_LONG = list(range(3, 3 + 130))  # 130 tokens > max_model_len 128

BAD = [
    # (name, path, raw body or json, status, param)
    ("malformed json", "/v1/completions", b'{"model": "tiny", "prompt": ', 400, None),
    ("not an object", "/v1/completions", b"[1, 2]", 400, None),
    ("missing prompt", "/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("mistyped max_tokens", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 400,
     "max_tokens"),
    ("mistyped prompt", "/v1/completions", {"model": MODEL, "prompt": {"a": 1}}, 400, "prompt"),
    ("n=0", "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
    ("negative temperature", "/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, 400,
     "temperature"),
    ("prompt beyond context", "/v1/completions", {"model": MODEL, "prompt": [5] * 200}, 400, "input_tokens"),
    ("max_tokens 0", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("unknown model", "/v1/completions", {"model": "gpt-5", "prompt": "hi"}, 404, "model"),
    ("empty prompt", "/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    # (vLLM 0.32's param for a prompt over max_model_len)
    ("prompt too long", "/v1/completions", {"model": MODEL, "prompt": _LONG, "max_tokens": 1}, 400, "input_tokens"),
    ("token id out of vocab", "/v1/completions", {"model": MODEL, "prompt": [1, 2, 100000]}, 400, "prompt"),
    ("negative token id", "/v1/completions", {"model": MODEL, "prompt": [1, -2]}, 400, "prompt"),
    ("too many logprobs", "/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 1000}, 400, "logprobs"),
    ("empty messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("bad message", "/v1/chat/completions", {"model": MODEL, "messages": [{"content": "x"}]}, 400, "messages.0.role"),
    ("chat unknown model", "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
     404, "model"),
    ("chat beyond context", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": " x" * 200}], "max_tokens": 2}, 400, "input_tokens"),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("trl empty prompts", "/generate/", {"prompts": []}, 400, "prompts"),
    ("trl token id out of vocab", "/generate/", {"prompts": [[1, 99999]]}, 400, None),
    ("pause bad mode", "/pause?mode=sideways", None, 400, "mode"),
    ("unknown route", "/v1/nothing", {}, 404, None),
]


@pytest.mark.parametrize("name,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input(server, name, path, body, status, param):
    if isinstance(body, bytes):
        r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"},
                       timeout=TIMEOUT)
    else:
        r = httpx.post(server.url + path, json=body, timeout=TIMEOUT)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200


@pytest.mark.parametrize("path", ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"])
def test_lora_route_without_enable_lora_says_how_to_turn_it_on(server, path):
    """A server started without --enable-lora has no LoRA routes (vLLM 0.32 without
    VLLM_ALLOW_RUNTIME_LORA_UPDATING has none either: a 404): the OpenAI-style 404 says to start
    with --enable-lora. The old message was only "no route POST PATH" (session 19)."""
    r = httpx.post(server.url + path, json={"lora_name": "a", "lora_path": "/x"}, timeout=TIMEOUT)
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["message"] == (f"no route POST {path} (LoRA adapters are off: start the server with --enable-lora; "
                              "pip install 'rlserve[lora]')") and err["code"] == "not_found", err


def test_openai_client_errors_and_still_serving(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].finish_reason in ("length",
                                                                                                          "stop")


def test_stream_reports_errors_as_json(server):
    # a streamed request that fails validation answers a plain JSON error before streaming
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": [5] * 100_000,
                                                          "max_tokens": 2, "stream": True}, timeout=TIMEOUT)
    err = json.loads(r.text)["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "input_tokens", err


def test_max_tokens_beyond_the_context_is_clamped(server):
    """prompt + max_tokens over max_model_len: max_tokens is an upper bound, clamped to the room the prompt
    leaves (vLLM 0.32's get_max_tokens; its own server answered 200 with 24 tokens for a 40-token prompt with
    max_tokens 40 at --max-model-len 64), streamed or not; every answer ends at the context's end at the latest."""
    max_len = httpx.get(server.url + "/v1/models", timeout=TIMEOUT).json()["data"][0]["max_model_len"]
    prompt = [5, 6, 7, 8] * 4
    for stream in (False, True):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 10 ** 30, "ignore_eos": True, "temperature": 0,
                "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            usage = events[-1]["usage"]
            finish = [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]
        else:
            usage, finish = r.json()["usage"], [r.json()["choices"][0]["finish_reason"]]
        assert usage["prompt_tokens"] == len(prompt), usage
        assert usage["completion_tokens"] == max_len - len(prompt), usage  # ignore_eos: all the room is used
        assert finish == ["length"], finish


def test_a_batch_of_prompts_gets_each_prompts_own_parameters(server):
    """TRL's form: one /v1/completions request with a batch of token-id prompts. The prompts share
    their SamplingParams (built once per max_tokens, copied per prompt), so each prompt must still get
    its own clamped max_tokens (a long prompt leaves less room: 100 -> 128 - 60), and the same prompt
    the same greedy tokens wherever it is in the batch; a field checked against each prompt's length
    (routed_experts_prompt_start) is checked for every prompt, not only the first."""
    short, long_ = [5, 6, 7, 8], list(range(3, 63))
    body = {"model": MODEL, "prompt": [short, short, long_, short], "max_tokens": 100, "ignore_eos": True,
            "temperature": 0, "return_token_ids": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [len(c["token_ids"]) for c in choices] == [100, 100, 128 - len(long_), 100]
    alone = httpx.post(server.url + "/v1/completions", json=dict(body, prompt=short), timeout=TIMEOUT).json()
    assert choices[0]["token_ids"] == choices[1]["token_ids"] == choices[3]["token_ids"] == \
        alone["choices"][0]["token_ids"]
    r = httpx.post(server.url + "/v1/completions", json=dict(body, prompt=[long_, long_[:3]], max_tokens=2,
                                                              routed_experts_prompt_start=5), timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "routed_experts_prompt_start" and "prompt length 3," in err["message"], err


def test_trainer_against_server_without_weight_transfer_fails_fast(server):
    """A trainer pointed at a server started without --weight-transfer-config gets a 404 naming
    the missing flag, and its process exits at once (the abandoned rendezvous must not hold the
    interpreter for timeout_s)."""
    import subprocess
    import sys
    import time

    script = f"""
import torch
from rlserve.transfer import GlooTrainerInitInfo, HTTPWeightSyncClient, TensorListSource, WeightTransferTrainerFactory
from rlserve.transfer.sdk.trainer import WeightSyncHTTPError
from rlserve.distributed.group import get_open_port
try:
    WeightTransferTrainerFactory.trainer_init(
        init_info=GlooTrainerInitInfo(master_port=get_open_port(), world_size=2, timeout_s=300),
        client=HTTPWeightSyncClient({server.url!r}), source=TensorListSource([("w", torch.zeros(2))]))
except WeightSyncHTTPError as e:
    print("REFUSED", e)
"""
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    assert "REFUSED" in out.stdout and "404" in out.stdout, out.stdout + out.stderr
    assert "--weight-transfer-config" in out.stdout
    assert elapsed < 60, f"the trainer process took {elapsed:.0f} s to exit"
