"""The weight-sync manager's side of generation control (a mixin of
:class:`~rlserve.transfer.server.manager.WeightTransferManager`): which operator ``/pause`` and
``/resume`` calls an open update refuses, and which resumes it leaves to its own end. Both are
asked under ``AsyncEngine``'s pause lock (``pause(check=)``, ``resume(check=)``,
``resume_deferral``), where an update also opens its session (``pause_unless_paused``), so no
resume slips between an update's pause and its session (session 19's adversarial pass)."""

from __future__ import annotations

from rlserve.errors import WeightUpdateStateError


class GenerationControl:
    """Uses the manager's ``_session`` and ``_staging_of``."""

    def operator_generation_control(self, action: str) -> None:
        """Check an operator's ``POST /resume`` (``action="resume"``) or ``POST /pause?mode=M``
        (``"pause:M"``) against an open in-place update, whose tensors land in the running model.

        Generation must not run until that update finished: ``/resume`` and ``/pause?mode=wait``
        (which drains the frozen requests by stepping them) are refused. ``abort`` and ``keep``
        pauses are taken, and an explicit pause then outlives the update (its end no longer
        resumes; the operator resumes). A staged update is checked the same way only while its
        finish loads the staged copy under a pause (several replicas, or generation paused already).

        Raises:
            WeightUpdateStateError: (HTTP 409) the action is refused.
        """
        s = self._session
        if s is None or not self._holds_generation(s):
            return
        if action in ("resume", "pause:wait"):
            what = "/resume" if action == "resume" else "/pause?mode=wait (it drains requests by running them)"
            if action == "resume":
                s.auto_paused = True  # the operator wants generation back: the update's end resumes it
            where = "in place (committing staged weights)" if s.committing else "in place"
            raise WeightUpdateStateError(
                f"{what} refused: a weight update is in progress {where}, and generation would run on partly "
                "loaded weights; it resumes when the update finishes or fails "
                "(/finish_weight_update, /shutdown_weight_transfer_engine)")
        s.auto_paused = False

    def defer_resume(self) -> bool:
        """``AsyncEngine.resume_deferral`` (asked under the pause lock): True while an open
        in-place update needs generation frozen; its end then resumes (``auto_paused``). A
        resume that comes from sleep mode's wake lands here; an operator's ``/resume`` is
        refused first (:meth:`operator_generation_control`)."""
        s = self._session
        if s is None or not self._holds_generation(s):
            return False
        s.auto_paused = True
        return True

    def _holds_generation(self, s) -> bool:
        """Whether session ``s`` needs generation frozen now: an in-place update (not the one-call
        engine command), or a staged one loading its staged copy under a pause."""
        return (self._staging_of(s) == "none" and not s.commit_in_engine) or s.committing
