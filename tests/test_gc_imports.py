"""The garbage collector off during start-up imports (:func:`rlserve.gc_heap.no_collections_while_importing`):
stretches on several threads at once, collections back on after the last, as they were before."""

from __future__ import annotations

import gc
import threading

from rlserve.gc_heap import no_collections_while_importing


def test_overlapping_stretches_turn_collections_back_on_after_the_last():
    """Thread A's stretch starts, B's starts, A's ends (B still importing: still off), B's ends (on again)."""
    assert gc.isenabled()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with no_collections_while_importing():
            a_in.set()
            b_in.wait(10)
        seen["after a"] = gc.isenabled()
        a_out.set()

    def b():
        a_in.wait(10)
        with no_collections_while_importing():
            b_in.set()
            a_out.wait(10)
            seen["inside b after a"] = gc.isenabled()
        seen["after b"] = gc.isenabled()

    threads = [threading.Thread(target=f) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == {"after a": False, "inside b after a": False, "after b": True}
    assert gc.isenabled()


def test_collections_stay_off_when_they_were_off_and_on_after_an_error():
    gc.disable()
    try:
        with no_collections_while_importing():
            assert not gc.isenabled()
        assert not gc.isenabled()  # off before: left off
    finally:
        gc.enable()
    try:
        with no_collections_while_importing():
            raise ImportError("no such module")
    except ImportError:
        pass
    assert gc.isenabled()


def test_serve_start_up_work_runs_with_collections_off():
    """``rlserve serve``'s start-up work, now (CPU) or on a thread beside the engine's start (GPU): inside it
    collections are off, after it on again; its value and its error come through the future."""
    import rlserve.cli.serve as serve

    for run in (serve._now, serve._beside):
        assert run(gc.isenabled).result(timeout=10) is False
        assert gc.isenabled()
        fut = run(lambda: 1 / 0)
        try:
            fut.result(timeout=10)
        except ZeroDivisionError:
            pass
        else:
            raise AssertionError("the error did not come through")
        assert gc.isenabled()
