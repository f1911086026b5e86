"""The API process's streaming path under load (issue 37): engine-core outputs handled on the
event loop, several steps' deltas folded into one output per request, the start-up heap frozen out
of the garbage collector, and the SSE encoding."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import pytest

from rlserve.engine import core_protocol as proto
from rlserve.engine.front.output_processor import OutputProcessor
from rlserve.engine.sampling_params import SamplingParams
from rlserve.server.openai_stream import sse

T = 120.0  # bound on every wait (seconds)
PROMPT = [5, 6, 7]


class _Req:
    def __init__(self, params, stream=True):
        self.params, self.stream, self.prompt, self.arrival_time = params, stream, PROMPT, 1.0


def _delta(rid, toks, finished=False, reason=None, start=False, versions=("v1",), first=2.0):
    return proto.RequestDelta(rid, [proto.SampleDelta(0, list(toks), [-0.25] * len(toks), None, reason, None)],
                              finished, list(versions), first, proto.RequestStart(PROMPT) if start else None)


def _steps(ids, rid="r", stop_reason=None):
    """One delta per token, as the core sends a streamed request's steps (the last finishes it)."""
    last = len(ids) - 1
    return [_delta(rid, [t], finished=(k == last and stop_reason is not None), reason=stop_reason if k == last else None,
                   start=(k == 0)) for k, t in enumerate(ids)]


def _one_by_one(tok, steps, reqs):
    proc = OutputProcessor(tok)
    outs = []
    for d in steps:
        outs.extend(proc.process([d], reqs)[0])
    return outs


def test_steps_folded_into_one_output_equal_the_last_of_one_by_one():
    from tests.tiny_models import build_tokenizer

    tok = build_tokenizer()
    ids = tok.encode("héllo 世界, the end")  # multi-byte characters split over tokens
    other = tok.encode("another one")
    reqs = {"r": _Req(SamplingParams(max_tokens=50, logprobs=0)), "s": _Req(SamplingParams(max_tokens=50, logprobs=0))}
    steps = [d for pair in zip(_steps(ids, "r", "length"), _steps(other + [3] * (len(ids) - len(other)), "s"))
             for d in pair]
    want = _one_by_one(tok, steps, reqs)
    outs, errors, stops, aborts = OutputProcessor(tok).process(steps, reqs)
    assert not errors and not stops and not aborts
    assert [o.request_id for o in outs] == ["r", "s"]  # one output each, in first-touch order
    last = {o.request_id: o for o in want}  # the newest output of each, one delta at a time
    for o in outs:
        w = last[o.request_id]
        (c,), (cw,) = o.outputs, w.outputs
        assert (c.text, c.token_ids, c.finish_reason) == (cw.text, cw.token_ids, cw.finish_reason)
        assert c.cumulative_logprob == cw.cumulative_logprob == -0.25 * len(c.token_ids)
        assert o.finished == w.finished and o.weight_versions == ["v1"] and o.first_token_time == 2.0
    assert outs[0].finished and outs[0].outputs[0].text == "héllo 世界, the end"
    assert not outs[1].finished and outs[1].outputs[0].token_ids == other + [3] * (len(ids) - len(other))


def test_folded_steps_after_a_stop_string_are_dropped():
    """A stop string matched in step k ends the request here; the steps the core sent before it
    heard of it, folded into the same call, are dropped (not an error: no start for them)."""
    from tests.tiny_models import build_tokenizer

    tok = build_tokenizer()
    ids = tok.encode("ab STOP cd ef")
    stop_at = next(k for k in range(1, len(ids) + 1) if "STOP" in tok.decode(ids[:k]))
    reqs = {"r": _Req(SamplingParams(max_tokens=50, stop=["STOP"]))}
    proc = OutputProcessor(tok)
    outs, errors, stops, aborts = proc.process(_steps(ids, "r", "length"), reqs)
    assert not errors and not stops and aborts == ["r"] and len(proc) == 0
    (out,) = outs
    c = out.outputs[0]
    assert out.finished and (c.finish_reason, c.stop_reason) == ("stop", "STOP")
    assert c.token_ids == ids[:stop_at] and c.text == "ab "


def test_core_outputs_are_handled_on_the_event_loop(tiny_model, monkeypatch):
    """Process mode: the API side's output processing runs on the thread of the loop that awaits
    the outputs, not on the replica's reader thread (where it held the GIL against the loop).
    Fails on the old code (every call on ``rlserve-core-reader-0``)."""
    from rlserve.config import EngineConfig
    from rlserve.engine.front.async_engine import AsyncEngine

    threads, mine = [], []
    real, real_init = OutputProcessor.process, OutputProcessor.__init__

    def spy(self, deltas, reqs):
        if any(p is self for p in mine):  # (other tests' servers may still run in this process: the
            threads.append(threading.current_thread().name)  # weight-sync tests' shared ones)
        return real(self, deltas, reqs)

    def init(self, *a, **k):
        mine.append(self)
        real_init(self, *a, **k)

    monkeypatch.setattr(OutputProcessor, "process", spy)
    monkeypatch.setattr(OutputProcessor, "__init__", init)
    aeng = AsyncEngine(EngineConfig(model=tiny_model("llama"), device="cpu", dtype="float32", max_model_len=128),
                       engine_mode="process")
    try:
        async def run():
            loop_thread = threading.current_thread().name
            outs = [o async for o in aeng.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True,
                                                                          temperature=0))]
            return loop_thread, outs

        loop_thread, outs = asyncio.run(asyncio.wait_for(run(), T))
    finally:
        aeng.shutdown()
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 12
    assert threads and set(threads) == {loop_thread}, threads


def test_freeze_startup_heap_moves_the_live_objects_out_of_collection():
    """In a fresh interpreter (freezing here would keep this test run's garbage forever)."""
    code = ("import gc, json; from rlserve.gc_heap import freeze_startup_heap; "
            "import rlserve.server.openai_stream; before = len(gc.get_objects()); t = gc.get_threshold(); "
            "n = freeze_startup_heap('test'); print(json.dumps([before, n, gc.get_freeze_count(), "
            "len(gc.get_objects()), t, gc.get_threshold()]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=T, check=True)
    before, n, count, after, default, thresholds = json.loads(out.stdout.strip().splitlines()[-1])
    assert n == count > 0
    assert n >= before // 2  # the imported modules' objects (tens of thousands): most of what was alive
    assert after < 100  # what the collector still traverses: almost nothing
    # young collections YOUNG_COLLECTION_EVERY (10,000) allocations apart (CPython's default: 700), full
    # collections FULL_COLLECTION_EVERY (100) generation-1 collections apart (CPython's default: 10)
    assert thresholds == [10_000, default[1], 100] and default[0] < 10_000 and default[2] < 100

def test_sse_encoding():
    obj = {"id": "x", "choices": [{"text": "é 世界 \u2028", "logprobs": None, "n": -9999.0}]}
    s = sse(obj)
    assert s.startswith("data: ") and s.endswith("\n\n")
    assert json.loads(s[6:]) == obj
    assert "é 世界" in s and '"logprobs":null' in s  # UTF-8 text, compact separators
    lone = sse({"text": "a\ud800b"})  # msgspec refuses a lone surrogate: json.dumps escapes it
    assert lone == 'data: {"text":"a\\ud800b"}\n\n'


class _Frame:
    def __init__(self, raw: bytes):
        self.buffer = memoryview(raw)


def test_frames_that_arrive_while_the_loop_handles_outputs_wait_for_their_own_callback():
    """The event loop's output callback handles the frames waiting when it starts and returns:
    frames the reader receives meanwhile get a callback of their own, queued behind the streams
    the first one woke. On the old code the callback looped while frames kept coming (an engine
    that steps faster than the loop handles its outputs kept the loop there, and no stream wrote
    meanwhile: issue 37's seconds-long gaps), handling all 4 frames below in one call."""
    from rlserve.engine.front.core_client import CoreProcReplica

    enc = proto.output_encoder()
    step = [enc.encode(proto.CoreOutputs(deltas=[_delta("r", [k])])) for k in range(4)]
    rep = object.__new__(CoreProcReplica)  # no engine-core process: only the frame handling
    rep.index, rep._dec = 0, proto.output_decoder()
    rep._pending, rep._handle_lock, rep._scheduled_on = __import__("collections").deque(), threading.Lock(), None
    handled, scheduled = [], []

    def handle_outputs(msgs):  # a step's outputs; meanwhile the reader receives the next step
        handled.append([m.deltas[0].samples[0].token_ids[0] for m in msgs])
        if len(handled) < len(step):
            rep._pending.append(_Frame(step[len(handled)]))
            scheduled.append(rep._scheduled_on)  # None: the reader schedules a callback for it

    rep._handle_outputs = handle_outputs
    rep._pending.append(_Frame(step[0]))

    async def on_loop():
        rep._handle_pending()
        return [list(h) for h in handled], len(rep._pending)

    first, left = asyncio.run(asyncio.wait_for(on_loop(), T))
    assert first == [[0]] and left == 1 and scheduled == [None]
    # the reader's own call (no loop running: start-up, exit) still handles everything
    rep._handle_pending()
    assert handled == [[0], [1], [2], [3]] and not rep._pending


def test_stall_probe_records_full_collections_and_slow_callbacks(tmp_path):
    """benchmarks/api_stream_probe.py (api_stream_load --probe), installed by its sitecustomize
    in a fresh interpreter: a 60 ms callback and one gc.collect() on an event loop are recorded."""
    import os
    import time

    from benchmarks import api_stream_probe

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import asyncio, gc, time\n"
            "def stall(): time.sleep(0.06)\n"
            "async def main():\n"
            "    loop = asyncio.get_running_loop(); loop.call_soon(stall)\n"
            "    await asyncio.sleep(0.1); gc.collect()\n"
            "asyncio.run(main())\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((api_stream_probe.site_dir(str(tmp_path)), root)),
               **{api_stream_probe.ENV_DIR: str(tmp_path), api_stream_probe.ENV_SLOW_MS: "20"})
    t0 = time.time()
    subprocess.run([sys.executable, "-c", code], env=env, timeout=T, check=True)
    got = api_stream_probe.summarize(str(tmp_path), t0 - 1, time.time() + 1)
    api = got["api"]
    assert api["gc2"]["n"] >= 1  # the gc.collect() (and the one of the interpreter's exit)
    stall = [row for row in api["slow"]["top"] if row[0] == "stall"]
    assert len(stall) == 1 and stall[0][1] == 1 and stall[0][3] >= 55  # [name, count, total ms, max ms]: the 60 ms sleep


def test_wakeup_is_an_event_for_one_consumer():
    from rlserve.engine.front.front_request import Wakeup

    async def main():
        w = Wakeup(asyncio.get_running_loop())
        w.set()
        assert w.is_set() and w.future().done() and await w.wait()  # set first: no wait
        w.clear()
        fut = w.future()
        assert not fut.done() and not w.is_set()
        asyncio.get_running_loop().call_later(0.01, w.set)
        await fut
        assert w.is_set()
        w.clear()
        with pytest.raises(asyncio.TimeoutError):  # a timed-out wait (the held path's wait_for) ...
            await asyncio.wait_for(w.wait(), 0.01)
        waiter = asyncio.ensure_future(w.wait())  # ... leaves a later wait working
        await asyncio.sleep(0)
        assert not waiter.done()
        w.set()
        assert await asyncio.wait_for(waiter, T) is True
    asyncio.run(main())
