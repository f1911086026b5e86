"""benchmarks/stream_trace.py and benchmarks/stream_gaps.py (issue 37): the API process's per-stream write times,
read back beside vLLM's per-request client detail, say where a long inter-token gap came from."""

import asyncio
import types

from benchmarks import stream_gaps, stream_trace


def test_chunks_in_counts_the_events_the_client_counts():
    text = b'data: {"choices":[{"text":"a"}]}\n\n'
    usage = b'data: {"choices":[],"usage":{"completion_tokens":2}}\n\n'
    assert stream_trace.chunks_in(text) == 1
    assert stream_trace.chunks_in(text + text + usage + b"data: [DONE]\n\n") == 2
    assert stream_trace.chunks_in(b'data: {"choices": []}\n\n') == 0
    assert stream_trace.chunks_in(b"") == 0


def test_patched_send_writes_one_line_per_stream(tmp_path):
    sent = []

    class Cycle:  # the shape of uvicorn's RequestResponseCycle that the patch relies on
        def __init__(self, scope):
            self.scope = scope

        async def send(self, message):
            sent.append(message["type"])

    out = stream_trace._Out(str(tmp_path), lag_ms=1000.0)
    stream_trace.patch(types.SimpleNamespace(RequestResponseCycle=Cycle), out)
    text = b'data: {"choices":[{"text":"a"}]}\n\n'

    async def one_stream():
        c = Cycle({})
        await c.send({"type": "http.response.start", "status": 200, "headers": []})
        await c.send({"type": "http.response.body", "body": text + text, "more_body": True})
        await c.send({"type": "http.response.body", "body": text + b"data: [DONE]\n\n", "more_body": False})

    asyncio.run(one_stream())
    assert sent == ["http.response.start", "http.response.body", "http.response.body"]
    streams, lags, blocked = stream_gaps.server_streams(str(tmp_path))
    assert len(streams) == 1 and blocked == []
    s = streams[0]
    assert s["n"] == [2, 1]
    assert s["arrival"] <= s["start"] <= s["chunks"][0] <= s["chunks"][1]


def _client(start, ttft, itls):
    return {"start_times": [start], "ttfts": [ttft], "itls": [itls]}


def test_a_long_client_gap_is_server_side_only_if_the_server_was_as_late():
    # client: chunks at 10.1, 10.2, 10.5 (a 300 ms gap), 10.55
    result = _client(10.0, 0.1, [0.1, 0.3, 0.05])
    client = stream_gaps.client_streams(result)
    assert [round(t, 3) for t in client[0]["chunks"]] == [10.1, 10.2, 10.5, 10.55]
    d = stream_gaps.describe(client, 200.0, 10.0, 0.5)
    assert d["over_200ms"] == 1 and d["by_chunk_index"]["2-3"] == [1, 2] and d["by_time_s"] == {"0.5": 1}
    # the server wrote chunk 3 at 10.21 (its gap 10 ms): the client added the rest
    early = [{"arrival": 10.01, "start": 10.09, "chunks": [10.099, 10.199, 10.21, 10.549], "n": [1, 1, 1, 1]}]
    att = stream_gaps.attribute(client, early, 200.0)
    assert att["client-side"] == 1 and "server-side" not in att and att["matched streams"] == 1
    assert att["ttft_split_ms"]["send_to_arrival"][0] == 10.0
    # the server itself wrote chunk 3 at 10.499 (its gap 300 ms)
    late = [{"arrival": 10.01, "start": 10.09, "chunks": [10.099, 10.199, 10.499, 10.549], "n": [1, 1, 1, 1]}]
    att = stream_gaps.attribute(client, late, 200.0)
    assert att["server-side"] == 1 and "client-side" not in att


def test_a_write_of_two_chunks_matches_two_client_chunks():
    client = stream_gaps.client_streams(_client(0.0, 0.1, [0.25, 0.0]))
    server = [{"arrival": 0.0, "start": 0.05, "chunks": [0.099, 0.349], "n": [1, 2]}]
    assert stream_gaps.match(client, server) == [0]
    assert stream_gaps.attribute(client, server, 200.0)["server-side"] == 1
    # a server stream with another chunk count is not this client stream
    assert stream_gaps.match(client, [dict(server[0], n=[1, 1])]) == [None]


def test_the_raw_clients_reads_become_vllms_per_chunk_gaps():
    from benchmarks.raw_stream_bench import to_vllm_result

    # one request sent at 1.0: a read of 1 event at 1.2, of 2 at 1.3, of 1 at 1.35; one failed request
    run = {"t0": 1.0, "t1": 3.0, "results": [
        {"status": 200, "t0": 1.0, "reads": [(1.2, 1), (1.3, 2), (1.35, 1)], "errors": 0},
        {"status": 500, "t0": 1.0, "reads": [], "errors": 0}]}
    r = to_vllm_result(run, max_tokens=4)
    assert r["completed"] == 1 and r["failed"] == 1 and r["output_throughput"] == 2.0
    assert r["start_times"] == [1.0] and [round(x, 3) for x in r["ttfts"]] == [0.2]
    assert [round(g, 3) for g in r["itls"][0]] == [0.1, 0.0, 0.05]  # the second event of a read: gap 0
    client = stream_gaps.client_streams(r)
    assert [round(t, 3) for t in client[0]["chunks"]] == [1.2, 1.3, 1.3, 1.35]


def test_a_result_without_start_times_keeps_its_gaps_and_drops_the_attribution(tmp_path):
    result = {"ttfts": [0.1], "itls": [[0.1, 0.3]]}  # an older vllm bench serve: no start_times
    client = stream_gaps.client_streams(result)
    assert [round(t, 3) for t in client[0]["chunks"]] == [0.1, 0.2, 0.5]
    (tmp_path / "1.chunks").write_text("10.0 10.05 10.1 1 10.2 1 10.5 1\n")
    rep = stream_gaps.report("r", result, str(tmp_path), 200.0, 0.5, 20.0)
    assert rep["client"]["over_200ms"] == 1 and rep["client"]["by_time_s"] == {}
    assert "attribution" not in rep and rep["server"]["over_200ms"] == 1 and rep["run_s"] == 0.5
