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


def _synced_stream(path: str, route: str, body: dict, good, why: str) -> tuple[list[dict], str, str]:
    """``(chunks, before, label)`` of the first of at most 5 streams with a sync in their middle (a server of the
    tiny ``path``, a trainer of other weights) for which ``good(chunks)`` holds; fails with ``why`` after 5.
    ``before`` is the version the stream started on: "0" unless an earlier try synced (the same server serves every
    try, so a try whose sync did not give ``good`` chunks leaves its label as the next try's starting version)."""
    with InProcessServer(path, max_model_len=4096, kv_cache_bytes=64 << 20) as srv:
        trainer = WeightTransferTrainerFactory.trainer_init(
            init_info=GlooTrainerInitInfo(world_size=2, timeout_s=60),
            client=HTTPWeightSyncClient(srv.url, timeout_s=60), source=ModuleSource(load_hf(path, seed=1)))
        try:
            before = "0"
            for attempt in range(5):
                label = f"{route.split('/')[-1]}-{attempt}"
                chunks = _stream_across_a_sync(srv.url, trainer, route, body, label)
                if chunks is not None and good(chunks):
                    return chunks, before, label
                if chunks is not None:  # synced, but not the chunks wanted: the server now serves ``label``
                    before = label
            pytest.fail(why)
        finally:
            trainer.shutdown()


def _spanning(chunks: list[dict]) -> list[dict]:
    """The middle chunks' choices that carry ``weight_versions``."""
    return [c for ch in chunks for c in ch.get("choices", []) if c["finish_reason"] is None and "weight_versions" in c]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_streams_last_chunks_name_every_version(tiny_model, route):
    path = tiny_model("llama", max_position_embeddings=4096)
    body = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0, "n": 2}
    body.update({"prompt": [5, 17, 42, 9]} if route == "/v1/completions" else
                {"messages": [{"role": "user", "content": "hi"}]})
    chunks, before, label = _synced_stream(path, route, body, lambda chunks: True,
                                           "every request finished before the pause")
    assert before == "0"  # every chunk list is good here: the first synced try is returned
    choices = [c for ch in chunks for c in ch.get("choices", [])]
    assert {c["weight_version"] for c in choices} == {"0", label}
    last = {c["index"]: c for c in choices if c["finish_reason"] is not None}
    assert sorted(last) == [0, 1]
    for c in last.values():
        assert c["finish_reason"] == "length" and c["weight_version"] == label
        assert c["weight_versions"] == ["0", label], c
    # a middle chunk carries weight_versions only when its tokens span the sync (session 22, FIX item 4)
    for c in _spanning(chunks):
        assert c["weight_versions"] == ["0", label] and c["weight_version"] == label, c


def test_a_middle_chunk_across_a_sync_names_both_versions(tiny_model):
    """With ``stream_interval`` 64 a chunk holds 64 tokens, so the one the sync falls in holds tokens of both
    versions (unless the pause fell exactly on a chunk's edge: tried again, at most 5 times): it lists both in
    ``weight_versions``, in order, its ``weight_version`` the new one; the chunks before and after name one
    version and carry no list. Before session 22 such a chunk was labelled with the new version only."""
    path = tiny_model("llama", max_position_embeddings=4096)
    body = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0, "n": 2, "stream_interval": 64,
            "prompt": [5, 17, 42, 9]}
    chunks, before, label = _synced_stream(path, "/v1/completions", body, _spanning,
                                           "no chunk held tokens of both versions in 5 tries")
    spans = _spanning(chunks)
    assert sorted(c["index"] for c in spans) == [0, 1]  # one chunk per choice, the samples advance together
    for c in spans:
        assert c["weight_versions"] == [before, label] and c["weight_version"] == label, c
    for idx in (0, 1):
        mine = [c for ch in chunks for c in ch["choices"] if c["index"] == idx]
        at = next(k for k, c in enumerate(mine) if "weight_versions" in c)
        assert {c["weight_version"] for c in mine[:at]} == {before} and all("weight_versions" not in c for c in mine[:at])
        assert {c["weight_version"] for c in mine[at:]} == {label}
