"""Are the served weights valid, and which version are they: :class:`WeightState`, the one
state machine that weight syncs, sleep mode and engine-core restarts share (the API process
holds it: ``AsyncEngine.weights``).

States::

    valid(version) --lose(reason)--> lost(reason, written={}) --commit(names)--> lost(written+names)
         ^                                  |   (written covers every required name)   |
         +------ commit completes / checkpoint_reloaded() -----------------------------+

* **valid**: generation serves the weights labelled :attr:`WeightState.version`.
* **lost**: generation answers 503 (code :attr:`WeightState.code`: ``weights_lost`` after a
  level-2 sleep or an engine-core restart, ``model_unavailable`` after a failed in-place
  update) until every required parameter (``required_checkpoint_names()``: per checkpoint
  name, so a packed q/k/v target counts once all three arrived; tied aliases are refused by the
  sync's validation) was written by syncs committed since the loss, or the checkpoint was
  reloaded (only while :attr:`WeightState.reload_ok`: nothing was written since a loss that
  allows it). The sync that completes the coverage is the version served; the labels of the
  incomplete ones before it never named served weights and stay free.

Version labels are unique for the server's lifetime: a label is claimed once it names weights
that serve (a commit that leaves them valid, :meth:`WeightState.relabel`, the checkpoint's
label); :meth:`WeightState.check_label` refuses a claimed label (409 ``weight_version_in_use``)
and :meth:`WeightState.next_label` moves automatic versions past every numeric label claimed. A
label that never went live (a failed, aborted or refused update; an incomplete refill of lost
weights) is not claimed: a retry may use it again. The checkpoint's label (``--weight-version``
of the start, default ``"0"``) names the checkpoint's weights, whenever they are reloaded.
"""

from __future__ import annotations

import logging
import re

from rlserve.errors import WeightUpdateStateError

logger = logging.getLogger(__name__)

#: 503 codes of lost weights: ``weights_lost`` (a level-2 sleep's refill, an engine-core restart:
#: the weights are gone) and ``model_unavailable`` (a failed in-place update: part old, part new)
WEIGHTS_LOST = "weights_lost"
MODEL_UNAVAILABLE = "model_unavailable"


class WeightVersionInUseError(WeightUpdateStateError):
    """A weight update asked for a ``weight_version`` label that already named other weights in
    this server's lifetime. HTTP 409, code ``weight_version_in_use``; nothing changed."""

    code = "weight_version_in_use"


def next_version(current: str) -> str:
    """``"7"`` → ``"8"``; ``"step-41"`` → ``"step-42"``; ``"abc"`` → ``"abc.1"``."""
    m = re.match(r"^(.*?)(\d+)$", str(current))
    if m:
        return f"{m.group(1)}{int(m.group(2)) + 1}"
    return f"{current}.1"


class WeightState:
    """The served weights' validity and version label (see the module docstring).

    Args:
        checkpoint_version: the label of the weights loaded at start (``str``).

    Attributes:
        version: the label stamped on outputs while valid (the last committed one).
        reason / code: why generation answers 503, and its error code; None while valid.
        written: checkpoint names written by syncs committed since the loss (empty while valid).
        reload_ok: the loss allows reloading the checkpoint and nothing was written since.
        sets: committed label changes (syncs, checkpoint reloads), for observers.
    """

    def __init__(self, checkpoint_version: str = "0"):
        self.checkpoint_version = str(checkpoint_version)
        self.version = self.checkpoint_version
        self.reason: str | None = None
        self.code: str | None = None
        self.written: set[str] = set()
        self.reload_ok = False
        self.sets = 0
        self._labels: set[str] = set()
        self._max_number = -1
        self._claim(self.checkpoint_version)

    # ---- queries ---------------------------------------------------------------------
    @property
    def valid(self) -> bool:
        return self.reason is None

    def info(self) -> dict:
        """JSON-ready: ``valid``, ``weight_version``, ``reason``, ``code``, ``written`` (names
        written since the loss), ``checkpoint_version``."""
        return {"valid": self.valid, "weight_version": self.version, "reason": self.reason, "code": self.code,
                "written": len(self.written), "checkpoint_version": self.checkpoint_version}

    # ---- labels ----------------------------------------------------------------------
    def _claim(self, label: str) -> None:
        self._labels.add(label)
        if label.isdigit():
            self._max_number = max(self._max_number, int(label))

    def check_label(self, label: str | None) -> None:
        """Raises WeightVersionInUseError (409) when ``label`` already named weights. None passes."""
        if label is not None and label in self._labels:
            raise WeightVersionInUseError(f"weight_version {label!r} is already in use: it named other weights in this "
                                          "server's lifetime (labels are unique; send a new one, or none for the next "
                                          "automatic version)")

    def next_label(self) -> str:
        """The next automatic label: :func:`next_version` of :attr:`version`, moved past every
        numeric label seen when it is a number, then past every label used."""
        label = next_version(self.version)
        if label.isdigit():
            label = str(max(int(label), self._max_number + 1))
        while label in self._labels:
            label = next_version(label)
        return label

    # ---- transitions -------------------------------------------------------------------
    def lose(self, reason: str, code: str = WEIGHTS_LOST, reload_ok: bool = False) -> None:
        """The served weights are no longer valid: 503 ``code`` with ``reason`` until a complete
        refill. ``reload_ok``: reloading the checkpoint would make them valid again (a level-2
        sleep's discarded weights); writes since the previous loss no longer count."""
        self.reason, self.code = str(reason), code
        self.written = set()
        self.reload_ok = reload_ok

    def commit(self, version: str, names, required) -> bool:
        """A sync wrote ``names`` (checkpoint names) and committed under ``version``.
        Valid weights take the label at once (claimed); lost ones once every ``required`` name
        was written since the loss (an incomplete refill claims nothing: its label never named
        served weights). Returns whether the weights are valid now."""
        version = str(version)
        self.reload_ok = False
        if self.reason is not None:
            self.written |= set(names)
            if not set(required) <= self.written:
                return False
            self.reason = self.code = None
            self.written = set()
        self._claim(version)
        self.version = version
        self.sets += 1
        return True

    def relabel(self, version: str) -> None:
        """Claim ``version`` and stamp it from now on, validity unchanged (nothing was written)."""
        self._claim(str(version))
        self.version = str(version)
        self.sets += 1

    def checkpoint_reloaded(self) -> None:
        """The checkpoint was loaded again: valid, under the checkpoint's own label."""
        self.reason = self.code = None
        self.written = set()
        self.reload_ok = False
        self.version = self.checkpoint_version
        self.sets += 1

    def restore(self) -> None:
        """Valid again with the current label (an operator's or a test's override)."""
        self.reason = self.code = None
        self.written = set()
        self.reload_ok = False


class WeightsControl:
    """:class:`~rlserve.engine.front.async_engine.AsyncEngine`'s side of :class:`WeightState` (mixed
    in; uses its ``weights`` and ``_replicas``): stamping the label on the replicas, the 503 of
    lost weights, quarantine."""

    @property
    def weight_version(self) -> str:
        """The version stamped on new outputs (str): :attr:`weights`' label."""
        return self.weights.version

    def _stamp(self) -> None:
        """Every replica stamps :attr:`weights`' label on the outputs of the steps that follow."""
        for r in self._replicas:
            r.set_weight_version(self.weights.version)
        self.front_sync.notify()  # valid again, maybe (the other API processes' refusal)

    def commit_weights(self, version: str, names, required) -> bool:
        """A weight sync committed ``version`` after writing ``names`` (checkpoint names; the
        model's ``required`` names decide whether lost weights are complete again): see
        :meth:`WeightState.commit`. Lost weights that became complete are served again. Returns
        whether the weights are valid now."""
        was_valid = self.weights.valid
        valid = self.weights.commit(version, names, required)
        # valid or not, every replica stamps the front's label from here on: a commit made inside
        # an engine command (``engine_calls.worker_rpc``) already stamped its new label in that
        # engine, which an incomplete refill of lost weights (a label that never went live) must
        # not keep for when the weights are valid again
        self._stamp()
        if valid:
            if not was_valid:
                self._lift_quarantine()
                logger.info("weights complete again (version %s): generation available", version)
        return valid

    def set_weight_version(self, version: str) -> None:
        """Stamp ``version`` on every output of the steps that follow (weights stay as they are:
        a commit of valid weights that wrote nothing, e.g. a test's relabel)."""
        self.weights.relabel(str(version))
        self._stamp()

    def checkpoint_reloaded(self) -> None:
        """The replicas reloaded the checkpoint: served under the checkpoint's label."""
        self.weights.checkpoint_reloaded()
        self._stamp()
        self._lift_quarantine()

    def lose_weights(self, reason: str, code: str = WEIGHTS_LOST, reload_ok: bool = False) -> None:
        """From now on :meth:`generate` answers 503 ``code`` with ``reason`` until the weights are
        complete again (:class:`WeightState`). Requests in flight are not touched (see
        :meth:`fail_all`)."""
        self.weights.lose(reason, code, reload_ok)
        self.front_sync.notify()

    def set_unavailable(self, reason: str | None) -> None:
        """While ``reason`` is set, :meth:`generate` raises ModelUnavailableError (503,
        ``model_unavailable``) until a complete update (:meth:`lose_weights`). ``None``: valid
        again with the current label, and any quarantine (:meth:`quarantine`) lifted."""
        if reason is not None:
            self.weights.lose(reason, MODEL_UNAVAILABLE)
            self.front_sync.notify()
            return
        self.weights.restore()
        self._stamp()  # the label every replica stamps is the front's (an engine may hold another)
        self._lift_quarantine()

    def _lift_quarantine(self) -> None:
        for r in self._replicas:
            r.set_quarantined(False)

    def quarantine(self, engine, reason: str) -> None:
        """Thread mode, on a replica's thread inside a :meth:`run_in_engines` command whose work
        left that replica's weights unusable: from now on :meth:`generate` answers 503 with
        ``reason`` and the replica steps nothing until :meth:`fail_all` ended its requests.
        (Engine-side code that runs in both modes calls ``core.quarantine(reason)`` instead, as
        ``rlserve.transfer.server.engine_calls`` does, and its caller sets the 503.) Unknown ``engine``:
        only the 503."""
        self.weights.lose(reason, MODEL_UNAVAILABLE)
        self.front_sync.notify()
        for r in self._replicas:
            core = getattr(r, "core", None)
            if core is not None and core.engine is engine:
                core.quarantine(reason)

    @property
    def unavailable_reason(self) -> str | None:
        """Why generation answers 503 with the weights (None while they are valid)."""
        return self.weights.reason

    @property
    def unavailable_code(self) -> str | None:
        """The error code of that 503: ``weights_lost`` or ``model_unavailable``."""
        return self.weights.code

