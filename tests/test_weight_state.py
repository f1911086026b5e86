"""The one state machine of the served weights (:mod:`rlserve.engine.front.weight_state`): version
labels unique for the server's lifetime (issue 33 item 4), lost weights served again only once
every required parameter was written since the loss, the checkpoint under its own label."""

from __future__ import annotations

import pytest

from rlserve.engine.front.weight_state import MODEL_UNAVAILABLE, WEIGHTS_LOST, WeightState, WeightVersionInUseError

REQ = {"embed", "q", "k", "v", "head"}


def test_labels_are_unique_and_automatic_ones_move_past_every_number():
    w = WeightState("0")
    with pytest.raises(WeightVersionInUseError, match="'0'"):
        w.check_label("0")  # the checkpoint's label names the checkpoint
    assert w.next_label() == "1"
    assert w.commit(w.next_label(), REQ, REQ) and w.version == "1"
    w.commit("7", REQ, REQ)
    w.commit("3", REQ, REQ)
    assert w.next_label() == "8"  # not "4": past every number seen
    w.commit("step-41", REQ, REQ)
    assert w.next_label() == "step-42"
    w.commit("step-42x", REQ, REQ)
    w.commit("abc", REQ, REQ)
    assert w.next_label() == "abc.1"
    for used in ("0", "1", "7", "3", "step-41", "abc"):
        with pytest.raises(WeightVersionInUseError):
            w.check_label(used)
    w.check_label("9")  # unused: passes
    w.check_label(None)


def test_automatic_label_skips_a_used_one():
    w = WeightState("step-1")
    w.commit("step-3", REQ, REQ)
    w.commit("step-1x", REQ, REQ)
    w.relabel("step-2")
    assert w.next_label() == "step-4"  # step-3 is taken


def test_lost_weights_come_back_only_once_every_required_name_was_written():
    w = WeightState("0")
    w.lose("a failed update", MODEL_UNAVAILABLE)
    assert not w.valid and w.code == MODEL_UNAVAILABLE and w.version == "0"
    assert w.commit("1", {"embed", "q"}, REQ) is False
    assert not w.valid and w.version == "0" and w.written == {"embed", "q"}
    assert w.commit("2", {"k", "v"}, REQ) is False  # a packed qkv target: all three, still no head
    assert w.commit("3", {"head"}, REQ) is True
    assert w.valid and w.version == "3" and w.reason is None and w.code is None and w.written == set()
    with pytest.raises(WeightVersionInUseError):
        w.check_label("3")  # named the weights that serve
    assert w.next_label() == "4"


def test_a_label_that_never_went_live_stays_free():
    """The rule (P33): a label is claimed once it names weights that serve. An incomplete refill
    of lost weights never served: its label may be used again, by hand or automatically, and the
    sync that completes the refill under it serves it. Failed on the code before: the incomplete
    commit claimed "1" (409 on the retry, next automatic label "2")."""
    w = WeightState("0")
    w.lose("level-2 sleep", WEIGHTS_LOST)
    assert w.next_label() == "1"
    assert w.commit("1", {"embed", "q"}, REQ) is False
    w.check_label("1")  # free: nothing served under it
    assert w.next_label() == "1"
    assert w.commit("1", REQ - {"embed", "q"}, REQ) is True
    assert w.valid and w.version == "1"
    with pytest.raises(WeightVersionInUseError, match="'1'"):
        w.check_label("1")
    assert w.next_label() == "2"


def test_a_new_loss_forgets_earlier_writes():
    w = WeightState("0")
    w.lose("sleep", WEIGHTS_LOST, reload_ok=True)
    w.commit("1", REQ - {"head"}, REQ)
    assert not w.reload_ok  # something was written: the checkpoint is no longer reloaded
    w.lose("a failed update", MODEL_UNAVAILABLE)
    assert w.commit("2", {"head"}, REQ) is False and w.code == MODEL_UNAVAILABLE


def test_checkpoint_reload_serves_the_checkpoint_label():
    w = WeightState("ckpt-0")
    w.commit("ckpt-1", REQ, REQ)
    w.lose("level-2 sleep", WEIGHTS_LOST, reload_ok=True)
    assert w.reload_ok and w.info() == {"valid": False, "weight_version": "ckpt-1", "reason": "level-2 sleep",
                                        "code": WEIGHTS_LOST, "written": 0, "checkpoint_version": "ckpt-0"}
    w.checkpoint_reloaded()
    assert w.valid and w.version == "ckpt-0" and not w.reload_ok
    assert w.next_label() == "ckpt-2"
