"""``rlserve serve --api-server-count 2`` (rlserve/server/multi_api.py) on a tiny random llama, CPU:

* both API processes serve (each connection is pinned to one process, told by its ``/metrics``'s
  ``rlserve_api_server_info``), streamed and not, through the real ``openai`` client, 16 requests at
  once: every answer's greedy ids are Hugging Face float32's; a scrape of either process counts all 16
  (``/metrics`` is the processes' aggregate: requests, tokens, histogram counts);
* a keep-pause asked of process 1 (forwarded to process 0) holds a request that then arrives at
  process 1 (process 1's own ``rlserve_num_requests_held``: the state reached it), a gloo weight
  update runs meanwhile through the HTTP control routes, and after ``/resume`` (again through process 1)
  the held request runs on the new weights only (``weight_versions == ["v1"]``, the trainer's greedy
  ids); streams frozen by the pause name both versions; one of process 1's frozen streams aborted by its
  id through process 0 ends with ``abort``, the answer's ``aborted`` 1 (when the freeze caught all four streams
  in the core: the core's ``vllm:num_requests_running`` at the freeze); new requests on both processes say ``v1``;
* the control routes asked of process 1 are logged once, with the client's address (process 0 logged
  each again with an empty one before session 24);
* SIGTERM stops everything (the API processes and the engine core: no process left);
* with ``--data-parallel-size 2`` (two cores, each process a replica of each): greedy answers on both
  processes, a keep-pause asked of process 1 holds its new request (``/abort_requests`` asked of process 0
  ends it and counts it once: ``aborted`` 1) and its next one until a resume asked of process 0, a
  sleep asked of process 1 answers 503 ``model_sleeping`` on both until its wake (``/metrics`` of process 1
  still answers: a 500 before session 23's fix, its sleep gauges read the cores; either process's scrape
  reads the sleep state, then the wake, that process 0 wrote); then a killed API process 1
  stops the server with exit status 1 (no hang, no process left).

Every wait is bounded by ``T`` (a hang, not a speed limit)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time

import httpx
import pytest

from rlserve.proc_state import child_processes, pid_alive
from rlserve.server.testing import ServerProcess
from rlserve.transfer import GlooTrainerInitInfo, HTTPWeightSyncClient, ModuleSource, WeightTransferTrainerFactory
from tests.transfer_harness import greedy_continuation, load_hf

openai = pytest.importorskip("openai")

T = 180.0
PER_PROCESS = 4  # pinned connections per API process


def _children(pid: int) -> list[int]:
    """Live child pids of ``pid``."""
    return [p for p, _ in child_processes(pid)]


def _metrics(client: httpx.Client) -> dict[str, float]:
    out = {}
    for line in client.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _index(client: httpx.Client) -> int:
    for name in _metrics(client):
        if name.startswith("rlserve_api_server_info{"):
            return int(name.split('index="')[1].split('"')[0])
    raise AssertionError("no rlserve_api_server_info on /metrics")


def _pinned(url: str, clients=()) -> dict[int, list[httpx.Client]]:
    """``PER_PROCESS`` keep-alive clients of one connection each per API process (new connections until
    both processes have that many: the kernel hands each new connection to one of them). ``clients``: such
    clients from before, asked again (a connection idle for uvicorn's 30 s keep-alive was closed, and its
    client's next one may have reached the other process)."""
    by: dict[int, list[httpx.Client]] = {0: [], 1: []}
    for c in clients:
        by[_index(c)].append(c)
    end = time.monotonic() + T
    while min(len(v) for v in by.values()) < PER_PROCESS:
        assert time.monotonic() < end, {k: len(v) for k, v in by.items()}
        c = httpx.Client(base_url=url, timeout=T, limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))
        i = _index(c)
        if len(by[i]) < PER_PROCESS:
            by[i].append(c)
        else:
            c.close()
    return by


def _sum(m: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in m.items() if k.startswith(prefix))


def _complete(client: httpx.Client, model: str, prompt: list[int], n: int, stream: bool, seen=None,
              key=None) -> tuple[list[int], dict]:
    """Greedy ids and the last choice's extra fields (weight_version(s), finish_reason) through the openai
    client; a stream's response id goes to ``seen[key]`` with its first chunk."""
    oc = openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key="x", http_client=client, max_retries=0)
    kw = dict(model=model, prompt=prompt, max_tokens=n, temperature=0,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    if not stream:
        r = oc.completions.create(**kw)
        c = r.choices[0]
        return c.model_extra["token_ids"], {**r.model_extra, **c.model_extra, "finish_reason": c.finish_reason}
    ids, last = [], {}
    for chunk in oc.completions.create(stream=True, **kw):
        if seen is not None:
            seen.setdefault(key, chunk.id)
        for c in chunk.choices:
            ids += c.model_extra.get("token_ids") or []
            if c.finish_reason is not None:
                last = {**(chunk.model_extra or {}), **c.model_extra, "finish_reason": c.finish_reason}
    return ids, last


def _until(cond, what: str) -> None:
    end = time.monotonic() + T
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_two_api_servers_share_the_engine_and_the_control_state(tiny_model):
    path = tiny_model("llama", max_position_embeddings=4096)
    srv = ServerProcess(path, "--api-server-count", "2", "--max-model-len", "4096", "--device", "cpu",
                        "--weight-transfer-config", '{"backend": "gloo"}').start()  # (access log on: checked below)
    trainer = None
    try:
        hf0, hf1 = load_hf(path, scale=0.0), load_hf(path, seed=1)
        prompts = [[3 + i, 40 + i, 7, 90 + 2 * i] for i in range(16)]
        want = [greedy_continuation(hf0, p, 12) for p in prompts]
        by = _pinned(srv.url)
        sums = ("rlserve_requests_total{", "vllm:generation_tokens_total{", "vllm:e2e_request_latency_seconds_count{",
                "vllm:inter_token_latency_seconds_count{")
        before = {i: [_sum(_metrics(cs[1]), k) for k in sums] for i, cs in by.items()}
        assert before[0] == before[1], before  # every process answers the aggregate (metrics_mp)
        jobs = [(by[k % 2][(k // 2) % PER_PROCESS], prompts[k], k % 4 < 2) for k in range(16)]
        with cf.ThreadPoolExecutor(2 * PER_PROCESS) as pool:
            got = list(pool.map(lambda j: _complete(j[0], path, j[1], 12, j[2]), jobs))
        for k, (ids, extra) in enumerate(got):
            assert ids == want[k], (k, ids, want[k])
            assert extra.get("weight_version") == "0", extra
        # (a request is counted once its answer is sent: wait for all 16.) Clients 1 and 3 of each process sent 2
        # non-streamed requests each over their one connection (so both processes served requests); a scrape of
        # either process counts all 16 (was its own only before session 24): 16 requests of 12 tokens, 11 gaps each
        added = [16, 16 * 12, 16, 16 * 11]
        for i, cs in by.items():
            _until(lambda: _sum(_metrics(cs[1]), sums[0]) == before[i][0] + 16, f"16 requests counted by process {i}")
            assert [_sum(_metrics(cs[1]), k) - b for k, b in zip(sums, before[i])] == added, i

        # streams in flight on both processes, then a keep-pause asked of process 1
        by = _pinned(srv.url, [c for cs in by.values() for c in cs])
        long_jobs = [by[i][1 + j] for i in (0, 1) for j in range(2)]
        pool = cf.ThreadPoolExecutor(len(long_jobs) + 1)
        seen: dict[int, str] = {}
        streams = [pool.submit(_complete, c, path, prompts[k], 1500, True, seen, k) for k, c in enumerate(long_jobs)]
        _until(lambda: len(seen) == len(long_jobs), "every stream's first chunk")
        r = by[1][0].post("/pause", params={"mode": "keep"})
        assert r.status_code == 200, r.text
        assert by[0][0].get("/is_paused").json()["is_paused"] is True  # process 0 owns the pause
        running = _sum(_metrics(by[0][0]), "vllm:num_requests_running")  # (the core's count at the freeze)
        spanning = running > 0
        if running == len(long_jobs):  # all frozen in the core: stream 2 (process 1's) cannot end before its abort,
            # which goes to process 0 and reaches process 1 through the core (counted by process 1's ack; was 0
            # before session 23's fix: process 0 counted only its own)
            r = by[0][0].post("/abort_requests", json={"request_ids": [seen[2]]})
            assert r.status_code == 200 and r.json() == {"status": "ok", "aborted": 1}, r.text
            ids, extra = streams[2].result(T)
            assert extra["finish_reason"] == "abort" and 0 < len(ids) < 1500 and extra["weight_versions"] == ["0"]
        held = pool.submit(_complete, by[1][0], path, prompts[0], 12, False)
        _until(lambda: _sum(_metrics(by[1][3]), "rlserve_num_requests_held{") == 1, "process 1 holding the request")
        # process 0's scrape sums process 1's held count too (its own write, within metrics_mp.LIVE_PUBLISH_S)
        _until(lambda: _sum(_metrics(by[0][3]), "rlserve_num_requests_held{") == 1, "process 0 reading it")
        trainer = WeightTransferTrainerFactory.trainer_init(
            init_info=GlooTrainerInitInfo(world_size=2, timeout_s=60),
            client=HTTPWeightSyncClient(srv.url, timeout_s=60), source=ModuleSource(load_hf(path, seed=1)))
        assert trainer.send_weights(weight_version="v1")["weight_version"] == "v1"
        r = by[1][3].post("/resume")
        assert r.status_code == 200, r.text
        ids, extra = held.result(T)
        assert ids == greedy_continuation(hf1, prompts[0], 12)
        assert extra["weight_version"] == "v1" and extra["weight_versions"] == ["v1"], extra
        spans = []
        for s in streams[:2] + streams[3:] if running == len(long_jobs) else streams:
            ids, extra = s.result(T)
            assert len(ids) == 1500 and extra["weight_versions"] in (["0"], ["0", "v1"]), extra
            assert extra["weight_version"] == extra["weight_versions"][-1], extra
            spans.append(extra["weight_versions"] == ["0", "v1"])
        assert any(spans) == spanning, spans  # (running at the pause: frozen across the update)
        pool.shutdown()
        for i in (0, 1):
            ids, extra = _complete(by[i][0], path, prompts[5], 12, i == 1)
            assert ids == greedy_continuation(hf1, prompts[5], 12) and extra["weight_version"] == "v1", (i, extra)
            assert _metrics(by[i][3])['rlserve_weight_version_info{model_name="%s",version="v1"}' % path] == 1.0

        # the control routes asked of process 1 (forwarded to process 0) are logged once, with the client's
        # address (process 0 logged them too, with an empty one: multi_api.ControlSocketAccessFilter)
        log = srv.log_tail(100_000_000).splitlines()
        for route in ('"POST /pause?mode=keep HTTP/1.1" 200', '"POST /resume HTTP/1.1" 200'):
            lines = [ln for ln in log if route in ln]
            assert len(lines) == 1 and " 127.0.0.1:" in lines[0], (route, lines)
        assert not [ln for ln in log if ' - "' in ln and "INFO:      - " in ln], "an access line without an address"

        # SIGTERM: every process ends
        pids = [srv.proc.pid] + _children(srv.proc.pid)
        assert len(pids) == 3, pids  # process 0, process 1, the engine core
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(T)
        _until(lambda: not any(pid_alive(p) for p in pids), "every server process gone")
    finally:
        if trainer is not None:
            trainer.shutdown()
        srv.stop()


def test_two_data_parallel_replicas_then_a_killed_api_server_stops_the_server(tiny_model):
    """``--data-parallel-size 2``: each API process has a replica of each core; greedy answers on both
    processes (their tokens counted once in ``vllm:generation_tokens_total``), a keep-pause asked of process 1 freezes both cores and holds process 1's new request until a
    resume asked of process 0; a sleep asked of process 1 refuses on both until its wake. Then process 1 is
    killed: the server exits 1, no process left."""
    path = tiny_model("llama")
    srv = ServerProcess(path, "--api-server-count", "2", "--data-parallel-size", "2", "--max-model-len", "256",
                        "--device", "cpu", "--disable-access-log", "--enable-sleep-mode").start()
    try:
        hf0 = load_hf(path, scale=0.0)
        prompts = [[5 + i, 60 + i, 9, 33 + 3 * i] for i in range(8)]
        by = _pinned(srv.url)
        tokens = ("vllm:generation_tokens_total{", "vllm:prompt_tokens_total{")
        before = [_sum(_metrics(by[0][1]), k) for k in tokens]
        jobs = [(by[k % 2][(k // 2) % PER_PROCESS], prompts[k]) for k in range(8)]
        with cf.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda j: _complete(j[0], path, j[1], 10, False), jobs))
            assert [ids for ids, _ in got] == [greedy_continuation(hf0, p, 10) for p in prompts]
            # two cores, two processes: each request's tokens counted once (by the process that owns it, as its core's
            # steps reach it, before its answer), read the same by either process
            for i in (0, 1):
                assert [_sum(_metrics(by[i][1]), k) - b for k, b in zip(tokens, before)] == [8 * 10, 8 * 4], i
            assert by[1][0].post("/pause", params={"mode": "keep"}).status_code == 200
            held = pool.submit(_complete, by[1][0], path, prompts[0], 10, False)
            _until(lambda: _sum(_metrics(by[1][1]), "rlserve_num_requests_held{") == 1, "process 1 holding it")
            # an abort of everything asked of process 0 counts process 1's held request once (two cores relay it;
            # was 0 before session 23's fix), which ends with "abort"
            r = by[0][0].post("/abort_requests")
            assert r.status_code == 200 and r.json() == {"status": "ok", "aborted": 1}, r.text
            assert held.result(T)[1]["finish_reason"] == "abort"
            held = pool.submit(_complete, by[1][0], path, prompts[0], 10, False)
            _until(lambda: _sum(_metrics(by[1][1]), "rlserve_num_requests_held{") == 1, "process 1 holding it")
            assert by[0][0].post("/resume").status_code == 200
            assert held.result(T)[0] == got[0][0]
        # a sleep asked of process 1: both processes answer 503 model_sleeping (streams too, before a 200), stay
        # healthy, and serve again after a wake asked of process 1
        assert by[1][0].post("/sleep", params={"level": 1}).json()["is_sleeping"] is True
        body = {"model": path, "prompt": prompts[1], "max_tokens": 10, "temperature": 0}
        for i in (0, 1):
            for stream in (False, True):
                r = by[i][0].post("/v1/completions", json={**body, "stream": stream})
                assert r.status_code == 503 and r.json()["error"]["code"] == "model_sleeping", (i, r.text)
            assert by[i][0].get("/health").status_code == 200 and by[i][0].get("/metrics").status_code == 200
            # either process's scrape reads the sleep state process 0 wrote at the sleep (metrics_mp)
            m = _metrics(by[i][1])
            assert _sum(m, "rlserve_is_sleeping{") == 1 and _sum(m, "rlserve_sleep_level{") == 1, i
            assert _sum(m, 'vllm:engine_sleep_state{engine="0",model_name="%s",sleep_state="awake"}' % path) == 0, i
        assert by[1][0].post("/wake_up").status_code == 200
        for i in (0, 1):  # ... and the wake
            m = _metrics(by[i][1])
            assert _sum(m, "rlserve_is_sleeping{") == 0, i
            assert _sum(m, 'vllm:engine_sleep_state{engine="0",model_name="%s",sleep_state="awake"}' % path) == 1, i
        for i in (0, 1):
            assert _complete(by[i][0], path, prompts[1], 10, False)[0] == got[1][0]
        pids = [srv.proc.pid] + _children(srv.proc.pid)
        assert len(pids) == 4, pids  # process 0, process 1, two engine cores
        api1 = next(p for p in pids[1:] if "core_proc" not in open(f"/proc/{p}/cmdline").read())
        os.kill(api1, signal.SIGKILL)
        assert srv.proc.wait(T) == 1
        assert f"API server 1 (pid {api1}) was killed by SIGKILL: stopping the server" in srv.log_tail(200_000)
        _until(lambda: not any(pid_alive(p) for p in pids), "every server process gone")
    finally:
        srv.stop()
