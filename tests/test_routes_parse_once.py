"""A body with an escaped surrogate pair (an emoji a client's ``json.dumps`` escaped) is parsed once on
every route with a JSON body, not only the generation routes: the lone-surrogate check parses it
(:class:`~rlserve.server.text_check.LoneSurrogateCheck`) and the route takes that value
(:class:`~rlserve.server.request_body.FastJSONRoute`). Before, the routes on FastAPI's own ``APIRoute``
(tokenize, responses, LoRA, admin control) parsed it again; the sleep routes parse no body.

Each body goes to two apps on one engine: the server's (``build_app``) and the same app with those
routers on FastAPI's own ``APIRoute`` (the code before, rebuilt by patching the route class the modules
import). The answers are equal (status and body; a responses answer's id and time aside) and the server's
parses the body once where the other parsed it twice (counted: ``request_body.loads``' msgspec and
``json.loads`` calls, and Starlette's ``Request.json``, FastAPI's own routes' parser)."""

from __future__ import annotations

import json

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from tests.test_request_body import count_parses

EMOJI = "hi \U0001F600"  # json.dumps writes "hi \\ud83d\\ude00": the surrogate check parses the body
#: (route, body, parses by the routers on FastAPI's own APIRoute, status, the error's code or None): the routes
#: with a body, and a sleep route (no body of its own: one parse, the check's, either way)
CASES = [
    ("/tokenize", {"prompt": EMOJI}, 2, 200, None),
    ("/tokenize", {"messages": [{"role": "user", "content": EMOJI}]}, 2, 200, None),
    ("/detokenize", {"tokens": [1, 2, 3], "model": EMOJI}, 2, 404, "model_not_found"),
    ("/v1/responses", {"input": EMOJI, "max_output_tokens": 3, "temperature": 0}, 2, 200, None),
    ("/v1/load_lora_adapter", {"lora_name": EMOJI, "lora_path": "/nonexistent/" + EMOJI}, 2, 404,
     "lora_adapter_not_found"),
    ("/v1/unload_lora_adapter", {"lora_name": EMOJI}, 2, 404, "lora_adapter_not_found"),
    ("/abort_requests", {"request_ids": ["cmpl-" + EMOJI]}, 2, 200, None),
    ("/wake_up", {"note": EMOJI}, 1, 400, "sleep_mode_disabled"),
]
#: the modules whose routers took FastJSONRoute for these routes
MODULES = ["tokenize_routes", "responses_routes", "lora_routes", "control_routes", "sleep_routes"]


@pytest.fixture(scope="module")
def aeng(tiny_model):
    from rlserve.config import EngineConfig
    from rlserve.engine.front.async_engine import AsyncEngine

    engine = AsyncEngine(EngineConfig(model=tiny_model("llama"), device="cpu", dtype="float32", load_format="dummy",
                                      max_model_len=128, enable_lora=True, max_loras=1, max_lora_rank=8, seed=0),
                         engine_mode="thread")
    try:
        yield engine
    finally:
        engine.shutdown()


def _client(aeng, tiny_model, monkeypatch, route_class=None) -> TestClient:
    """The server's app on ``aeng``; with ``route_class``, its routers of :data:`MODULES` built with it."""
    from rlserve.server import app as app_module
    from rlserve.server.state import ServerSettings

    with monkeypatch.context() as m:
        if route_class is not None:
            import importlib

            for name in MODULES:
                m.setattr(importlib.import_module(f"rlserve.server.{name}"), "FastJSONRoute", route_class)
        app = app_module.build_app(aeng, ServerSettings(model=tiny_model("llama"), served_model_names=["tiny"]))
    return TestClient(app, raise_server_exceptions=False)


def _answer(r) -> tuple[int, object]:
    body = r.json()
    if isinstance(body, dict) and body.get("object") == "response":  # its id and creation time are new per call
        body = {k: v for k, v in body.items() if k not in ("id", "created_at")}
        body["output"] = [{k: v for k, v in item.items() if k != "id"} for item in body["output"]]
    return r.status_code, body


def test_a_surrogate_pair_body_is_parsed_once_with_the_same_answer(aeng, tiny_model, monkeypatch):
    from transformers import AutoTokenizer

    headers = {"Content-Type": "application/json"}
    answers = {}
    with _client(aeng, tiny_model, monkeypatch, route_class=APIRoute) as before, \
            _client(aeng, tiny_model, monkeypatch) as now:
        for route, body, parses_before, status, code in CASES:
            data = json.dumps(body).encode()
            assert b"\\ud83d\\ude00" in data
            calls = count_parses(monkeypatch)
            old = before.post(route, content=data, headers=headers)
            assert sum(calls.values()) == parses_before, (route, calls)
            calls = count_parses(monkeypatch)
            new = now.post(route, content=data, headers=headers)
            assert sum(calls.values()) == 1, (route, calls)  # the surrogate check's
            assert _answer(new) == _answer(old), route
            assert new.status_code == status, (route, new.text)
            assert (new.json()["error"]["code"] if code else None) == code, (route, new.text)
            answers.setdefault(route, new.json())
    # the values the routes read from the one parse
    assert answers["/tokenize"]["tokens"] == AutoTokenizer.from_pretrained(tiny_model("llama"))(EMOJI)["input_ids"]
    assert "hi \U0001F600" in answers["/detokenize"]["error"]["message"]
    assert answers["/v1/responses"]["status"] == "incomplete"  # (max_output_tokens 3)
    assert answers["/v1/responses"]["usage"]["output_tokens"] == 3
    assert answers["/v1/load_lora_adapter"]["error"]["message"].endswith("/nonexistent/hi \U0001F600")
    assert answers["/abort_requests"] == {"status": "ok", "aborted": 0}
