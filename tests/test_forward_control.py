""":class:`rlserve.server.multi_api.ForwardControl` (API processes 1..N-1 forward the control routes to
API process 0) and a client that goes away: a control action is forwarded whole or not at all.

* The client disconnects mid-body: nothing reaches process 0 (no partial body is forwarded, no
  control action starts), nothing is answered, the process's own app is not called.
* The client disconnects after its whole body, while process 0 works on it: the forwarded call is
  not cancelled; process 0 gets the whole body once and its action completes (the answer is sent
  to a connection that is gone: uvicorn drops it).

Process 0 is an ``httpx.MockTransport`` in place of the unix socket (no sockets, no timing: its
handler waits on an event the test sets)."""

from __future__ import annotations

import asyncio
import json

import httpx

from rlserve.server.multi_api import ForwardControl

BODY = json.dumps({"mode": "keep", "clear_cache": True}).encode()


class Process0:
    """A stand-in for API process 0's control socket: records every request it gets (method,
    path, body) and answers 200 once ``release`` is set."""

    def __init__(self):
        self.got: list[tuple[str, str, bytes]] = []
        self.done: list[bytes] = []  # the bodies whose action completed
        self.release = asyncio.Event()
        self.arrived = asyncio.Event()

    async def handle(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        self.got.append((request.method, request.url.path, body))
        self.arrived.set()
        await self.release.wait()
        self.done.append(body)
        return httpx.Response(200, json={"paused": True})


def _forwarder(p0: Process0):
    app_calls = []

    async def app(scope, receive, send):
        app_calls.append(scope["path"])

    fc = ForwardControl(app, "/nonexistent/control.sock", max_body_bytes=1 << 20)
    fc._client = httpx.AsyncClient(transport=httpx.MockTransport(p0.handle), base_url="http://api-server-0")
    return fc, app_calls


def _scope(path="/pause"):
    return {"type": "http", "method": "POST", "path": path, "query_string": b"",
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]}


def test_a_disconnect_mid_body_forwards_nothing():
    async def scenario():
        p0 = Process0()
        fc, app_calls = _forwarder(p0)
        msgs = [{"type": "http.request", "body": BODY[:10], "more_body": True}, {"type": "http.disconnect"}]
        sent = []

        async def receive():
            return msgs.pop(0)

        async def send(message):
            sent.append(message)

        await asyncio.wait_for(fc(_scope(), receive, send), 30)
        await fc._client.aclose()
        return p0.got, sent, app_calls, msgs

    got, sent, app_calls, left = asyncio.run(scenario())
    assert got == [] and sent == [] and app_calls == [] and left == []


def test_a_disconnect_after_the_body_does_not_cancel_the_forwarded_call():
    async def scenario():
        p0 = Process0()
        fc, app_calls = _forwarder(p0)
        msgs = [{"type": "http.request", "body": BODY[:10], "more_body": True},
                {"type": "http.request", "body": BODY[10:], "more_body": False}]
        disconnected = asyncio.Event()
        sent = []

        async def receive():
            if msgs:
                return msgs.pop(0)
            await disconnected.wait()  # (a further read would see the disconnect)
            return {"type": "http.disconnect"}

        async def send(message):  # as uvicorn once the connection is gone: dropped
            sent.append(message["type"] if disconnected.is_set() else "sent before the disconnect")

        task = asyncio.ensure_future(fc(_scope(), receive, send))
        await p0.arrived.wait()  # process 0 has the request (bounded by the wait_for below)
        disconnected.set()
        for _ in range(10):  # the forwarder runs on; it must not give up on the call
            await asyncio.sleep(0)
        assert not task.done() and p0.done == []
        p0.release.set()
        await asyncio.wait_for(task, 30)
        await fc._client.aclose()
        return p0.got, p0.done, sent, app_calls

    got, done, sent, app_calls = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert got == [("POST", "/pause", BODY)]  # the whole body, once
    assert done == [BODY]  # process 0's action completed
    assert sent == ["http.response.start", "http.response.body"] and app_calls == []
