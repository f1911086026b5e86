"""vLLM's LoRA routes on ``rlserve serve --enable-lora`` (two data-parallel replicas in engine-core
processes): load / unload with vLLM's answers and errors, ``/v1/models`` and ``/server_info``,
a request picks an adapter by ``model`` and gets PEFT's merged model's greedy tokens, unload
leaves a running request on its adapter, and a load reaches every replica before it answers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time

import httpx
import pytest

from rlserve.server.testing import ServerProcess
from tests.lora_adapters import hf_greedy_logprobs, make_adapter, merged_model

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def files(tiny_model, tmp_path_factory):
    base = tiny_model("llama")
    d = tmp_path_factory.mktemp("lora-server")
    return base, {"a1": make_adapter(base, d / "a1", seed=11, r=8), "a2": make_adapter(base, d / "a2", seed=12, r=16),
                  "a3": make_adapter(base, d / "a3", seed=13, r=4), "big": make_adapter(base, d / "big", seed=14, r=32)}


@pytest.fixture(scope="module")
def server(files):
    base, ad = files
    with ServerProcess(base, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "-dp", "2",
                       "--max-model-len", "128", "--lora-modules", f"a3={ad['a3']}") as srv:
        yield srv


def _lora_numel_per_rank(base: str) -> int:
    """sum over the decoder's seven projections of (in + out) features: one rank's factor elements."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(base)
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    h, i, q, kv = c.hidden_size, c.intermediate_size, c.num_attention_heads * d, c.num_key_value_heads * d
    return c.num_hidden_layers * ((h + q) * 2 + (h + kv) * 2 + 3 * (h + i))


def _load(srv, name, path, **kw):
    return httpx.post(f"{srv.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path, **kw}, timeout=60)


def _unload(srv, name):
    return httpx.post(f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)


def _complete(srv, model, max_tokens=8, **kw):
    r = httpx.post(f"{srv.url}/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                                                      "temperature": 0, "ignore_eos": True, **kw}, timeout=120)
    return r


def _ids(r):
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_lora_routes_and_outputs(server, files):
    base, ad = files
    info = httpx.get(f"{server.url}/server_info").json()["vllm_config"]
    assert info["lora_config"]["max_loras"] == 2 and info["lora_config"]["max_lora_rank"] == 16
    # --lora-modules loaded a3 at start-up; a2 fills the second place
    r = _load(server, "a2", ad["a2"])
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a2' added successfully."
    models = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert [m["id"] for m in models] == [base, "a3", "a2"]
    held = {a["name"]: a for a in httpx.get(f"{server.url}/server_info").json()["lora_adapters"]}
    assert held["a2"]["rank"] == 16 and held["a2"]["path"] == ad["a2"] and held["a3"]["rank"] == 4
    # rank 16 on q/k/v/o/gate/up/down of the tiny Llama's layers, float32: r x (in + out) x 4 bytes each
    assert held["a2"]["bytes"] == 16 * 4 * _lora_numel_per_rank(base)
    assert models[2]["root"] == ad["a2"] and models[2]["parent"] == base and models[0]["parent"] is None
    # errors, as vLLM words them
    r = _load(server, "a2", ad["a2"])
    assert r.status_code == 400 and "has already been loaded" in r.json()["error"]["message"]
    r = _load(server, "a1", ad["a1"])
    assert r.status_code == 400 and "--max-loras 2" in r.json()["error"]["message"]
    r = _load(server, base, ad["a1"])
    assert r.status_code == 400 and "conflicts with a served base model" in r.json()["error"]["message"]
    r = _unload(server, "nope")
    assert r.status_code == 404 and r.json()["error"]["message"] == "The lora adapter 'nope' cannot be found."
    assert _unload(server, "a3").text == "Success: LoRA adapter 'a3' removed successfully."
    r = _load(server, "x", "/nonexistent/adapter")
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "Loading lora x failed: No adapter found for /nonexistent/adapter"
    r = _load(server, "big", ad["big"])
    assert r.status_code == 400 and "LoRA rank 32 is greater than max_lora_rank 16" in r.json()["error"]["message"]
    r = _complete(server, "a3")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    # outputs: PEFT's merged model, on both replicas (four requests at once spread over the two)
    assert _load(server, "a1", ad["a1"]).status_code == 200
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    for name in ("a1", "a2"):
        want, _ = hf_greedy_logprobs(merged_model(base, ad[name]), tok, 8)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda _: _ids(_complete(server, name, return_token_ids=True)), range(4)))
        assert got == [want] * 4, name
    want_base, _ = hf_greedy_logprobs(merged_model(base, None), tok, 8)
    assert _ids(_complete(server, base, return_token_ids=True)) == want_base
    assert want_base != want


def test_unload_leaves_running_request_on_its_adapter(server, files):
    base, ad = files
    assert "a2" in [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]]  # the test above
    long = 100
    first = _ids(_complete(server, "a2", max_tokens=long, return_token_ids=True))

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            async with c.stream("POST", f"{server.url}/v1/completions", json={
                    "model": "a2", "prompt": PROMPT, "max_tokens": long, "temperature": 0, "ignore_eos": True,
                    "stream": True, "return_token_ids": True}) as resp:
                assert resp.status_code == 200
                toks, unloaded = [], False
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    toks += json.loads(line[6:])["choices"][0].get("token_ids") or []
                    if toks and not unloaded:  # the request is running on a2: unload it now
                        r = await c.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "a2"})
                        assert r.status_code == 200, r.text
                        unloaded = True
                return toks, unloaded

    toks, unloaded = asyncio.run(run())
    assert unloaded and toks == first
    assert _complete(server, "a2").status_code == 404


def test_load_reaches_every_replica(files):
    """In-process, two data-parallel replicas in engine-core processes: when the load returns both
    hold the adapter; a refused load leaves neither holding anything; unload frees both."""
    from rlserve.config import EngineConfig
    from rlserve.engine.front.async_engine import AsyncEngine
    from rlserve.errors import LoRAAdapterError
    from rlserve.lora.registry import LoRARegistry

    base, ad = files
    cfg = EngineConfig(model=base, device="cpu", dtype="float32", data_parallel_size=2, enable_lora=True,
                       max_loras=2, max_lora_rank=16, max_model_len=64)
    aengine = AsyncEngine(cfg, engine_mode="process")
    try:
        reg = LoRARegistry(aengine, [base], cfg.max_loras, cfg.max_lora_rank)

        async def run():
            held = "rlserve.lora.engine_ops:held_adapters"
            rec = await reg.load("a1", ad["a1"])
            assert await aengine.call_engines(held) == [[rec.lora_int_id]] * 2
            with pytest.raises(LoRAAdapterError, match="greater than max_lora_rank"):
                await reg.load("big", ad["big"])
            assert await aengine.call_engines(held) == [[rec.lora_int_id]] * 2
            again = await reg.load("a1", ad["a2"], load_inplace=True)  # a new id; the old one is freed
            assert again.lora_int_id != rec.lora_int_id
            assert await aengine.call_engines(held) == [[again.lora_int_id]] * 2
            await reg.unload("a1")
            assert await aengine.call_engines(held) == [[], []]

        asyncio.run(run())
    finally:
        aengine.shutdown()


def _held(srv) -> float:
    m = httpx.get(f"{srv.url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in m.splitlines() if line.startswith("rlserve_num_requests_held{"))


def test_request_resolved_before_a_reload_runs_on_the_new_adapter(server, files):
    """A request whose route read adapter a1's id, but which reaches the engine only after a1
    was reloaded in place (or unloaded), runs on a1's current id (or is a 404 model_not_found),
    not a 400 'adapter id N is not loaded on this engine'. Made deterministic with a pause: the
    request is held (its id read) while the reload runs, then resume submits it. Before, both
    answered 400 invalid_request (adv20; a stream got the error in-stream): TRL's async trainers
    reload the policy adapter in place while rollouts run."""
    base, ad = files
    for name in ("a1", "a2"):
        _unload(server, name)
    assert _load(server, "a1", ad["a1"]).status_code == 200
    want = _ids(_complete(server, "a1", return_token_ids=True))

    def held_request(change):
        assert httpx.post(f"{server.url}/pause", params={"mode": "keep"}, timeout=60).status_code == 200
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            try:
                fut = pool.submit(_complete, server, "a1", return_token_ids=True)
                for _ in range(600):  # the request is held: its adapter id is read
                    if _held(server) >= 1:
                        break
                    fut.exception(timeout=0.1) if fut.done() else None
                    time.sleep(0.1)
                assert _held(server) >= 1
                r = change()
                assert r.status_code == 200, r.text
            finally:
                assert httpx.post(f"{server.url}/resume", timeout=60).status_code == 200
            return fut.result(timeout=120)

    r = held_request(lambda: _load(server, "a1", ad["a1"], load_inplace=True))
    assert _ids(r) == want
    r = held_request(lambda: _load(server, "a1", ad["a2"], load_inplace=True))  # a1 now serves a2's file
    assert r.status_code == 200, r.text
    assert _ids(r) != want
    r = held_request(lambda: _unload(server, "a1"))
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
