"""An operator's ``/pause`` / ``/resume`` and sleep mode's wake against an in-place weight update
(what the session-19 adversarial pass broke): generation never runs while an in-place update is
open, whatever the order of the calls, and a resume asked for meanwhile is not lost.

The races are driven on the server's own event loop (the route's work,
``control_routes.operator_resume``, and ``WeightTransferManager.start_update`` as two tasks in a
fixed order; ``asyncio.sleep(0)`` only lets the first task run to its first real wait, an engine
reply): no timing assumption, the interleaving is the same on every run."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from rlserve.server.control_routes import operator_resume
from rlserve.server.errors import APIError
from tests.transfer_harness import InProcessServer
from tests.transfer_sync import PROMPT_IDS, hf_greedy, llama, server_greedy, trainer  # noqa: F401 (llama: a fixture)


def on_loop(srv, make_coro, timeout_s: float = 60.0):
    """Run ``make_coro()`` on the in-process server's event loop; its result."""
    return asyncio.run_coroutine_threadsafe(make_coro(), srv.aengine.loop).result(timeout_s)


async def _race(srv, first: str):
    """An operator's /resume and an update's start as two tasks, ``first`` ("start" or "resume")
    scheduled and run to its first wait before the other. Returns (resume's outcome, whether
    generation is paused, whether the update session is open)."""
    state, manager = srv.app.state.rlserve, srv.manager
    tasks = {}
    for name in ((first, "resume" if first == "start" else "start")):
        tasks[name] = asyncio.ensure_future(manager.start_update(None) if name == "start" else operator_resume(state))
        await asyncio.sleep(0)
    await tasks["start"]
    try:
        await tasks["resume"]
        outcome = "resumed"
    except APIError as e:
        outcome = e.status
    return outcome, srv.aengine.is_paused(), manager._session is not None


@pytest.mark.parametrize("first", ["start", "resume"])
def test_operator_resume_racing_an_update_start_never_unpauses_it(llama, shared, first):  # noqa: F811
    """``first == "start"``: the update keep-pauses generation itself and an operator's /resume
    arrives while that pause takes effect; ``"resume"``: generation was paused by the operator and
    its /resume is unfreezing the replicas when the update starts. Either way the update's
    session must find (and keep) generation paused, and its end resumes it."""
    path, hf = llama
    with shared(path) as srv:
        eng = trainer(srv.url, hf)  # the transfer group is up (the engine loop is known)
        if first == "resume":
            assert httpx.post(srv.url + "/pause?mode=abort", timeout=30).status_code == 200
        outcome, paused, session_open = on_loop(srv, lambda: _race(srv, first))
        assert session_open
        assert paused, f"generation runs during an open in-place update (the /resume: {outcome})"
        # started first, the update's session refuses the resume (409); resumed first, the update
        # found generation running and paused it itself
        assert outcome == (409 if first == "start" else "resumed")
        eng.client.finish_weight_update()
        assert not srv.aengine.is_paused()  # the update's end resumes generation
        assert server_greedy(srv.url).status_code == 200
        eng.shutdown()


def test_resume_refused_during_an_update_is_done_at_its_end(llama, shared):  # noqa: F811
    """Operator pause, then an update starts (the operator's pause stands), then the operator's
    /resume is refused with 409 ("it resumes when the update finishes"): the update's end must
    then resume -- before, generation stayed paused and every request was held until the hold
    timeout (600 s)."""
    path, hf = llama
    with shared(path) as srv:
        eng = trainer(srv.url, hf)
        assert httpx.post(srv.url + "/pause?mode=abort", timeout=30).status_code == 200
        assert eng.client.start_weight_update()["paused_by_server"] is False
        r = httpx.post(srv.url + "/resume", timeout=30)
        assert r.status_code == 409 and "resumes when the update finishes" in r.json()["error"]["message"], r.text
        held: dict = {}
        th = threading.Thread(target=lambda: held.setdefault("r", server_greedy(srv.url)))
        th.start()
        eng.client.finish_weight_update()
        th.join(60)
        assert not th.is_alive(), "the request held behind the pause was not started by the update's end"
        assert held["r"].status_code == 200, held["r"].text
        assert not srv.aengine.is_paused()
        eng.shutdown()


def test_wake_up_during_an_in_place_update_leaves_generation_paused(llama):  # noqa: F811
    """A level-2 sleep, then an update starts (its weights' memory is mapped again; generation
    stays paused by the sleep), then /wake_up: the wake's resume must wait for the update's end,
    not run generation on weights the update is writing."""
    path, hf = llama
    with InProcessServer(path, enable_sleep_mode=True) as srv:
        eng = trainer(srv.url, hf)
        eng.send_weights()
        assert httpx.post(srv.url + "/sleep?level=2", timeout=60).status_code == 200
        eng.client.start_weight_update()
        r = httpx.post(srv.url + "/wake_up", timeout=60)
        assert r.status_code == 200, r.text
        assert srv.aengine.is_paused(), "the wake resumed generation while an in-place update is open"
        eng.client.finish_weight_update()
        assert not srv.aengine.is_paused()  # the update's end resumes
        eng.send_weights()
        assert server_greedy(srv.url).json()["completion_ids"] == [hf_greedy(hf, p) for p in PROMPT_IDS]
        eng.shutdown()


async def _staged_race(srv) -> tuple[str, dict]:
    """A staged update's finish (generation paused by the operator, so it commits under that
    pause) and then an operator's /resume, as two tasks. Returns (the version committed, what
    the resume saw: ``resumed_under`` the version being stamped when it took effect, or
    ``refused`` its status)."""
    state, manager, aeng = srv.app.state.rlserve, srv.manager, srv.aengine
    seen: dict = {}

    async def resume():
        try:
            await operator_resume(state)
            seen["resumed_under"] = aeng.weight_version
        except APIError as e:
            seen["refused"] = e.status

    finish = asyncio.ensure_future(manager.finish_update(None))
    await asyncio.sleep(0)  # the finish runs to its first wait: the staged copy's load
    resumed = asyncio.ensure_future(resume())
    fin = await finish
    await resumed
    return fin["weight_version"], seen


def test_operator_resume_during_a_staged_commit_waits_for_the_new_version(llama, shared):  # noqa: F811
    """Staged (host): generation paused by the operator when the finish comes loads the staged
    copy under that pause; a /resume arriving meanwhile must not let a step run on the new
    weights under the old version (before: it unfroze the engine between the load and the new
    label, and the chaos pass saw outputs whose tokens were not those of the version they
    carried). It is refused (409) and done at the finish's end."""
    path, hf = llama
    with shared(path, staging="host") as srv:
        eng = trainer(srv.url, hf)
        eng.send_weights()
        assert httpx.post(srv.url + "/pause?mode=keep", timeout=30).status_code == 200
        finish = eng.client.finish_weight_update
        eng.client.finish_weight_update = lambda *a, **k: {}  # the data is staged, the finish is the race's
        eng.send_weights()
        eng.client.finish_weight_update = finish
        new, seen = on_loop(srv, lambda: _staged_race(srv))
        assert seen.get("resumed_under", new) == new, f"generation resumed under the old version: {seen}"
        assert seen == {"refused": 409}
        assert not srv.aengine.is_paused()  # the refused resume was done at the finish's end
        r = server_greedy(srv.url).json()
        assert r["weight_version"] == new and r["completion_ids"] == [hf_greedy(hf, p) for p in PROMPT_IDS]
        eng.shutdown()
