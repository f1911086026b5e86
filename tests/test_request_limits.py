"""Request-size bounds (issue 23): every knob that sizes a request is refused up front with a
400 naming the field (n and best_of against --max-num-seqs, prompts x n against
--max-request-sequences, logprobs counts, stop lists), a text prompt longer than the context
can hold is refused before it is tokenized, and a body over --max-request-body-bytes gets a
413 before it is parsed; the server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest

from rlserve.server.limits import MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS, max_prompt_chars
from rlserve.server.testing import ServerProcess

TIMEOUT = 60.0
MAX_SEQS = 4
MAX_REQ_SEQS = 8
BODY_LIMIT = 1 << 20


@pytest.fixture(scope="module")
def server(tiny_model):
    with ServerProcess(tiny_model("llama"), "--max-model-len", "128", "--max-num-seqs", str(MAX_SEQS),
                       "--max-request-sequences", str(MAX_REQ_SEQS), "--max-request-body-bytes", str(BODY_LIMIT),
                       "--device", "cpu", "--disable-access-log") as srv:
        yield srv


def _chat(**kw):
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


def _cmpl(**kw):
    return {"prompt": "hi", "max_tokens": 2, **kw}


BOUNDS = [
    # (name, path, body, param)
    ("n over max-num-seqs", "/v1/completions", _cmpl(n=MAX_SEQS + 1), "n"),
    ("n a million", "/v1/completions", _cmpl(n=1_000_000), "n"),
    ("best_of a million", "/v1/completions", _cmpl(n=1_000_000, best_of=1_000_000), "n"),
    ("chat n a million", "/v1/chat/completions", _chat(n=1_000_000), "n"),
    ("trl n a million", "/generate/", {"prompts": ["hi"], "generation_kwargs": {"n": 1_000_000}}, "generation_kwargs.n"),
    ("trl n field", "/generate/", {"prompts": ["hi"], "n": 1_000_000}, "n"),
    ("prompts x n", "/v1/completions", _cmpl(prompt=["hi"] * 3, n=MAX_SEQS), "prompt"),
    ("too many prompts", "/v1/completions", _cmpl(prompt=["hi"] * (MAX_REQ_SEQS + 1)), "prompt"),
    ("trl prompts x n", "/generate/", {"prompts": ["a", "b", "c"], "n": MAX_SEQS}, "prompts"),
    ("max_tokens zero", "/v1/completions", _cmpl(max_tokens=0), "max_tokens"),
    ("trl max_tokens negative", "/generate/", {"prompts": ["hi"], "generation_kwargs": {"max_tokens": -(10 ** 18)}},
     "generation_kwargs.max_tokens"),
    ("trl logprobs through kwargs", "/generate/", {"prompts": ["hi"], "generation_kwargs": {"logprobs": 10 ** 6}},
     "generation_kwargs.logprobs"),
    ("trl prompt_logprobs", "/generate/", {"prompts": ["hi"], "generation_kwargs": {"prompt_logprobs": 10 ** 6}},
     "generation_kwargs.prompt_logprobs"),
    ("chat top_logprobs", "/v1/chat/completions", _chat(logprobs=True, top_logprobs=10 ** 6), "top_logprobs"),
    ("too many stop strings", "/v1/completions", _cmpl(stop=[f"s{i}" for i in range(MAX_STOP + 1)]), "stop"),
    ("long stop string", "/v1/completions", _cmpl(stop="x" * (MAX_STOP_CHARS + 1)), "stop"),
    ("too many stop ids", "/v1/chat/completions", _chat(stop_token_ids=[3] * (MAX_STOP_TOKEN_IDS + 1)),
     "stop_token_ids"),
    ("stop id out of vocab", "/v1/completions", _cmpl(stop_token_ids=[10 ** 9]), "stop_token_ids"),
]


@pytest.mark.parametrize("name,path,body,param", BOUNDS, ids=[b[0] for b in BOUNDS])
def test_size_knobs_refused_up_front(server, name, path, body, param):
    r = httpx.post(server.url + path, json=body, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_overlong_text_prompt_refused_before_tokenizing(server, tiny_model):
    from transformers import AutoTokenizer

    bound = max_prompt_chars(AutoTokenizer.from_pretrained(tiny_model("llama")), 128)
    text = "a" * (BODY_LIMIT - 1000)  # a megabyte of one character, under the body limit
    assert len(text) > bound
    for path, body in [("/v1/completions", {"prompt": text}), ("/generate/", {"prompts": [text]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]})]:
        r = httpx.post(server.url + path, json=body, timeout=TIMEOUT)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        # the character count, not a token count: the text was never tokenized; param as vLLM 0.32 names it
        assert err["code"] == "context_length_exceeded" and "characters" in err["message"], err
        assert err["param"] == "input_text", err
    # a prompt at the bound is tokenized as before (and is still too long in tokens here)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "a" * bound}, timeout=TIMEOUT)
    assert r.status_code == 400 and "tokens" in r.json()["error"]["message"]
    assert "characters" not in r.json()["error"]["message"]


def test_body_over_the_limit_is_413_before_parsing(server):
    big = b'{"prompt": "' + b"a" * BODY_LIMIT + b'"}'
    r = httpx.post(server.url + "/v1/completions", content=big, headers={"content-type": "application/json"},
                   timeout=TIMEOUT)
    assert r.status_code == 413, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    # encoded as every other error (the routes' JSONResponse: compact, no spaces); it had ", " and ": "
    assert r.content == json.dumps(r.json(), ensure_ascii=False, separators=(",", ":")).encode(), r.content

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(2 * BODY_LIMIT // 65536):
            yield b"a" * 65536
        yield b'"}'

    r = httpx.post(server.url + "/generate/", content=chunks(), headers={"content-type": "application/json"},
                   timeout=TIMEOUT)
    assert r.status_code == 413, r.text
    # still serving, and a request at the limits is fine
    r = httpx.post(server.url + "/v1/completions", json=_cmpl(prompt=["hi"] * 2, n=MAX_SEQS), timeout=TIMEOUT)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2 * MAX_SEQS, r.text
    metrics = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
    assert 'status="413"' in metrics
