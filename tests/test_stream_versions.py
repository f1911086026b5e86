"""Weight versions on streams (session 21's adversarial pass): a streamed answer that spans a weight update must
name every version that produced its tokens, as a non-streamed answer's ``weight_versions`` does. Each chunk's
``weight_version`` names the weights of its last token only, and chunks may hold several steps' tokens
(``stream_interval``, a slow reader), so each choice's last chunk (the one with its ``finish_reason``) carries
``weight_versions``: every version seen while the request ran, in order. Before, no chunk carried it: a stream
whose chunk held tokens of two versions could not be told from one of a single version.

A stream is started, the server keep-paused after its first chunks (the request frozen mid-decode: checked on
``/metrics``, else tried again with a new request), weights synced under a new label, resumed; completions (n=2)
and chat. In-process server, tiny llama, gloo sync."""

from __future__ import annotations

import json

import httpx
import pytest

from rlserve.server.launch import free_port
from rlserve.transfer import GlooTrainerInitInfo, HTTPWeightSyncClient, ModuleSource, WeightTransferTrainerFactory
from tests.transfer_harness import InProcessServer, load_hf

T = 120.0


def _running(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=T).text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.split()[-1])
    raise AssertionError("no vllm:num_requests_running on /metrics")


def _stream_across_a_sync(url: str, trainer, route: str, body: dict, label: str) -> list[dict] | None:
    """The chunks of one stream with a sync labelled ``label`` in its middle; None when the request had
    finished before the keep-pause froze it (the caller tries again)."""
    chunks, synced = [], None
    with httpx.stream("POST", url + route, json={**body, "stream": True}, timeout=T) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunks.append(json.loads(line[6:]))
            if len(chunks) == 3:
                assert httpx.post(url + "/pause", params={"mode": "keep"}, timeout=T).status_code == 200
                synced = _running(url) > 0
                if synced:
                    assert trainer.send_weights(weight_version=label)["weight_version"] == label
                assert httpx.post(url + "/resume", timeout=T).status_code == 200
    return chunks if synced else None


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_streams_last_chunks_name_every_version(tiny_model, route):
    path = tiny_model("llama", max_position_embeddings=4096)
    body = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0, "n": 2}
    body.update({"prompt": [5, 17, 42, 9]} if route == "/v1/completions" else
                {"messages": [{"role": "user", "content": "hi"}]})
    with InProcessServer(path, max_model_len=4096, kv_cache_bytes=64 << 20) as srv:
        trainer = WeightTransferTrainerFactory.trainer_init(
            init_info=GlooTrainerInitInfo(master_port=free_port(), world_size=2, timeout_s=60),
            client=HTTPWeightSyncClient(srv.url, timeout_s=60), source=ModuleSource(load_hf(path, seed=1)))
        try:
            for attempt in range(5):
                label = f"{route.split('/')[-1]}-{attempt}"
                chunks = _stream_across_a_sync(srv.url, trainer, route, body, label)
                if chunks is not None:
                    break
            else:
                pytest.fail("every request finished before the keep-pause")
        finally:
            trainer.shutdown()
    choices = [c for ch in chunks for c in ch.get("choices", [])]
    assert {c["weight_version"] for c in choices} == {"0", label}
    last = {c["index"]: c for c in choices if c["finish_reason"] is not None}
    assert sorted(last) == [0, 1]
    for c in last.values():
        assert c["finish_reason"] == "length" and c["weight_version"] == label
        assert c["weight_versions"] == ["0", label], c
    # the middle chunks keep vLLM's keys plus weight_version only
    assert all("weight_versions" not in c for c in choices if c["finish_reason"] is None)
