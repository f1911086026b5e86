"""A prompt longer than the whole KV cache (session 21, FIX21 item 1: with ``LLM`` it raised a RuntimeError
in the scheduler). The engine now refuses at start a cache that cannot hold one ``max_model_len`` sequence
(vLLM's rule, :func:`rlserve.kv_size.check_cache_holds_one_sequence`), so such a prompt, or a prompt plus
``max_tokens`` beyond the cache, is beyond ``max_model_len``: a 400 ``context_length_exceeded`` over HTTP
(completions, chat and responses, streamed or not) and an InvalidRequestError (a ValueError) from ``LLM``, both at
admission; the engine goes on serving, and no block stays taken. The cache here is exactly one sequence:
``--max-model-len 64`` in 4 blocks of 16 tokens."""

from __future__ import annotations

import time

import httpx
import pytest

from rlserve import LLM, SamplingParams
from tests.transfer_harness import InProcessServer

LONG = list(range(5, 105))  # 100 token ids: more than the 64 tokens the whole cache holds


@pytest.fixture(scope="module")
def srv(tiny_model):
    s = InProcessServer(tiny_model("llama"), max_model_len=64, num_kv_blocks=4)
    yield s
    s.close()


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route,body,param", [
    # a prompt over max_model_len: vLLM 0.32's param is input_tokens on all three routes (session 22, seen on
    # vLLM CPU's own server at --max-model-len 64; rlserve said "prompt", a field chat and responses lack)
    ("/v1/completions", {"prompt": LONG, "max_tokens": 4}, "input_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 100}], "max_tokens": 4},
     "input_tokens"),
    ("/v1/responses", {"input": "hi " * 100, "max_output_tokens": 4}, "input_tokens"),
    # exactly max_model_len tokens, no room for an output: vLLM names max_tokens (it clamps it to 0 and refuses)
    ("/v1/completions", {"prompt": LONG[:64], "max_tokens": 4}, "max_tokens"),
])
def test_beyond_the_cache_is_a_400_and_the_engine_serves_on(srv, route, body, param, stream):
    r = httpx.post(srv.url + route, json=dict(body, model=srv.config.model, stream=stream), timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == param, err
    assert "maximum context length is 64 tokens" in err["message"], err
    # a request that fills the whole cache still runs to its end
    ok = httpx.post(srv.url + "/v1/completions", json={"model": srv.config.model, "prompt": LONG[:40],
                                                       "max_tokens": 24, "ignore_eos": True,
                                                       "return_token_ids": True}, timeout=120)
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["choices"][0]["token_ids"]) == 24
    deadline = time.monotonic() + 60  # the gauges follow the engine's stats: wait for the idle state
    while (_metric(srv.url, "vllm:kv_cache_usage_perc"), _metric(srv.url, "vllm:num_requests_running")) != (0, 0):
        assert time.monotonic() < deadline, "KV blocks or a running request left behind"
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route,body,field", [
    ("/v1/completions", {"prompt": LONG[:40], "max_tokens": 40}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}, "max_tokens"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 64}, "max_output_tokens"),
])
def test_max_tokens_beyond_the_cache_is_clamped_to_it(srv, route, body, field, stream):
    """prompt + max_tokens over max_model_len (= the whole 4-block cache here): max_tokens is clamped to the room
    the prompt leaves, a 200 as vLLM 0.32's server answers (its own server, session 22: 24 tokens for this
    40-token prompt with max_tokens 40 at --max-model-len 64); the answer ends there with "length" (ignore_eos),
    and the cache is free again after it."""
    extra = {"ignore_eos": True, "temperature": 0} if route != "/v1/responses" else {"temperature": 0}
    r = httpx.post(srv.url + route, json=dict(body, model=srv.config.model, stream=stream, **extra), timeout=120)
    assert r.status_code == 200, r.text
    if not stream:
        usage = r.json()["usage"]
        n_in = usage.get("prompt_tokens", usage.get("input_tokens"))
        n_out = usage.get("completion_tokens", usage.get("output_tokens"))
        assert n_in + n_out <= 64 and n_out <= body[field], usage
        if route == "/v1/completions":  # ignore_eos: all the room is used
            assert (n_in, n_out) == (40, 24), usage
    deadline = time.monotonic() + 60
    while (_metric(srv.url, "vllm:kv_cache_usage_perc"), _metric(srv.url, "vllm:num_requests_running")) != (0, 0):
        assert time.monotonic() < deadline, "KV blocks or a running request left behind"
        time.sleep(0.05)


def test_llm_refuses_at_admission_and_serves_on(tiny_model):
    llm = LLM(tiny_model("llama"), dtype="float32", device="cpu", max_model_len=64, num_kv_blocks=4)
    with pytest.raises(ValueError, match="maximum context length is 64 tokens"):
        llm.generate([LONG], SamplingParams(max_tokens=4))
    assert not llm.engine.requests and llm.engine.block_manager.num_free_blocks == 4
    # max_tokens beyond the room left: clamped (24 = 64 - 40), the whole cache used, then freed
    out = llm.generate([LONG[:40]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 24 and out.outputs[0].finish_reason == "length"
    assert llm.engine.block_manager.num_free_blocks == 4


def test_serve_device_auto_without_cuda_refuses_a_short_cache_before_the_engine(tiny_model, tmp_path):
    """``rlserve serve`` with ``--device auto`` (the default) where the driver sees no CUDA device: the default
    512 MiB CPU cache is checked before the engine starts, as with ``--device cpu`` (session 22: the refusal came
    from the engine-core process after the model loaded, "could not start the engine: ...", blocks only).
    Exit 2, one line with the bytes: the tiny llama's block of 16 tokens takes 8192 bytes, 512 MiB hold 65,536
    blocks (1,048,576 tokens); ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` lets 1,200,000 (75,000 blocks) through."""
    import os
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("--device auto is the GPU here (its cache would hold the sequence)")
    env = dict(os.environ, VLLM_ALLOW_LONG_MAX_MODEL_LEN="1")
    env.pop("RLSERVE_ENGINE_MODE", None)
    out = subprocess.run([sys.executable, "-m", "rlserve", "serve", tiny_model("llama"), "--max-model-len", "1200000",
                          "--port", "0"], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    err = out.stderr
    assert out.returncode == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        "rlserve serve: error: To serve at least one request with the model's max seq len (1200000), KV cache for "
        "75000 blocks is needed (75000 blocks of 16 tokens, 614400000 bytes), which is larger than the available KV "
        "cache memory (--kv-cache-bytes 536870912 (the default): 65536 blocks of 16 tokens, 536870912 bytes; 8192 "
        "bytes per block); the longest --max-model-len it holds is 1048576. Raise --kv-cache-bytes or lower "
        "--max-model-len"), err[-3000:]


@pytest.mark.parametrize("device, cuda_devices, checked", [
    ("auto", 0, True), ("auto", None, True),  # no CUDA device (or no driver): the engine runs on the CPU
    ("auto", 1, False),  # a CUDA device: the GPU sizes its cache from its memory and reads no --kv-cache-bytes
    ("cpu", 1, True), ("cuda", 1, False)])
def test_serve_checks_kv_cache_bytes_only_where_the_engine_runs_on_the_cpu(tiny_model, monkeypatch, capsys, device,
                                                                          cuda_devices, checked):
    """``rlserve serve``'s check before the engine starts follows the device the engine will use, CUDA stood in for
    at the decision (the driver's device count; the device check after it stops the start). ``--kv-cache-bytes
    32768`` holds 4 of the tiny llama's 16-token blocks of 8,192 bytes: 64 tokens, short of --max-model-len 128.
    Before session 23 ``--device auto`` with a CUDA device got this CPU check too (refused: fails on the old code).
    ``--num-kv-blocks 4`` is checked on every device."""
    from rlserve.cli import main, serve_checks

    monkeypatch.setattr(serve_checks, "driver_device_count", lambda: cuda_devices)

    def past_the_kv_check(config):
        raise ValueError("past the KV check")

    monkeypatch.setattr(serve_checks, "check_device", past_the_kv_check)
    path = tiny_model("llama")
    want = ("To serve at least one request with the model's max seq len (128), KV cache for 8 blocks is needed "
            "(8 blocks of 16 tokens, 65536 bytes), which is larger than the available KV cache memory "
            "(--kv-cache-bytes 32768: 4 blocks of 16 tokens, 32768 bytes; 8192 bytes per block); the longest "
            "--max-model-len it holds is 64. Raise --kv-cache-bytes or lower --max-model-len")
    flags = ["serve", path, "--device", device, "--max-model-len", "128", "--port", "0", "--engine-mode", "thread"]
    assert main(flags + ["--kv-cache-bytes", "32768"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "rlserve serve: error: " + (want if checked else "past the KV check")
    assert main(flags + ["--num-kv-blocks", "4"]) == 2
    assert "(--num-kv-blocks 4: 4 blocks of 16 tokens" in capsys.readouterr().err


@pytest.mark.parametrize("device, cuda_devices, warned", [
    ("auto", 1, True), ("cuda", 1, True),  # the GPU sizes its cache from --gpu-memory-utilization
    ("auto", 0, False), ("auto", None, False), ("cpu", 1, False)])  # the engine runs on the CPU: it reads the flag
def test_serve_warns_that_a_gpu_ignores_kv_cache_bytes(tiny_model, monkeypatch, caplog, device, cuda_devices, warned):
    """``--kv-cache-bytes`` where the engine will run on a CUDA device (the driver's device count stood in at the
    decision; the device check after it stops the start): one warning that the GPU ignores it, naming the flag
    that does size the GPU's cache; none on the CPU, and none with ``--num-kv-blocks`` (it wins everywhere)."""
    import logging

    from rlserve.cli import main, serve_checks

    monkeypatch.setattr(serve_checks, "driver_device_count", lambda: cuda_devices)

    def past_the_kv_check(config):
        raise ValueError("past the KV check")

    monkeypatch.setattr(serve_checks, "check_device", past_the_kv_check)
    flags = ["serve", tiny_model("llama"), "--device", device, "--max-model-len", "128", "--port", "0",
             "--engine-mode", "thread", "--kv-cache-bytes", "1048576"]  # 128 blocks of 8,192 bytes: 2,048 tokens
    with caplog.at_level(logging.WARNING, logger="rlserve.serve"):
        assert main(flags) == 2
    warnings = [r.getMessage() for r in caplog.records
                if r.name == "rlserve.serve" and "--kv-cache-bytes" in r.getMessage()]
    assert warnings == ([f"--kv-cache-bytes 1048576 is ignored on a CUDA device (--device {device}): the GPU sizes its "
                         "KV cache from --gpu-memory-utilization; use --num-kv-blocks to fix its size"]
                        if warned else [])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlserve.serve"):
        assert main(flags + ["--num-kv-blocks", "16"]) == 2
    assert not [r for r in caplog.records if "--kv-cache-bytes" in r.getMessage()]
