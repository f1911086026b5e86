"""What a newcomer meets (issue 21): streamed chat never sends an empty ``delta.content``
mid-stream; ``/tokenize`` does not hold up the API process while it encodes; ``/metrics``
carries vLLM's metric names and the weight-sync metrics; ``--help`` states each default once and
every flag has help; ``client.pause()`` and ``POST /pause`` share one default."""

from __future__ import annotations

import argparse
import inspect
import json
import threading

import httpx
import pytest

from rlserve.cli import build_parser
from rlserve.cli._help import HelpFormatter
from rlserve.transfer import HTTPWeightSyncClient, WeightSyncHTTPError
from tests.transfer_harness import InProcessServer, wrong_second_bucket_sum
from tests.transfer_sync import llama, trainer  # noqa: F401 (llama: a fixture)

TIMEOUT = 120.0  # a hang bound: a chat request on a busy machine may wait for its worker's start


@pytest.fixture(scope="module")
def server(llama):
    """One in-process server for the module's tests, in file order: streamed chat, metrics (deltas
    of the counters; its failed sync leaves the model refusing until a full one), the pause
    default (leaves the server paused)."""
    with InProcessServer(llama[0]) as srv:
        yield srv


def _sse(url: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", url, json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    return chunks


def test_stream_chat_sends_no_empty_content_mid_stream(server):
    body = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 100, "temperature": 1.0,
            "seed": 7, "ignore_eos": True, "return_token_ids": True, "logprobs": True}
    srv = server
    full = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=TIMEOUT).json()["choices"][0]
    chunks = _sse(srv.url + "/v1/chat/completions", dict(body, stream=True))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # OpenAI's first chunk
    content, ids, logprobs, multi = "", [], [], 0
    for ch in chunks[1:]:
        (c,) = ch["choices"]
        if c["finish_reason"] is None:
            assert c["delta"].get("content"), f"empty content mid-stream: {ch}"
        content += c["delta"].get("content", "")
        ids += c["token_ids"]
        logprobs += c["logprobs"]["content"]
        multi += len(c["token_ids"]) > 1
    # nothing lost: the held tokens (and their logprobs) went out with the next text
    assert content == full["message"]["content"] and ids == full["token_ids"] and len(logprobs) == len(ids)
    assert multi > 0, "this sample should contain tokens that are part of one character (the case under test)"


def test_stream_chat_chunks_have_vllms_keys(server):
    """A streamed chat chunk has vLLM's keys (vLLM 0.32's ChatCompletionStreamResponse dumped
    with exclude_unset): the first chunk also ``prompt_token_ids`` and ``prompt_text`` (null
    here); the role choice index/delta/logprobs/finish_reason; content choices also
    ``token_ids`` (null without return_token_ids), and ``stop_reason`` on the choice's last
    chunk only: null after ``max_tokens``, the stop string that ended it (one from the middle of
    the first answer's text). Plus rlserve's ``weight_version`` on every choice and ``weight_versions`` on
    the last. No ``usage``
    key on any chunk before the usage chunk (vLLM sets none), which has exactly the counts and
    the ``system_fingerprint``. (Every object's keys: tests/test_server_vllm_keys.py.)"""
    top = {"id", "object", "created", "model", "choices"}
    common = {"index", "delta", "logprobs", "finish_reason", "weight_version"}
    body = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    stop = None
    for _ in range(2):
        chunks = _sse(server.url + "/v1/chat/completions", dict(body, **({"stop": [stop]} if stop else {})))
        *chunks, usage = chunks
        assert set(usage) == top | {"usage", "system_fingerprint"} and usage["choices"] == [], usage
        assert set(chunks[0]) == top | {"prompt_token_ids", "prompt_text"}, chunks[0]
        assert chunks[0]["prompt_token_ids"] is None and chunks[0]["prompt_text"] is None
        assert [set(ch) for ch in chunks[1:]] == [top] * (len(chunks) - 1), chunks
        choices = [ch["choices"][0] for ch in chunks]
        assert set(choices[0]) == common and choices[0]["delta"] == {"role": "assistant", "content": ""}
        assert [set(c) for c in choices[1:-1]] == [common | {"token_ids"}] * (len(choices) - 2), choices
        assert all(c["token_ids"] is None for c in choices[1:]), choices
        last = choices[-1]
        assert set(last) == common | {"stop_reason", "token_ids", "weight_versions"} and last["stop_reason"] == stop, (stop, last)
        assert last["weight_versions"] == [last["weight_version"]]  # (a stream across a sync: test_stream_versions)
        assert last["finish_reason"] == ("stop" if stop else "length"), last
        # no count of content chunks is asserted: the API process sends what the core has produced
        # when it gets to it, so on a loaded machine several tokens (even all of them) share a chunk
        assert len(choices) >= 2, choices
        text = "".join(c["delta"].get("content", "") for c in choices)
        if stop is None:
            assert usage["usage"]["completion_tokens"] == 40
        stop = text[len(text) // 2]
    # with return_token_ids: the prompt's ids on the first chunk, each delta's ids on its choice
    plain = dict(body, stream=False, stream_options=None, return_token_ids=True)  # stream_options needs stream
    full = httpx.post(server.url + "/v1/chat/completions", json=plain,
                      timeout=TIMEOUT).json()
    chunks = _sse(server.url + "/v1/chat/completions", dict(body, return_token_ids=True))
    assert chunks[0]["prompt_token_ids"] == full["prompt_token_ids"] and chunks[0]["prompt_text"] is None
    assert "token_ids" not in chunks[0]["choices"][0]  # vLLM's role choice has none
    assert [t for ch in chunks[1:-1] for t in ch["choices"][0]["token_ids"]] == full["choices"][0]["token_ids"]
    counts = {"prompt_tokens": len(full["prompt_token_ids"]), "completion_tokens": 40,
              "total_tokens": len(full["prompt_token_ids"]) + 40}
    # as vLLM's: the usage chunk leaves out the null details that the plain answer has
    assert chunks[-1]["usage"] == counts
    assert full["usage"] == dict(counts, prompt_tokens_details=None, completion_tokens_details=None)


def test_stream_completion_chunks_have_vllms_keys(server):
    """A streamed completion choice has vLLM 0.32's keys (CompletionStreamResponse, exclude_unset):
    index, text, logprobs, finish_reason, stop_reason, prompt_token_ids and token_ids (null
    without return_token_ids; with it the prompt's ids on a choice's first chunk only, null
    after, and each delta's ids), plus rlserve's ``weight_version`` (and ``weight_versions`` on the
    last chunk); no ``usage`` key before
    the usage chunk."""
    keys = {"index", "text", "logprobs", "finish_reason", "stop_reason", "prompt_token_ids", "token_ids",
            "weight_version"}
    body = {"prompt": "Hello there", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    *chunks, usage = _sse(server.url + "/v1/completions", body)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    assert all(set(ch) == {"id", "object", "created", "model", "choices"} for ch in chunks), chunks
    choices = [c for ch in chunks for c in ch["choices"]]
    assert all(set(c) == keys and c["token_ids"] is None and c["prompt_token_ids"] is None for c in choices[:-1])
    assert set(choices[-1]) == keys | {"weight_versions"} and choices[-1]["finish_reason"] == "length"
    assert choices[-1]["weight_versions"] == [choices[-1]["weight_version"]]
    plain = dict(body, stream=False, stream_options=None, return_token_ids=True)  # stream_options needs stream
    full = httpx.post(server.url + "/v1/completions", json=plain,
                      timeout=TIMEOUT).json()["choices"][0]
    *chunks, _ = _sse(server.url + "/v1/completions", dict(body, return_token_ids=True))
    choices = [c for ch in chunks for c in ch["choices"]]
    assert all(set(c) == keys for c in choices[:-1]) and set(choices[-1]) == keys | {"weight_versions"}, choices
    assert choices[0]["prompt_token_ids"] == full["prompt_token_ids"]
    assert all(c["prompt_token_ids"] is None for c in choices[1:]), choices
    assert [t for c in choices for t in c["token_ids"]] == full["token_ids"]
    assert "".join(c["text"] for c in choices) == full["text"]


def test_answers_have_vllms_token_id_keys(server):
    """Non-streamed answers carry vLLM 0.32's keys (its Completion/ChatCompletionResponse dumped
    whole) for what rlserve supports: completions ``token_ids``, ``prompt_logprobs``,
    ``prompt_token_ids`` per choice, chat ``token_ids`` per choice and ``prompt_token_ids`` on
    the answer -- null when not asked for, the values when asked."""
    comp = {"prompt": "Hello there", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    (c,) = httpx.post(server.url + "/v1/completions", json=comp, timeout=TIMEOUT).json()["choices"]
    assert (c["token_ids"], c["prompt_logprobs"], c["prompt_token_ids"]) == (None, None, None), c
    asked = httpx.post(server.url + "/v1/completions", timeout=TIMEOUT,
                       json=dict(comp, return_token_ids=True, prompt_logprobs=0)).json()["choices"][0]
    ids = server.app.state.rlserve.tokenizer.encode("Hello there")
    assert asked["prompt_token_ids"] == ids and len(asked["token_ids"]) == 4
    assert asked["prompt_logprobs"][0] is None and len(asked["prompt_logprobs"]) == len(ids)
    chat = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=TIMEOUT).json()
    assert r["prompt_token_ids"] is None and r["choices"][0]["token_ids"] is None, r
    asked = httpx.post(server.url + "/v1/chat/completions", json=dict(chat, return_token_ids=True),
                       timeout=TIMEOUT).json()
    assert len(asked["prompt_token_ids"]) == asked["usage"]["prompt_tokens"]
    assert len(asked["choices"][0]["token_ids"]) == 4 and asked["choices"][0]["message"] == r["choices"][0]["message"]


def test_stream_continuous_usage_stats(server):
    """``stream_options: {include_usage, continuous_usage_stats}`` (vLLM's): every chunk carries
    the usage so far -- chat: the role chunk 0 completion tokens and vLLM's
    ``completion_tokens_details: null``, then the tokens generated so far, rising to the total;
    completions: the same counts -- and the last chunk the request's usage; without
    ``include_usage`` the flag does nothing (as in vLLM)."""
    chat = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    *chunks, last = _sse(server.url + "/v1/chat/completions", chat)
    n_prompt = len(chunks[0]["prompt_token_ids"])
    assert chunks[0]["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 0, "total_tokens": n_prompt,
                                  "completion_tokens_details": None}
    sent = 0
    for ch in chunks[1:]:
        sent += len(ch["choices"][0]["token_ids"])
        assert ch["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": sent, "total_tokens": n_prompt + sent,
                               "completion_tokens_details": None}, ch
    assert sent == 12 and last["choices"] == [] and last["usage"] == {
        "prompt_tokens": n_prompt, "completion_tokens": 12, "total_tokens": n_prompt + 12}
    comp = {"prompt": "Hello there", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    *chunks, last = _sse(server.url + "/v1/completions", comp)
    n_prompt = len(chunks[0]["choices"][0]["prompt_token_ids"])
    sent = 0
    for ch in chunks:
        sent += len(ch["choices"][0]["token_ids"])
        assert ch["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": sent, "total_tokens": n_prompt + sent}
    assert sent == 12 and last["usage"]["completion_tokens"] == 12
    for route, body in (("/v1/chat/completions", chat), ("/v1/completions", comp)):
        only = dict(body, stream_options={"continuous_usage_stats": True})
        assert all("usage" not in ch for ch in _sse(server.url + route, only)), route


#: a body for each route that encodes text: (route, body)
ENCODING_ROUTES = [
    ("/tokenize", {"prompt": "Hello world"}),
    ("/v1/completions", {"prompt": ["Hello world", "Hi"], "max_tokens": 2, "temperature": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello world"}], "max_tokens": 2}),
    ("/generate/", {"prompts": ["Hello world"], "max_tokens": 2}),
    ("/v1/responses", {"input": "Hello world", "max_output_tokens": 2}),
]


@pytest.mark.parametrize("route,body", ENCODING_ROUTES, ids=[r for r, _ in ENCODING_ROUTES])
def test_prompt_text_is_encoded_off_the_event_loop(server, monkeypatch, route, body):
    """While a route's encode runs (here: held until the test lets it go; a long prompt takes
    the tokenizer a while), the API process still answers: the encode is not on its event loop.
    The request then succeeds (``/tokenize``: with the tokenizer's own ids)."""
    tok = server.app.state.rlserve.tokenizer
    real = type(tok).encode  # (the class's: the tokenizer threads encode with copies of their own)
    real_call = type(tok).__call__  # the completion routes' micro-batches: tok(texts)
    entered, release = threading.Event(), threading.Event()

    def held(fn):
        def run(self, text, **kw):
            entered.set()
            release.wait(TIMEOUT)
            return fn(self, text, **kw)
        return run

    monkeypatch.setattr(type(tok), "encode", held(real))
    monkeypatch.setattr(type(tok), "__call__", held(real_call))
    box: dict = {}
    caller = threading.Thread(target=lambda: box.setdefault("r", httpx.post(server.url + route, json=body,
                                                                            timeout=TIMEOUT)))
    caller.start()
    try:
        assert entered.wait(TIMEOUT), f"{route} never reached the tokenizer"
        try:  # on the event loop, the encode would hold this answer until `release` (TIMEOUT)
            health = httpx.get(server.url + "/health", timeout=10).status_code
        except httpx.TimeoutException:
            health = f"no answer while {route} encodes"
        assert health == 200
    finally:
        release.set()
        caller.join(TIMEOUT)
    r = box["r"]
    assert r.status_code == 200, r.text
    if route == "/tokenize":
        assert r.json()["tokens"] == real(tok, "Hello world")


def _metric(text: str, name: str, default: float | None = None, **labels) -> float:
    """The sum of ``name``'s samples with ``labels``; ``default`` when it has none (else an
    AssertionError)."""
    total, found = 0.0, False
    for ln in text.splitlines():
        if ln.startswith("#") or not ln.startswith(name):
            continue
        head, value = ln.rsplit(" ", 1)
        metric = head.split("{", 1)[0]
        if metric != name or not all(f'{k}="{v}"' in head for k, v in labels.items()):
            continue
        total += float(value)
        found = True
    if not found and default is not None:
        return default
    assert found, f"{name} {labels} not in /metrics"
    return total


VLLM_NAMES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_count", "vllm:request_time_per_output_token_seconds_count",
    "vllm:request_prompt_tokens_sum", "vllm:request_generation_tokens_sum", "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
]


def test_metrics_vllm_names_and_weight_sync(llama, server, monkeypatch):
    path, hf = llama
    srv = server
    # the module's server: the request counters are read as deltas
    counters = ("vllm:generation_tokens_total", "vllm:prompt_tokens_total", "vllm:inter_token_latency_seconds_count",
                "vllm:e2e_request_latency_seconds_count")
    text = httpx.get(srv.url + "/metrics", timeout=TIMEOUT).text
    before = {n: _metric(text, n, default=0.0) for n in counters}
    success = _metric(text, "vllm:request_success_total", default=0.0, finished_reason="length")
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 9, "n": 2,
                                                      "ignore_eos": True, "temperature": 0}, timeout=TIMEOUT)
    assert r.status_code == 200
    text = httpx.get(srv.url + "/metrics", timeout=TIMEOUT).text
    for name in VLLM_NAMES:
        _metric(text, name, model_name=path)
    delta = {n: _metric(text, n) - before[n] for n in counters}
    assert delta["vllm:generation_tokens_total"] == 18
    assert delta["vllm:prompt_tokens_total"] == 3
    assert _metric(text, "vllm:request_success_total", finished_reason="length") - success == 2
    # one inter-token gap per token after the first, per sample
    assert delta["vllm:inter_token_latency_seconds_count"] == 16
    assert delta["vllm:e2e_request_latency_seconds_count"] == 1
    assert _metric(text, "vllm:num_requests_running") == 0
    # a good sync, then one that fails (a wrong bucket checksum)
    eng = trainer(srv.url, hf)
    eng.send_weights()
    text = httpx.get(srv.url + "/metrics", timeout=TIMEOUT).text
    sync = dict(backend="gloo", mode="none")
    assert _metric(text, "rlserve_weight_sync_duration_seconds_count", **sync) == 1
    assert _metric(text, "rlserve_weight_syncs_total", **sync) == 1
    n_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    assert _metric(text, "rlserve_weight_sync_bytes_total", **sync) == n_bytes
    assert _metric(text, "rlserve_weight_version_number") == 1
    paused = _metric(text, "rlserve_generation_paused_seconds_total")
    assert paused > 0  # an in-place update pauses generation for its length
    wrong_second_bucket_sum(monkeypatch)
    with pytest.raises(WeightSyncHTTPError):
        eng.send_weights()
    text = httpx.get(srv.url + "/metrics", timeout=TIMEOUT).text
    assert _metric(text, "rlserve_weight_sync_failures_total", **sync) == 1
    assert _metric(text, "rlserve_weight_syncs_total", **sync) == 1
    assert _metric(text, "rlserve_generation_paused_seconds_total") > paused


def _subparsers():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [parser] + list(sub.choices.values())


def test_help_states_defaults_once_and_every_flag_has_help():
    for p in _subparsers():
        text = p.format_help()
        assert "(default: None)" not in text, p.prog
        for action in p._actions:
            assert action.help, f"{p.prog} {action.option_strings or action.dest} has no help"
            if p.formatter_class is HelpFormatter:
                shown = HelpFormatter(p.prog)._get_help_string(action)
                assert shown.count("default:") <= 1, (p.prog, action.option_strings, shown)
    serve = dict((p.prog.split()[-1], p) for p in _subparsers())["serve"]
    assert serve.formatter_class is HelpFormatter
    help_of = {s: a.help for a in serve._actions for s in a.option_strings}
    assert help_of["--log-level"] and help_of["-tp"]


def test_pause_has_one_default(server):
    sdk_default = inspect.signature(HTTPWeightSyncClient.pause).parameters["mode"].default
    srv = server
    # the module's server; this test leaves it paused
    schema = httpx.get(srv.url + "/openapi.json", timeout=TIMEOUT).json()
    params = schema["paths"]["/pause"]["post"]["parameters"]
    route_default = next(p for p in params if p["name"] == "mode")["schema"]["default"]
    assert sdk_default == route_default == "abort"
    HTTPWeightSyncClient(srv.url).pause()
    assert httpx.get(srv.url + "/is_paused", timeout=TIMEOUT).json() == {"is_paused": True, "mode": "abort"}
    HTTPWeightSyncClient(srv.url).resume()
    assert httpx.post(srv.url + "/pause", timeout=TIMEOUT).json()["mode"] == "abort"


def test_examples_take_the_demo_flags():
    import subprocess
    import sys

    from rlserve.demo import example_parser

    demo = dict((p.prog.split()[-1], p) for p in _subparsers())["demo"]
    flags = {s for a in demo._actions for s in a.option_strings} - {"--backend"}
    assert {s for a in example_parser(None)._actions for s in a.option_strings} == flags
    assert {s for a in example_parser(None, demo_flags=False)._actions for s in a.option_strings} == \
        {"-h", "--help", "--model", "--port", "--max-tokens"}
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for script in ("rlhf_cpu_gloo.py", "rlhf_colocate_ipc.py", "rlhf_http_nccl.py"):
        out = subprocess.run([sys.executable, os.path.join(root, "examples", script), "--help"], capture_output=True,
                             text=True, timeout=120, env=env)
        assert out.returncode == 0 and "--port" in out.stdout and "--model" in out.stdout, (script, out.stderr)
