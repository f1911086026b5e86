"""Sleep mode over HTTP (issue 19), on a real ``rlserve serve --enable-sleep-mode`` (CPU, tiny
Llama, engine-core process): vLLM's routes (``POST /sleep?level=``, ``POST /wake_up?tags=``,
``GET /is_sleeping``), 503 ``model_sleeping`` for generation while asleep (not held), ``/health``
200, the state in ``/server_info`` and ``/metrics``, 409 for out-of-order calls with nothing
changed, and with weight sync (gloo): a sync into a level-1 sleep is refused, level 2 + sync +
wake gives the trainer's greedy output."""

from __future__ import annotations

import httpx
import pytest

from rlserve.server.testing import ServerProcess
from tests.transfer_harness import load_hf

T = 120.0
PROMPTS = [[5, 17, 42, 9, 77, 3], [100, 101, 7, 8]]
N_TOK = 6
ARGS = ("--device", "cpu", "--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "4",
        "--kv-cache-bytes", str(4 << 20), "--disable-access-log")


@pytest.fixture(scope="module")
def server(tiny_model):
    with ServerProcess(tiny_model("llama"), *ARGS, "--enable-sleep-mode", "--load-format", "dummy",
                       "--weight-transfer-config", '{"backend": "gloo"}') as srv:
        yield srv


def _generate(url: str) -> httpx.Response:
    return httpx.post(url + "/generate/", json={"prompt_ids": PROMPTS, "max_tokens": N_TOK, "temperature": 0,
                                                "generation_kwargs": {"ignore_eos": True}}, timeout=T)


def _completion(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": N_TOK, "temperature": 0},
                      timeout=T)


def _post(url: str, path: str, **params) -> httpx.Response:
    return httpx.post(url + path, params=params, timeout=T)


def _error(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code, err
    return err["message"]


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=T).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def _sleeping(url: str) -> bool:
    return httpx.get(url + "/is_sleeping", timeout=T).json()["is_sleeping"]


def test_routes_states_and_conflicts(server):
    url = server.url
    before = _generate(url).json()["completion_ids"]
    assert _sleeping(url) is False
    info = httpx.get(url + "/server_info", timeout=T).json()
    assert info["enable_sleep_mode"] is True and info["is_sleeping"] is False
    assert info["vllm_config"]["model_config"]["enable_sleep_mode"] is True
    assert info["sleep"]["tags"] == {"weights": "awake", "kv_cache": "awake"}
    assert info["sleep"]["bytes"]["weights"] > 0 and info["sleep"]["bytes"]["kv_cache"] > 0

    _error(_post(url, "/wake_up"), 409, "not_sleeping")
    _error(_post(url, "/sleep", level=3), 400, "invalid_request")
    _error(_post(url, "/sleep", mode="keep"), 400, "invalid_request")
    assert _sleeping(url) is False

    r = _post(url, "/sleep", level=1)
    assert r.status_code == 200, r.text
    assert r.json()["tags"] == {"weights": "offloaded", "kv_cache": "discarded"}
    assert _sleeping(url) is True
    assert "wake_up" in _error(_generate(url), 503, "model_sleeping")
    _error(_completion(url), 503, "model_sleeping")
    assert httpx.get(url + "/health", timeout=T).status_code == 200
    info = httpx.get(url + "/server_info", timeout=T).json()
    assert info["is_sleeping"] is True and info["sleep"]["level"] == 1
    asleep = info["sleep"]["bytes"]["weights"] + info["sleep"]["bytes"]["kv_cache"]
    assert info["sleep"]["bytes_discarded"] == asleep > 0
    assert info["sleep"]["bytes_released"] == 0  # CPU: in place, the memory stays allocated
    assert _metric(url, "rlserve_is_sleeping") == 1 and _metric(url, "rlserve_sleep_level") == 1
    assert _metric(url, "rlserve_sleep_bytes_discarded") == asleep
    assert _metric(url, "rlserve_sleep_bytes_released") == 0

    _error(_post(url, "/sleep", level=2), 409, "already_sleeping")
    _error(_post(url, "/wake_up", tags="bogus"), 400, "invalid_request")
    r = _post(url, "/wake_up", tags="kv_cache")
    assert r.status_code == 200 and r.json()["tags"] == {"weights": "offloaded", "kv_cache": "awake"}
    assert _sleeping(url) is True
    _error(_generate(url), 503, "model_sleeping")
    _error(_post(url, "/wake_up", tags="kv_cache"), 409, "not_sleeping")
    r = _post(url, "/wake_up", tags="weights")
    assert r.status_code == 200 and r.json()["is_sleeping"] is False
    assert _sleeping(url) is False and httpx.get(url + "/is_paused", timeout=T).json()["is_paused"] is False
    assert _generate(url).json()["completion_ids"] == before
    assert _metric(url, "rlserve_is_sleeping") == 0 and _metric(url, "rlserve_sleep_bytes_discarded") == 0
    assert _metric(url, "rlserve_sleep_bytes_released") == 0


def test_level2_plain_wake_reloads(server):
    url = server.url
    before = _generate(url).json()["completion_ids"]
    assert _post(url, "/sleep", level=2).status_code == 200
    r = _post(url, "/wake_up")
    assert r.status_code == 200 and r.json()["reloads"] >= 1
    assert _generate(url).json()["completion_ids"] == before


def test_sleep_mode_off_answers_400(tiny_model):
    with ServerProcess(tiny_model("llama"), *ARGS) as srv:
        _error(_post(srv.url, "/sleep"), 400, "sleep_mode_disabled")
        _error(_post(srv.url, "/wake_up"), 400, "sleep_mode_disabled")
        assert _sleeping(srv.url) is False
        assert httpx.get(srv.url + "/server_info", timeout=T).json()["sleep"] is None


# ----------------------------------------------------------------------------- with weight sync

@pytest.fixture(scope="module")
def trainer(server, tiny_model):
    from rlserve.transfer import GlooTrainerInitInfo, HTTPWeightSyncClient, ModuleSource, WeightTransferTrainerFactory
    from tests.transfer_harness import greedy_continuation

    hf = load_hf(tiny_model("llama"))
    eng = WeightTransferTrainerFactory.trainer_init(
        init_info=GlooTrainerInitInfo(world_size=2, timeout_s=30,
                                      packed_buffer_size_bytes=64 << 10),
        client=HTTPWeightSyncClient(server.url, timeout_s=60), source=ModuleSource(hf))
    eng.expected = [greedy_continuation(hf, p, N_TOK) for p in PROMPTS]
    yield eng
    eng.shutdown()


def test_sync_into_level1_sleep_is_refused(server, trainer):
    from rlserve.transfer import WeightSyncHTTPError

    url = server.url
    before = _generate(url).json()["completion_ids"]
    assert before != trainer.expected
    assert _post(url, "/sleep", level=1).status_code == 200
    try:
        with pytest.raises(WeightSyncHTTPError) as ei:
            trainer.send_weights()
        assert ei.value.status_code == 409 and "level 1" in str(ei.value)
        info = httpx.get(url + "/server_info", timeout=T).json()
        assert info["sleep"]["tags"] == {"weights": "offloaded", "kv_cache": "discarded"}
        assert info["unavailable_reason"] is None
    finally:
        assert _post(url, "/wake_up").status_code == 200
    assert _generate(url).json()["completion_ids"] == before  # nothing changed


def test_level2_sync_then_wake_gives_the_trainers_greedy(server, trainer):
    """No wake_up(tags=weights) first: the sync maps the weights' memory itself. Through the
    SDK client's sleep-mode calls."""
    from rlserve.transfer import WeightSyncConflictError

    url, client = server.url, trainer.client
    reloads = client.sleep(level=2)["reloads"]
    assert client.is_sleeping()
    with pytest.raises(WeightSyncConflictError) as ei:
        client.sleep(level=1)
    assert ei.value.code == "already_sleeping"
    fin = trainer.send_weights()
    assert fin["full"]
    info = httpx.get(url + "/server_info", timeout=T).json()
    assert info["sleep"]["tags"] == {"weights": "awake", "kv_cache": "discarded"} and info["is_sleeping"]
    _error(_generate(url), 503, "model_sleeping")
    with pytest.raises(WeightSyncConflictError) as ei:
        client.wake_up(tags=["weights"])
    assert ei.value.code == "not_sleeping"
    r = client.wake_up(tags=["kv_cache"])
    assert r["is_sleeping"] is False and not client.is_sleeping()
    assert r["reloads"] == reloads  # the sync refilled the weights: no reload
    assert _generate(url).json()["completion_ids"] == trainer.expected


def test_sleep_during_an_open_update_is_refused(server, trainer):
    url = server.url
    trainer.client.start_weight_update()
    try:
        msg = _error(_post(url, "/sleep", level=1), 409, "weight_update_in_progress")
        assert "update" in msg
        assert _sleeping(url) is False
    finally:
        trainer.client.finish_weight_update()
    assert _generate(url).json()["completion_ids"] == trainer.expected
