"""Pause/resume over HTTP on a real server (2 data-parallel replicas of a tiny random
Llama) under 16 concurrent streamed requests, in each mode: none lost or hung; abort gives
finish_reason "abort"; wait drains; keep freezes and its greedy outputs equal an unpaused
run; requests that arrive while paused are held, then served."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from rlserve.server.testing import ServerProcess

N = 16
T = 240.0  # bound on every scenario and every wait in it (seconds): a hang, not a speed limit
FINISHED = "rlserve_sequences_finished_total"


@pytest.fixture(scope="module")
def server(tiny_model):
    model = tiny_model("llama")
    # 2 sequences per replica at a time: 16 requests run in 4 rounds, so they are still in
    # flight when a pause lands however fast the machine is
    with ServerProcess(model, "--max-model-len", "256", "--data-parallel-size", "2", "--max-num-seqs", "2",
                       "--device", "cpu", "--disable-access-log") as srv:
        yield srv


def _prompt(i: int) -> list[int]:
    return [3 + i, 40 + i, 7, 90 + 2 * i]


async def _stream(client: httpx.AsyncClient, i: int, max_tokens: int, progress: dict) -> tuple[list[int], str]:
    body = {"prompt": _prompt(i), "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    ids: list[int] = []
    finish = None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            for c in obj["choices"]:
                ids += c["token_ids"]
                finish = c["finish_reason"] or finish
            progress[i] = len(ids)
    return ids, finish


async def _until(cond, timeout_s: float = T, what: str = "condition"):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not cond():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def _metric(client, name: str) -> float:
    text = (await client.get("/metrics")).text
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name + "{"))


async def _until_metric(client, name: str, value: float, timeout_s: float = T):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while await _metric(client, name) != value:
        if loop.time() > end:
            raise AssertionError(f"{name} never became {value}")
        await asyncio.sleep(0.05)


async def _until_accepted(client, n: int, finished_before: float | None = None):
    """Wait until the server has accepted ``n`` requests: the live count (engines + held), plus,
    with ``finished_before`` (``rlserve_sequences_finished_total`` before they were sent), those
    that already finished -- short requests can end before the last one is accepted."""
    end = asyncio.get_running_loop().time() + T
    while asyncio.get_running_loop().time() < end:
        done = 0.0 if finished_before is None else await _metric(client, FINISHED) - finished_before
        if await _metric(client, "rlserve_num_requests_unfinished") + done >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the server never had {n} requests in flight")


async def _complete(client, prompt, max_tokens=4):
    r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                    "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


async def _held_then_resumed(client):
    """A request sent while paused waits (not rejected) and completes after /resume."""
    held = asyncio.create_task(_complete(client, [5, 6, 7]))
    await asyncio.sleep(0.5)
    assert not held.done(), "a request sent while paused must be held"
    assert (await client.get("/is_paused")).json()["is_paused"] is True
    assert (await client.post("/resume")).status_code == 200
    choice = await asyncio.wait_for(held, T)
    assert choice["finish_reason"] == "length"


def _run(coro_fn, url):
    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=T) as client:
            return await coro_fn(client)

    return asyncio.run(asyncio.wait_for(main(), T))


async def _finished_by(client, reason: str) -> float:
    text = (await client.get("/metrics")).text
    return sum(float(ln.split()[-1]) for ln in text.splitlines()
               if ln.startswith(f'{FINISHED}{{finish_reason="{reason}"'))


def test_pause_abort(server):
    async def scenario(client):
        progress: dict = {}
        before, length_before = await _metric(client, FINISHED), await _finished_by(client, "length")
        tasks = [asyncio.create_task(_stream(client, i, 240, progress)) for i in range(N)]
        await _until_accepted(client, N, finished_before=before)
        await _until(lambda: len(progress) >= 1, what="a first token")
        r = await client.post("/pause", params={"mode": "abort"})
        assert r.status_code == 200, r.text
        results = await asyncio.wait_for(asyncio.gather(*tasks), T)
        # whatever the machine's speed: those that finished before the pause have all their
        # tokens, every other one was aborted mid-way (and 4 run at a time: most were)
        finished = await _finished_by(client, "length") - length_before
        assert sum(f == "length" for _, f in results) == finished < N
        assert all((f == "length" and len(ids) == 240) or (f == "abort" and len(ids) < 240) for ids, f in results)
        await _held_then_resumed(client)

    _run(scenario, server.url)


def test_pause_wait(server):
    async def scenario(client):
        progress: dict = {}
        before = await _metric(client, FINISHED)
        tasks = [asyncio.create_task(_stream(client, i, 40, progress)) for i in range(N)]
        await _until_accepted(client, N, finished_before=before)
        r = await client.post("/pause", params={"mode": "wait", "clear_cache": "true"})
        assert r.status_code == 200, r.text
        metrics = (await client.get("/metrics")).text  # pause returned: the engines are drained
        assert [ln.split()[-1] for ln in metrics.splitlines() if ln.startswith("rlserve_num_requests_running")] \
            == ["0.0"]
        results = await asyncio.wait_for(asyncio.gather(*tasks), T)
        assert all(f == "length" and len(ids) == 40 for ids, f in results)
        await _held_then_resumed(client)

    _run(scenario, server.url)


def test_pause_keep_equals_unpaused(server):
    async def scenario(client):
        ref = await asyncio.gather(*(_stream(client, i, 200, {}) for i in range(N)))
        assert all(f == "length" for _, f in ref)
        progress: dict = {}
        before = await _metric(client, FINISHED)
        tasks = [asyncio.create_task(_stream(client, i, 200, progress)) for i in range(N)]
        await _until_accepted(client, N, finished_before=before)
        await _until(lambda: len(progress) >= 1, what="a first token")
        r = await client.post("/pause", params={"mode": "keep", "clear_cache": "true"})
        assert r.status_code == 200, r.text
        assert (await client.get("/is_paused")).json() == {"is_paused": True, "mode": "keep"}
        # the engines' own step count (snapshotted as they froze), not what reached the client
        steps = await _metric(client, "rlserve_engine_steps_total")
        assert await _metric(client, "rlserve_num_requests_unfinished") >= 1, "pause(keep) caught none mid-flight"
        await asyncio.sleep(0.5)
        assert await _metric(client, "rlserve_engine_steps_total") == steps, "a step ran while paused (keep)"
        await _held_then_resumed(client)
        results = await asyncio.wait_for(asyncio.gather(*tasks), T)
        assert [ids for ids, _ in results] == [ids for ids, _ in ref]
        assert all(f == "length" for _, f in results)

    _run(scenario, server.url)


def test_failed_pause_is_undone(server):
    """``/pause?mode=wait&timeout=1e-300`` cannot drain in time: 504, and the server is not left
    paused with nobody to resume it (requests sent afterwards are served, not held)."""
    async def scenario(client):
        progress: dict = {}
        task = asyncio.create_task(_stream(client, 0, 240, progress))
        await _until(lambda: progress.get(0), what="a first token")
        r = await client.post("/pause", params={"mode": "wait", "timeout": "1e-300"})
        assert r.status_code == 504 and "undone" in r.json()["error"]["message"], r.text
        assert (await client.get("/is_paused")).json() == {"is_paused": False, "mode": None}
        assert (await _complete(client, [1, 2, 3]))["finish_reason"] == "length"
        ids, finish = await asyncio.wait_for(task, T)
        assert finish == "length" and len(ids) == 240

    _run(scenario, server.url)


def test_abort_requests_route_and_metrics(server):
    async def scenario(client):
        progress: dict = {}
        before = await _metric(client, FINISHED)
        tasks = [asyncio.create_task(_stream(client, i, 240, progress)) for i in range(8)]
        await _until_accepted(client, 8, finished_before=before)
        r = await client.post("/abort_requests")
        assert r.status_code == 200, r.text
        results = await asyncio.wait_for(asyncio.gather(*tasks), T)
        # those that finished first (a slow client) are not counted; every other one was aborted
        assert sum(f == "abort" for _, f in results) == r.json()["aborted"] >= 1
        assert all(f == "abort" or (f == "length" and len(ids) == 240) for ids, f in results)
        assert (await client.get("/is_paused")).json()["is_paused"] is False
        metrics = (await client.get("/metrics")).text
        assert 'rlserve_sequences_finished_total{finish_reason="abort",model_name=' in metrics
        assert (await _complete(client, [1, 2, 3]))["finish_reason"] == "length"

    _run(scenario, server.url)


def test_client_disconnect_aborts(server):
    """A client that goes away (non-streaming or streaming) has its request aborted."""

    def aborted(text: str) -> float:
        return sum(float(ln.split()[-1]) for ln in text.splitlines()
                   if ln.startswith('rlserve_sequences_finished_total{finish_reason="abort"'))

    async def scenario(client):
        before = aborted((await client.get("/metrics")).text)
        body = {"prompt": [5, 6, 7], "max_tokens": 250, "ignore_eos": True}
        # non-streaming: held by a pause (so it cannot finish first), then the client leaves
        assert (await client.post("/pause", params={"mode": "keep"})).status_code == 200
        with pytest.raises(httpx.TimeoutException):
            await client.post("/v1/completions", json=body, timeout=0.5)
        # the server polls for disconnects every second: wait until it dropped the held request
        await _until_metric(client, "rlserve_num_requests_held", 0)
        assert (await client.post("/resume")).status_code == 200
        async with client.stream("POST", "/v1/completions", json=dict(body, stream=True)) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break  # leave after the first chunk: the connection is closed
        end = asyncio.get_running_loop().time() + T
        while aborted((await client.get("/metrics")).text) - before < 2 and asyncio.get_running_loop().time() < end:
            await asyncio.sleep(0.1)
        assert aborted((await client.get("/metrics")).text) - before == 2
        assert (await _complete(client, [1, 2, 3]))["finish_reason"] == "length"

    _run(scenario, server.url)


def test_abort_requests_by_response_id(server):
    async def scenario(client):
        body = {"prompt": [9, 8, 7], "max_tokens": 240, "temperature": 0, "stream": True, "ignore_eos": True}
        other = asyncio.create_task(_stream(client, 3, 30, {}))
        finish = None
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                obj = json.loads(line[6:])
                if finish is None and obj["choices"] and obj["choices"][0]["finish_reason"] is None:
                    finish = "pending"
                    resp = await client.post("/abort_requests", json={"request_ids": [obj["id"]]})
                    assert resp.status_code == 200 and resp.json()["aborted"] == 1, resp.text
                for c in obj["choices"]:
                    finish = c["finish_reason"] or finish
        assert finish == "abort"
        ids, f = await asyncio.wait_for(other, T)  # the other request is untouched
        assert f == "length" and len(ids) == 30

    _run(scenario, server.url)
