"""--api-key on generation routes (401), control routes refused (403) on a non-loopback
bind without --admin-key, --admin-key enforced (401) when given, and vLLM's dev mode
(``--insecure-control-routes`` / ``VLLM_SERVER_DEV_MODE=1``) serving them without a key."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from rlserve.server.testing import ServerProcess

KEY = "sk-test-key"
T = 60.0


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def server(model_dir):
    # 0.0.0.0 is not loopback: without --admin-key the control routes must answer 403
    with ServerProcess(model_dir, "--host", "0.0.0.0", "--api-key", KEY, "--served-model-name", "tiny",
                       "--device", "cpu", "--disable-access-log", env={"VLLM_SERVER_DEV_MODE": "0"}) as srv:
        yield srv


def _err(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_api_key_enforced(server):
    url = server.url
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    assert _err(httpx.post(url + "/v1/completions", json=body, timeout=T), 401)["code"] == "invalid_api_key"
    _err(httpx.get(url + "/v1/models", timeout=T), 401)
    _err(httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=T), 401)
    _err(httpx.post(url + "/generate/", json={"prompts": ["hi"]}, timeout=T), 401)
    ok = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=T)
    assert ok.status_code == 200, ok.text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0, timeout=T).models.list()
    good = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=T)
    assert good.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    # open routes stay open
    for path in ("/health", "/health/", "/get_world_size", "/server_info", "/metrics", "/is_paused"):
        assert httpx.get(url + path, timeout=T).status_code == 200, path


def test_control_routes_refused_without_admin_key_on_public_bind(server):
    for path in ("/pause", "/resume", "/reset_prefix_cache", "/reset_prefix_cache/", "/abort_requests"):
        err = _err(httpx.post(server.url + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=T), 403)
        assert "--admin-key" in err["message"], err
    assert httpx.get(server.url + "/is_paused", timeout=T).json()["is_paused"] is False
    assert httpx.get(server.url + "/health", timeout=T).status_code == 200


def test_admin_key_enforced(model_dir):
    """In-process app (real engine) bound 'publicly' with an admin key."""
    from rlserve.config import EngineConfig
    from rlserve.engine.front.async_engine import AsyncEngine
    from rlserve.server.app import build_app
    from rlserve.server.state import ServerSettings

    aeng = AsyncEngine(EngineConfig(model=model_dir, device="cpu"))
    app = build_app(aeng, ServerSettings(model=model_dir, served_model_names=["tiny"], host="0.0.0.0",
                                         admin_key="adm"))

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=T) as c:
            _err(await c.post("/pause"), 401)
            _err(await c.post("/pause", headers={"Authorization": "Bearer wrong"}), 401)
            admin = {"Authorization": "Bearer adm"}
            r = await c.post("/pause", params={"mode": "keep"}, headers=admin)
            assert r.status_code == 200 and r.json()["mode"] == "keep"
            assert (await c.get("/is_paused")).json()["is_paused"] is True
            assert (await c.post("/resume", headers=admin)).status_code == 200
            assert (await c.post("/reset_prefix_cache", headers=admin)).status_code == 200
            # no --api-key: /v1 is open
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200, r.text

    try:
        asyncio.run(asyncio.wait_for(main(), T))
    finally:
        aeng.shutdown()


def test_insecure_control_routes_serve_without_a_key(model_dir, monkeypatch):
    """vLLM's dev mode (what ``trl vllm-serve`` sets): on a public bind without --admin-key the
    control routes answer without a key; with --admin-key the key still applies. The flag
    defaults to on exactly when ``VLLM_SERVER_DEV_MODE=1``."""
    import argparse

    from rlserve.cli import serve as serve_cli
    from rlserve.config import EngineConfig
    from rlserve.engine.front.async_engine import AsyncEngine
    from rlserve.server.app import build_app
    from rlserve.server.state import ServerSettings

    def parsed(*argv):
        p = argparse.ArgumentParser()
        serve_cli.register(p.add_subparsers())
        return p.parse_args(["serve", model_dir, *argv])

    for env, flag, want in [("1", (), True), ("0", (), False), (None, (), False), (None, ("--insecure-control-routes",), True)]:
        if env is None:
            monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
        else:
            monkeypatch.setenv("VLLM_SERVER_DEV_MODE", env)
        assert parsed(*flag).insecure_control_routes is want, (env, flag)

    aeng = AsyncEngine(EngineConfig(model=model_dir, device="cpu"))
    open_app = build_app(aeng, ServerSettings(model=model_dir, served_model_names=["tiny"], host="0.0.0.0",
                                              insecure_control_routes=True))
    keyed_app = build_app(aeng, ServerSettings(model=model_dir, served_model_names=["tiny"], host="0.0.0.0",
                                               admin_key="adm", insecure_control_routes=True))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=open_app), base_url="http://test",
                                     timeout=T) as c:
            r = await c.post("/pause", params={"mode": "keep"})
            assert r.status_code == 200 and r.json()["mode"] == "keep", r.text
            assert (await c.post("/resume")).status_code == 200
            assert (await c.post("/reset_prefix_cache/")).status_code == 200
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=keyed_app), base_url="http://test",
                                     timeout=T) as c:
            assert _err(await c.post("/pause"), 401)["code"] == "invalid_admin_key"

    try:
        asyncio.run(asyncio.wait_for(main(), T))
    finally:
        aeng.shutdown()
