"""A plain stream's middle chunks written from the per-step callback (issue 37,
``rlserve/server/direct_write.py``): over a real socket, uvicorn's httptools protocol and the whole
app, the bytes of a streamed completion or chat answer are those of the same stream with every
chunk through the request's coroutine and the ASGI stack (the protocol's ``direct_write=False``):
plain, ``include_usage``, ``continuous_usage_stats`` (never direct), a stop string mid-stream,
``n=2``, ``return_token_ids``, a weight update mid-stream. Also: a client that goes away mid-stream
(its request is aborted, nothing is logged as an error, the server goes on), a client that stops
reading (the transport pauses: the rest goes through the coroutine, merged, and the answer is
whole), the real ``openai`` client, the h11 stack (no direct writes: the same events), the mailbox
rules of a sink (``front_request.put``), a sink that fails, and the app's middleware list (none may
read a body message, which the direct writes bypass).

The engine is a fake on the engine thread that makes one step each time the test releases one; a
test releases the next step once the client has read a byte of the previous step's chunk (each
step here makes one). So both servers see the same outputs one by one, whatever the machine's
speed: no output merges unless the test makes it (the slow reader), and no timed assertion."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import threading
import time

import pytest

from rlserve.engine.front.front_request import FrontRequest, Wakeup, put
from rlserve.engine.outputs import CompletionOutput, RequestOutput
from rlserve.server import direct_write
from tests.test_async_engine import FakeEngine
from tests.tiny_models import build_tokenizer

T = 60.0  # bound on every wait (seconds): only a hang reaches it
#: the text each step adds to a sample (sample k starts k pieces later); none is empty, so every step
#: sends a chunk, also in chat
PIECES = ["Hel", "lo", " wé", "世", "界", ", the", " end", " of", " it", " STOP", " after", " more", "!"]


class StepEngine(FakeEngine):
    """:class:`tests.test_async_engine.FakeEngine` (token ``prompt[0] + k`` at step k, ``length`` at
    ``max_tokens``) that makes a step only when :meth:`release` lets it, with text: token k of sample
    i is ``PIECES[(k + i) % len(PIECES)]`` (from token ``big_from`` on, ``big`` "x"), cut before a
    stop string it holds (``stop``, the string as ``stop_reason``)."""

    def __init__(self, tokenizer):
        super().__init__(None, 0, step_s=0)
        self.tokenizer, self.vocab_size, self.max_model_len, self.eos_token_ids = tokenizer, len(tokenizer), 4096, [2]
        self.aborted: list[str] = []
        self.big_from, self.big = None, 4000
        self._gate = threading.Semaphore(0)

    def release(self, k: int = 1) -> None:
        for _ in range(k):
            self._gate.release()

    def drain(self) -> None:
        """Forget steps released and not taken (no request is in flight)."""
        while self._gate.acquire(blocking=False):
            pass

    def step(self):
        if not self._gate.acquire(timeout=0.05):
            return []  # (the engine thread runs its commands, e.g. an abort, between steps)
        return super().step()

    def _out(self, rid, reason=None):
        out = super()._out(rid, reason)
        for c in out.outputs:
            c.text = "".join("x" * self.big if self.big_from is not None and k >= self.big_from
                             else PIECES[(k + c.index) % len(PIECES)] for k in range(len(c.token_ids)))
            for s in self.reqs[rid][1].stop or ():
                if s in c.text:
                    c.text, c.finish_reason, c.stop_reason = c.text[:c.text.index(s)], "stop", s
        out.finished = all(c.finish_reason for c in out.outputs)
        return out

    def abort_request(self, ids):
        self.aborted += [ids] if isinstance(ids, str) else list(ids)
        return super().abort_request(ids)


def wait_for(cond, what: str):
    """Wait until ``cond()`` (a state, polled); ``T`` only catches a hang."""
    end = time.monotonic() + T
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


class Server:
    """The app over :class:`StepEngine` on uvicorn (uvloop + httptools, rlserve's protocol class; ``h11``:
    the stdlib loop + h11, which has no direct writes) in a thread; ``direct``: the protocol's
    ``direct_write``."""

    def __init__(self, model_dir: str, direct: bool, h11: bool = False):
        import uvicorn

        from rlserve.config import EngineConfig
        from rlserve.engine.front.async_engine import AsyncEngine
        from rlserve.server.app import build_app
        from rlserve.server.http_protocol import http_stack
        from rlserve.server.launch import bound_socket
        from rlserve.server.state import ServerSettings

        stack = http_stack("h11" if h11 else "auto")
        assert stack.name == ("asyncio+h11" if h11 else "uvloop+httptools")
        self.engine = StepEngine(build_tokenizer())
        self.aengine = AsyncEngine(EngineConfig(model=model_dir, device="cpu", dtype="float32", max_model_len=4096),
                                   engine_factory=lambda cfg, i: self.engine)
        self._sock = bound_socket()  # listened on by uvicorn: never free between its choice and the listen
        self.port = self._sock.getsockname()[1]
        app = build_app(self.aengine, ServerSettings(model=model_dir, served_model_names=["m"], host="127.0.0.1",
                                                     port=self.port))
        self.app = app
        app.state.rlserve._templates = False  # chat templates render here (no worker processes)
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                     loop="asyncio" if h11 else "uvloop",
                                                     http=stack.protocol(30.0, direct_write=direct)))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        self._thread.start()
        wait_for(lambda: self._server.started or not self._thread.is_alive(), "the server's start")
        assert self._server.started

    def close(self):
        self._server.should_exit = True
        self._thread.join(T)
        self._sock.close()
        self.aengine.shutdown()


class RawStream:
    """One streamed request on its own connection: the raw bytes as they come, and the body's SSE
    events (the chunked framing parsed)."""

    def __init__(self, port: int, path: str, body: dict, rcvbuf: int | None = None):
        self.sock = socket.socket()
        if rcvbuf:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(T)
        self.sock.connect(("127.0.0.1", port))
        data = json.dumps(body).encode()
        self.sock.sendall(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                          b"connection: close\r\n\r\n%s" % (path.encode(), len(data), data))
        self.raw = b""
        self.closed = False

    def _recv(self) -> None:
        got = self.sock.recv(65536)
        if not got:
            self.closed = True
        self.raw += got

    def head_and_body(self) -> tuple[bytes, bytes]:
        head, _, body = self.raw.partition(b"\r\n\r\n")
        return head, body

    def events(self) -> list[bytes]:
        """The complete SSE events received so far (the chunked body decoded)."""
        body, out = self.head_and_body()[1], b""
        while True:
            size_line, sep, rest = body.partition(b"\r\n")
            if not sep:
                break
            size = int(size_line, 16)
            if size == 0 or len(rest) < size + 2:
                break
            out, body = out + rest[:size], rest[size + 2:]
        return [e for e in out.split(b"\n\n")[:-1]]

    def read_events(self, k: int) -> None:
        """Read until at least ``k`` events have come (or the stream ended)."""
        while len(self.events()) < k and not self.closed:
            self._recv()

    def read_all(self) -> bytes:
        while not self.closed:
            self._recv()
        self.sock.close()
        return self.raw


def lockstep(srv: Server, path: str, body: dict, before_step=None) -> RawStream:
    """Stream ``body`` to its end one step at a time: release a step, read until one more event came
    (each step here makes one chunk); ``before_step(k)`` runs before step k is released."""
    srv.engine.drain()
    s = RawStream(srv.port, path, body)
    k = 0
    while not s.closed:
        seen = len(s.events())
        if before_step is not None:
            before_step(k)
        srv.engine.release()
        k += 1
        s.read_events(seen + 1)
        if s.events() and s.events()[-1] == b"data: [DONE]":
            break
    s.read_all()
    return s


def normalized(raw: bytes) -> bytes:
    """The response without what differs between two runs of one request: the ``date`` header, the
    answer's id and ``created`` (the same lengths: the chunk sizes stay valid)."""
    raw = re.sub(rb"date: [^\r]*\r\n", b"", raw)
    raw = re.sub(rb'"id":"(cmpl|chatcmpl)-[0-9a-f]{24}"', rb'"id":"\1-' + b"0" * 24 + b'"', raw)
    return re.sub(rb'"created":\d{10}', b'"created":1234567890', raw)


@pytest.fixture(scope="module")
def servers(tiny_model):
    made = {}
    try:
        made = {d: Server(tiny_model("llama"), d) for d in (True, False)}
        made["h11"] = Server(tiny_model("llama"), True, h11=True)
        yield made
    finally:
        for s in made.values():
            s.close()


@pytest.fixture
def direct_writes(monkeypatch):
    """How many chunks went out through :meth:`DirectWrite.write` (and the writers made)."""
    count, writers = [0], []
    real_write, real_init = direct_write.DirectWrite.write, direct_write.DirectWrite.__init__

    def write(self, body):
        count[0] += 1
        real_write(self, body)

    def init(self, cycle):
        real_init(self, cycle)
        writers.append(self)

    monkeypatch.setattr(direct_write.DirectWrite, "write", write)
    monkeypatch.setattr(direct_write.DirectWrite, "__init__", init)
    return count, writers


def _data(events: list[bytes]) -> list:
    return [json.loads(e[len(b"data: "):]) for e in events if e != b"data: [DONE]"]


CASES = [  # (path, body, direct writes expected)
    ("/v1/completions", {"max_tokens": 8}, True),
    ("/v1/completions", {"max_tokens": 8, "return_token_ids": True, "stream_options": {"include_usage": True}}, True),
    ("/v1/completions", {"max_tokens": 6, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     False),
    ("/v1/completions", {"max_tokens": 12, "stop": [" STOP"]}, True),
    ("/v1/completions", {"max_tokens": 7, "n": 2, "return_token_ids": True}, True),
    ("/v1/completions", {"max_tokens": 6, "logprobs": None, "echo": True}, False),
    ("/v1/chat/completions", {"max_tokens": 8}, True),
    ("/v1/chat/completions", {"max_tokens": 8, "n": 2, "stream_options": {"include_usage": True}}, True),
    ("/v1/chat/completions", {"max_tokens": 12, "stop": [" STOP"], "return_token_ids": True}, True),
    ("/v1/chat/completions", {"max_tokens": 6, "stream_options": {"include_usage": True,
                                                                   "continuous_usage_stats": True}}, False),
]


def _request(path: str, body: dict) -> dict:
    body = dict(body, model="m", stream=True, temperature=0)
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        body["prompt"] = [5, 6, 7]
    return body


@pytest.mark.parametrize("path,body,direct", CASES)
def test_stream_bytes_equal_the_coroutine_path(servers, direct_writes, path, body, direct):
    count, _ = direct_writes
    fast = lockstep(servers[True], path, _request(path, body))
    written = count[0]
    old = lockstep(servers[False], path, _request(path, body))
    assert count[0] == written  # the old path writes nothing directly
    assert normalized(fast.raw) == normalized(old.raw)
    chunks = _data(fast.events())
    steps = 10 if body.get("stop") else body["max_tokens"]  # (" STOP" is the 10th piece)
    # every output's chunks but the first and the last went out directly
    assert written == (steps - 2 if direct else 0)
    text = ""
    for c in chunks:
        for ch in c["choices"]:
            if ch["index"] == 0:
                text += ch["text"] if "text" in ch else ch["delta"].get("content") or ""
    want = "".join(PIECES[:steps])
    assert text.endswith(want[:want.index(" STOP")] if body.get("stop") else want)
    assert fast.events()[-1] == b"data: [DONE]" and fast.raw.endswith(b"\r\n0\r\n\r\n")


def test_the_h11_stack_streams_the_same_events_without_direct_writes(servers, direct_writes):
    """The fallback: the h11 protocol installs no writer, so every chunk goes through the coroutine."""
    count, writers = direct_writes
    for path, body in (CASES[1][:2], CASES[7][:2]):
        fast = lockstep(servers[True], path, _request(path, body))
        h11 = lockstep(servers["h11"], path, _request(path, body))
        assert [normalized(e) for e in h11.events()] == [normalized(e) for e in fast.events()]
    assert len(writers) == 2 and count[0] == 6 + 6  # the httptools server's two streams only (8 steps each)


def test_a_weight_update_mid_stream(servers, direct_writes):
    count, _ = direct_writes
    body = _request("/v1/chat/completions", {"max_tokens": 6, "return_token_ids": True})
    runs = {}
    for d in (True, False):
        srv = servers[d]
        srv.aengine.set_weight_version("v1")

        def before(k, srv=srv):
            if k == 3:
                srv.aengine.set_weight_version("v2")
        runs[d] = lockstep(srv, "/v1/chat/completions", body, before)
    assert normalized(runs[True].raw) == normalized(runs[False].raw)
    assert count[0] == 4  # steps 2-5 (step 1 with the role chunk, step 6 the last)
    chunks = [c["choices"][0] for c in _data(runs[True].events())]
    assert [c["weight_version"] for c in chunks] == ["v1"] * 4 + ["v2"] * 3  # (the role chunk first)
    assert chunks[-1]["weight_versions"] == ["v1", "v2"] and chunks[-1]["finish_reason"] == "length"
    ids = [t for c in chunks for t in (c.get("token_ids") or [])]
    assert ids == list(range(ids[0], ids[0] + 6))  # (the fake's tokens: prompt[0] + k)


def test_a_client_gone_mid_stream_aborts_its_request(servers, direct_writes, caplog):
    count, _ = direct_writes
    srv = servers[True]
    caplog.set_level(logging.WARNING)
    srv.engine.drain()
    s = RawStream(srv.port, "/v1/completions", _request("/v1/completions", {"max_tokens": 1000}))
    for k in range(1, 5):
        srv.engine.release()
        s.read_events(k)
    assert count[0] == 3
    rid = next(iter(srv.engine.reqs))
    s.sock.close()
    # the next writes find the connection gone; the disconnect aborts the request in the engine
    def stepped_until_aborted():  # one step at a time: each finds the connection gone, or the abort came
        if srv.engine.steps == taken[0]:
            taken[0] += 1
            srv.engine.release()
        return rid in srv.engine.aborted

    taken = [srv.engine.steps]
    wait_for(stepped_until_aborted, "the request's abort")
    wait_for(lambda: not srv.aengine.request_ids(), "the request's end")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    again = lockstep(srv, "/v1/completions", _request("/v1/completions", {"max_tokens": 3}))
    assert _data(again.events())[-1]["choices"][0]["finish_reason"] == "length"


def test_a_slow_reader_gets_the_whole_answer(servers, direct_writes):
    count, writers = direct_writes
    srv = servers[True]
    srv.engine.drain()
    s = RawStream(srv.port, "/v1/completions", _request("/v1/completions", {"max_tokens": 400,
                                                                            "return_token_ids": True}), rcvbuf=4096)
    srv.engine.release()
    s.read_events(1)
    (w,) = writers
    w.cycle.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    srv.engine.big_from = 1  # the client reads nothing more: 4,000-byte chunks fill the transport's buffer
    try:
        steps = srv.engine.steps
        while not w.cycle.flow.write_paused:
            srv.engine.release()
            steps += 1
            wait_for(lambda: srv.engine.steps == steps, "a step")
            assert len(srv.engine.reqs) == 1  # (400 tokens: still running)
        direct = count[0]
        assert direct >= 1  # until the transport paused
        srv.engine.release(3)  # these reach the coroutine, which waits for the transport
        wait_for(lambda: srv.engine.steps == steps + 3, "three steps")
        assert count[0] == direct
        srv.engine.release(400)
        raw = s.read_all()
    finally:
        srv.engine.big_from = None
    chunks = [c["choices"][0] for c in _data(s.events()) if c["choices"]]
    assert b"data: [DONE]" in raw
    assert [t for c in chunks for t in c["token_ids"]] == list(range(5, 405))  # (the fake's tokens: prompt[0] + k)
    assert "".join(c["text"] for c in chunks) == PIECES[0] + "x" * (4000 * 399)
    assert chunks[-1]["finish_reason"] == "length"


def test_the_openai_client_reads_a_direct_stream(servers, direct_writes):
    import openai

    count, _ = direct_writes
    srv = servers[True]
    srv.engine.drain()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="x", max_retries=0, timeout=T)
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=9,
                                            stream=True, stream_options={"include_usage": True})
    got, usage = [], None
    srv.engine.release()
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            got.append((ch.delta.content, ch.finish_reason))
            if ch.delta.content:  # a step's chunk: release the next step
                srv.engine.release()
    assert [g[0] for g in got] == [""] + PIECES[:9]
    assert got[-1][1] == "length" and all(g[1] is None for g in got[:-1])
    assert usage.completion_tokens == 9 and usage.prompt_tokens > 0
    assert count[0] == 7  # steps 2-8


def _output(finished=False, tokens=(10,)):
    return RequestOutput("r", None, [1], None, [CompletionOutput(0, "a" * len(tokens), list(tokens))], finished)


def test_a_sink_is_offered_only_what_the_consumer_has_not_got_ahead():
    loop = asyncio.new_event_loop()
    try:
        taken = []
        req = FrontRequest("r", [1], None, loop, Wakeup(loop), 0.0, sink=lambda o: taken.append(o) or True)
        a, b = _output(), _output(tokens=(10, 11))
        put(req, a)
        assert taken == [a] and req.slot is None and not req.event.is_set()
        req.sink = lambda o: False  # refused (a paused transport): the consumer's
        put(req, b)
        assert req.slot is b and req.event.is_set()
        offered = []
        req.sink = lambda o: offered.append(o) or True
        put(req, _output(tokens=(10, 11, 12)))  # the consumer has one waiting: never past it
        assert not offered and req.slot.outputs[0].token_ids == [10, 11, 12]
        req.slot = None
        req.event.clear()
        last = _output(finished=True)
        put(req, last)  # the last output is the consumer's, and the sink is dropped
        assert not offered and req.slot is last and req.sink is None
        req2 = FrontRequest("s", [1], None, loop, Wakeup(loop), 0.0, interval=2, sink=lambda o: offered.append(o) or True)
        put(req2, a)  # the first: due
        assert offered == [a]
        put(req2, b)  # one token more: not due under interval 2, nobody woken
        assert offered == [a] and req2.slot is None and not req2.event.is_set()
        c = _output(tokens=(10, 11, 12))
        put(req2, c)
        assert offered == [a, c]
        put(req2, RuntimeError("x"))
        assert isinstance(req2.slot, RuntimeError) and req2.sink is None
    finally:
        loop.close()


def test_the_app_has_no_middleware_that_reads_a_body_message(servers):
    """The direct writes bypass the middleware ``send`` wrappers: a middleware that reads or
    changes a body message (gzip, a body log) would need them on the coroutine path."""
    from rlserve.server.limits import BodySizeLimit
    from rlserve.server.text_check import LoneSurrogateCheck

    assert [m.cls for m in servers[True].app.user_middleware] == [BodySizeLimit, LoneSurrogateCheck]


class _Flow:
    write_paused = False


class _Transport:
    def __init__(self, fail=False):
        self.fail, self.out, self.closed = fail, [], False

    def write(self, b):
        if self.fail:
            raise OSError("injected")
        self.out.append(b)

    def is_closing(self):
        return self.closed

    def close(self):
        self.closed = True


class _Cycle:
    """The fields of uvicorn's httptools ``RequestResponseCycle`` that ``DirectWrite`` reads."""

    def __init__(self, scope, transport=None):
        self.scope, self.transport, self.flow = scope, transport or _Transport(), _Flow()
        self.response_started, self.response_complete, self.disconnected, self.chunked_encoding = True, False, False, True


def test_install_only_for_the_cycle_of_the_scope():
    assert direct_write.sink_for({"type": "http"}) is None
    assert direct_write.sink_for({"type": "http", "extensions": {}}) is None
    scope = {"method": "HEAD"}
    direct_write.install(scope, _Cycle(scope))
    assert "extensions" not in scope  # HEAD: no body
    scope = {"method": "POST"}
    direct_write.install(scope, _Cycle({}))  # a cycle of another scope (left from an upgrade)
    direct_write.install(scope, object())  # not a cycle it knows
    assert "extensions" not in scope
    direct_write.install(scope, _Cycle(scope))
    assert isinstance(direct_write.sink_for(scope), direct_write.DirectSink)


def test_a_sink_that_fails_leaves_the_stream_to_its_coroutine(caplog):
    out = _output()
    sink = direct_write.DirectSink(direct_write.DirectWrite(_Cycle({})))
    sink.fill, sink.parked = lambda o: 1 / 0, True
    assert sink(out) is False and sink.fill is None  # nothing recorded: the coroutine writes it
    assert sink(out) is False  # and everything after
    transport = _Transport(fail=True)
    sink = direct_write.DirectSink(direct_write.DirectWrite(_Cycle({}, transport)))
    sink.fill, sink.parked = lambda o: b"data: x\n\n", True
    assert sink(out) is True and transport.closed  # recorded as sent and lost: the stream ends, no gap
    assert sink.fill is None
    assert [r.levelno for r in caplog.records] == [logging.ERROR, logging.ERROR]
    ok = _Transport()
    sink = direct_write.DirectSink(direct_write.DirectWrite(_Cycle({}, ok)))
    sink.fill = lambda o: b"data: x\n\n"
    assert sink(out) is False  # not parked
    sink.parked = True
    assert sink(out) is True and ok.out == [b"9\r\ndata: x\n\n\r\n"]
    sink.writer.cycle.flow.write_paused = True
    assert sink(out) is False and len(ok.out) == 1
