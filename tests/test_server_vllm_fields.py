"""vLLM-compatible request fields and flags on a real ``rlserve serve`` started with the flags
``trl vllm-serve`` passes (``--logprobs-mode processed_logprobs --max-logprobs -1`` ...):
``return_token_ids`` / ``return_tokens_as_token_ids``, ``prompt_logprobs`` in vLLM's form,
unlimited logprobs, structured outputs, ``chat_template``, ``tools``, ``truncate_prompt_tokens``,
``/server_info``'s ``vllm_config``, ``/tokenize`` / ``/detokenize``, unknown fields (400 naming them), string error codes, and the
``vllm serve`` flags that stop the server. Values are checked against a Hugging Face float32
forward of the same checkpoint."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import pytest
import torch

from rlserve.server.testing import ServerProcess

pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (pip install 'rlserve[structured]')")

T = 60.0
TOL = 2e-4

#: what TRL 1.16's build_command passes after the model (port 0 and a max-model-len added), but for
#: the weight-transfer backend: TRL's nccl is refused on a CPU server (``check_transfer_config``), gloo
#: is the CPU one
TRL_FLAGS = ["--host", "127.0.0.1", "--tensor-parallel-size", "1", "--data-parallel-size", "1",
             "--gpu-memory-utilization", "0.9", "--dtype", "auto", "--kv-cache-dtype", "auto", "--model-impl", "vllm",
             "--uvicorn-log-level", "info", "--max-model-len", "128", "--enable-scale-out",
             "--weight-transfer-config", '{"backend": "gloo"}', "--logprobs-mode", "processed_logprobs",
             "--max-logprobs", "-1"]


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerProcess(model_dir, *TRL_FLAGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(model_dir))


def logprobs_of(hf, ids) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf[0](torch.tensor([ids])).logits[0].float(), -1)


def post(server, path, body, status=200):
    r = httpx.post(server.url + path, json=body, timeout=T)
    assert r.status_code == status, r.text
    return r.json()


def test_server_info_vllm_config(server):
    info = httpx.get(server.url + "/server_info", params={"config_format": "json"}, timeout=T).json()
    vc = info["vllm_config"]
    assert vc["weight_transfer_config"] == {"backend": "gloo"}
    assert vc["model_config"]["logprobs_mode"] == "processed_logprobs" and vc["model_config"]["max_logprobs"] == -1
    assert vc["parallel_config"]["data_parallel_size"] == 1 and vc["cache_config"]["cache_dtype"] == "auto"
    assert info["weight_transfer_config"] == {"backend": "gloo"}  # rlserve's flat fields stay
    assert httpx.get(server.url + "/server_info", timeout=T).json()["vllm_config"] == vc
    text = httpx.get(server.url + "/server_info", params={"config_format": "text"}, timeout=T).json()["vllm_config"]
    assert isinstance(text, str) and "model_config.logprobs_mode='processed_logprobs'" in text
    assert httpx.get(server.url + "/server_info", params={"config_format": "yaml"}, timeout=T).status_code == 400
    # --model-impl as given, the dtype as vLLM prints its torch.dtype; /tokenizer_info only with its flag (vLLM's)
    assert vc["model_config"]["model_impl"] == "vllm" and vc["model_config"]["dtype"] == "torch.float32"
    assert httpx.get(server.url + "/tokenizer_info", timeout=T).status_code == 404


def test_completion_token_ids_as_ids(server, hf):
    ids = [5, 17, 42, 99]
    body = {"prompt": ids, "max_tokens": 4, "temperature": 0.0, "logprobs": 2, "ignore_eos": True,
            "return_token_ids": True, "return_tokens_as_token_ids": True}
    c = post(server, "/v1/completions", body)["choices"][0]
    assert c["prompt_token_ids"] == ids and len(c["token_ids"]) == 4
    lp = c["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
    ref = logprobs_of(hf, ids + c["token_ids"])
    for j, (t, top) in enumerate(zip(c["token_ids"], lp["top_logprobs"])):
        row = ref[len(ids) - 1 + j]
        want = {f"token_id:{i}": v for i, v in zip(*[x.tolist() for x in row.topk(2)[::-1]])}
        assert set(top) == set(want) and all(abs(top[k] - want[k]) < TOL for k in want)
        assert abs(lp["token_logprobs"][j] - row[t].item()) < TOL
    # streamed: the same labels chunk by chunk
    r = httpx.post(server.url + "/v1/completions", json=dict(body, stream=True), timeout=T)
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    toks = [t for ch in chunks for cc in ch["choices"] for t in (cc["logprobs"] or {}).get("tokens", [])]
    assert toks == lp["tokens"]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == ids


def test_chat_tokens_as_ids(server):
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3, "temperature": 0.0,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 2, "return_token_ids": True,
            "return_tokens_as_token_ids": True}
    resp = post(server, "/v1/chat/completions", body)
    c = resp["choices"][0]
    assert resp["prompt_token_ids"] and len(c["token_ids"]) == 3
    content = c["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in c["token_ids"]]
    assert all(re.fullmatch(r"token_id:\d+", top["token"]) for e in content for top in e["top_logprobs"])
    assert all(len(e["top_logprobs"]) == 2 for e in content)
    r = httpx.post(server.url + "/v1/chat/completions", json=dict(body, stream=True), timeout=T)
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert chunks[0]["prompt_token_ids"] == resp["prompt_token_ids"]
    assert [t for ch in chunks[1:] for cc in ch["choices"] for t in cc.get("token_ids", [])] == c["token_ids"]
    assert [e["token"] for ch in chunks[1:] for cc in ch["choices"] for e in (cc["logprobs"] or {}).get("content", [])] \
        == [e["token"] for e in content]


def test_prompt_logprobs_vllm_form(server, hf):
    ids = [5, 17, 42, 99, 7, 8]
    c = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 3})["choices"][0]
    plp = c["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    ref = logprobs_of(hf, ids)
    for pos in range(1, len(ids)):
        row, tgt = ref[pos - 1], ids[pos]
        entry = plp[pos]
        assert set(entry[str(tgt)]) == {"logprob", "rank", "decoded_token"}
        assert abs(entry[str(tgt)]["logprob"] - row[tgt].item()) < TOL
        assert entry[str(tgt)]["rank"] == int((row >= row[tgt]).sum())
        top = row.topk(3)
        for rank, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert entry[str(t)]["rank"] == rank and abs(entry[str(t)]["logprob"] - v) < TOL
    c2 = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 1,
                                          "return_tokens_as_token_ids": True})["choices"][0]
    # vLLM 0.32: the prompt token first at each position; decoded_token the text even with token ids
    assert all(next(iter(plp[pos])) == str(ids[pos]) for pos in range(1, len(ids)))
    assert c2["prompt_logprobs"][1][str(ids[1])]["decoded_token"] == hf[1].decode([ids[1]])


def test_unlimited_logprobs(server, hf):
    vocab = hf[0].config.vocab_size
    # (as ids: several byte-level tokens decode to the same text and would share a key)
    as_ids = {"prompt": "Hello", "max_tokens": 1, "return_tokens_as_token_ids": True}
    c = post(server, "/v1/completions", dict(as_ids, logprobs=-1))["choices"][0]
    assert len(c["logprobs"]["top_logprobs"][0]) == vocab
    c = post(server, "/v1/completions", dict(as_ids, logprobs=50))["choices"][0]
    assert len(c["logprobs"]["top_logprobs"][0]) in (50, 51)
    err = post(server, "/v1/completions", {"prompt": "Hello", "logprobs": -2}, 400)["error"]
    assert err["param"] == "logprobs"


def test_structured_outputs(server, hf):
    tok = hf[1]
    base = {"prompt": "Hello", "max_tokens": 40, "temperature": 1.0, "seed": 1}

    def texts(extra, n=3):
        out = post(server, "/v1/completions", dict(base, n=n, **extra))
        return [(c["text"], c["finish_reason"]) for c in out["choices"]]

    for text, reason in texts({"structured_outputs": {"regex": r"(yes|no)[0-9]{2}"}}):
        assert re.fullmatch(r"(yes|no)[0-9]{2}", text) and reason == "stop"
    for text, _ in texts({"structured_outputs": {"choice": ["Paris", "Berlin"]}}):
        assert text in ("Paris", "Berlin")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    for text, reason in texts({"structured_outputs": {"json": schema}, "max_tokens": 60}):
        if reason == "stop":
            obj = json.loads(text)
            assert set(obj) == {"a"} and isinstance(obj["a"], int)
    for text, _ in texts({"structured_outputs": {"grammar": 'root ::= "ab" | "cd"'}}):
        assert text in ("ab", "cd")
    for text, reason in texts({"response_format": {"type": "json_object"}, "max_tokens": 60}, n=2):
        if reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert text.lstrip().startswith("{")
    out = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
                                                "response_format": {"type": "json_schema",
                                                                    "json_schema": {"name": "x", "schema": schema}}})
    if out["choices"][0]["finish_reason"] == "stop":
        assert set(json.loads(out["choices"][0]["message"]["content"])) == {"a"}
    trl = post(server, "/generate/", {"prompts": ["Hello"], "n": 2, "max_tokens": 12,
                                     "guided_decoding_regex": r"(yes|no)[0-9]{2}"})
    for ids in trl["completion_ids"]:
        assert re.fullmatch(r"(yes|no)[0-9]{2}", tok.decode(ids, skip_special_tokens=True))


@pytest.mark.parametrize("body,param", [
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "backend": "x"}}, "structured_outputs.backend"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "response_format"),
    ({"guided_regex": "a"}, "guided_regex"),
    ({"best_of_n_magic": 1, "also_unknown": 2}, "best_of_n_magic"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
])
def test_refused_fields(server, body, param):
    err = post(server, "/v1/completions", dict({"prompt": "Hello", "max_tokens": 2}, **body), 400)["error"]
    assert err["param"] == param and isinstance(err["code"], str)


def test_unknown_fields_everywhere(server):
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for path, body, param in [
        ("/v1/chat/completions", dict(chat, frobnicate=True), "frobnicate"),
        ("/v1/chat/completions", dict(chat, stream_options={"include_usage": True, "x": 1}), "stream_options.x"),
        ("/generate/", {"prompts": ["hi"], "max_tokens": 2, "sampling": {}}, "sampling"),
    ]:
        err = post(server, path, body, 400)["error"]
        assert err == {"message": err["message"], "type": "invalid_request_error", "param": param,
                       "code": "unknown_field"}, err
        assert repr(param) in err["message"]


def test_error_codes_are_strings(server):
    cases = [httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": "x"}, timeout=T),
             httpx.post(server.url + "/v1/completions", json={"max_tokens": 2}, timeout=T),
             httpx.post(server.url + "/v1/completions", content=b"{", timeout=T,
                        headers={"content-type": "application/json"}),
             httpx.get(server.url + "/v1/nowhere", timeout=T),
             httpx.get(server.url + "/v1/completions", timeout=T),
             httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "model": "other"}, timeout=T)]
    codes = []
    for r in cases:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["code"], str), r.text
        codes.append(err["code"])
    assert codes == ["invalid_value", "missing_field", "invalid_json", "not_found", "method_not_allowed",
                     "model_not_found"]


def test_model_may_be_omitted(server):
    out = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 1})
    served = httpx.get(server.url + "/v1/models", timeout=T).json()["data"][0]["id"]
    assert out["model"] == served


def test_models_card_has_vllms_keys(server):
    """``/v1/models``' card carries every key of vLLM's ``ModelCard``, ``permission`` included
    (vLLM sends one default ``ModelPermission``)."""
    card = httpx.get(server.url + "/v1/models", timeout=T).json()["data"][0]
    assert set(card) == {"id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"}
    (perm,) = card["permission"]
    assert perm["id"].startswith("modelperm-") and perm["created"] == card["created"], perm
    assert {k: v for k, v in perm.items() if k not in ("id", "created")} == {
        "object": "model_permission", "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
        "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
        "group": None, "is_blocking": False}


def test_chat_template_tools_truncation(server, hf):
    tok = hf[1]
    msgs = [{"role": "user", "content": "Hello"}]
    out = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1, "return_token_ids": True,
                                               "chat_template": "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"})
    assert out["prompt_token_ids"] == tok.encode("<Hello>", add_special_tokens=False)
    err = post(server, "/v1/chat/completions", {"messages": msgs, "chat_template": "{% for %}"}, 400)["error"]
    assert err["param"] == "chat_template"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    template = "{{ tools[0]['function']['name'] }}:{% for m in messages %}{{ m['content'] }}{% endfor %}"
    out = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1, "return_token_ids": True,
                                               "tools": tools, "tool_choice": "none", "chat_template": template})
    assert out["prompt_token_ids"] == tok.encode("f:Hello", add_special_tokens=False)
    for choice in (None, "auto"):
        body = {"messages": msgs, "tools": tools, **({"tool_choice": choice} if choice else {})}
        assert post(server, "/v1/chat/completions", body, 400)["error"]["param"] == "tool_choice"
    c = post(server, "/v1/completions", {"prompt": [5, 6, 7, 8, 9], "max_tokens": 1, "truncate_prompt_tokens": 2,
                                         "return_token_ids": True})["choices"][0]
    assert c["prompt_token_ids"] == [8, 9]


def test_tokenize_detokenize(server, hf):
    """vLLM's /tokenize and /detokenize (what ``vllm bench serve`` aligns its prompts with): the
    server's tokenizer, the chat form rendered exactly as /v1/chat/completions renders it."""
    tok = hf[1]
    text = "Hello world, the capital of France"
    out = post(server, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert out["tokens"] == tok.encode(text) and out["count"] == len(out["tokens"]) and out["max_model_len"] == 128
    assert out["token_strs"] == tok.convert_ids_to_tokens(out["tokens"])
    bare = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert bare["tokens"] == tok.encode(text, add_special_tokens=False) and bare["token_strs"] is None
    msgs = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"},
            {"role": "user", "content": [{"type": "text", "text": "How "}, {"type": "text", "text": "are you?"}]}]
    chat = post(server, "/tokenize", {"messages": msgs})
    ref = tok.apply_chat_template([dict(m, content="How are you?") if i == 2 else m for i, m in enumerate(msgs)],
                                  tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tok.encode(ref, add_special_tokens=False)
    gen = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1, "return_token_ids": True})
    assert gen["prompt_token_ids"] == chat["tokens"]
    ids = [0, 5, 17, 42, 2]
    assert post(server, "/detokenize", {"tokens": ids})["prompt"] == tok.decode(ids)  # special tokens kept
    for path, body, status, param, code in [
        ("/tokenize", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate", "unknown_field"),
        ("/tokenize", {"prompt": "x", "tools": []}, 400, "tools", "unknown_field"),
        ("/tokenize", {"prompt": "x", "messages": msgs}, 400, "prompt", "invalid_request"),
        ("/tokenize", {"messages": []}, 400, "messages", "invalid_request"),
        ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model", "model_not_found"),
        ("/detokenize", {"tokens": [5, 10 ** 6]}, 400, "tokens", "invalid_token_id"),
        ("/detokenize", {"tokens": [True]}, 400, "tokens.0", "invalid_value"),
    ]:
        err = post(server, path, body, status)["error"]
        assert (err["param"], err["code"]) == (param, code), (path, body, err)


@pytest.mark.parametrize("flag,value", [("--kv-cache-dtype", "int8"), ("--speculative-config", '{"method": "ngram"}'),
                                        ("--distributed-executor-backend", "ray")])
def test_flags_rlserve_cannot_honour(model_dir, flag, value):
    out = subprocess.run([sys.executable, "-m", "rlserve", "serve", model_dir, flag, value], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and flag in out.stderr, out.stderr


def test_flags_that_do_not_apply_warn(server):
    log = server.log_tail(1_000_000)
    assert "--enable-scale-out does not apply" in log
