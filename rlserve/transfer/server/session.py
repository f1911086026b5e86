"""One weight-update session's record (:class:`_Session`) and the weight-version rules
(what a trainer may ask for; the server's labels: :mod:`rlserve.engine.front.weight_state`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rlserve.engine.front.weight_state import next_version  # noqa: F401 - re-exported
from rlserve.errors import WeightUpdateError
from rlserve.transfer.wire.protocol import UpdateInfo

#: Longest weight version accepted (characters): it is stamped on every response.
MAX_VERSION_CHARS = 256


def check_weight_version(version) -> str | None:
    """A requested weight version as the string the server will stamp, or ``None`` (the server
    increments its own).

    Raises:
        WeightUpdateError: (HTTP 400) not a string or an integer (``true`` is refused, not
            read as 1), empty, longer than :data:`MAX_VERSION_CHARS`, or with control characters.
    """
    if version is None:
        return None
    if isinstance(version, bool) or not isinstance(version, (str, int)):
        raise WeightUpdateError(f"weight_version must be a string, an integer or null, got {version!r}")
    v = str(version)
    control = any(ord(c) < 32 or ord(c) == 127 for c in v)
    if not v or len(v) > MAX_VERSION_CHARS or control:
        raise WeightUpdateError(f"weight_version must be 1 to {MAX_VERSION_CHARS} printable characters "
                                f"(got {len(v)} characters{', with control characters' if control else ''})")
    return v


@dataclass
class _Session:
    declared: UpdateInfo | None
    auto_paused: bool
    started: float = field(default_factory=time.monotonic)
    last_activity: float = field(default_factory=time.monotonic)
    received: set = field(default_factory=set)
    applied: bool = False  # in place: the live parameters may have changed in this session
    # in place: a receive was started whose end (and so whether it wrote into the parameters) has
    # not been seen on every worker; a failure then counts as a changed model (see _poll_results)
    in_doubt: bool = False
    trl: bool = False  # a TRL batch: update_named_param ... reset_prefix_cache (see trl_update_named_param)
    # a TRL batch's tensor held NaN / inf: the batch keeps receiving (its trainer broadcasts the
    # next tensors without waiting) and is refused at its flush with this error
    refused: BaseException | None = None
    bytes: int = 0
    seconds: float = 0.0
    calls: int = 0
    # buckets (per tensor: tensors) of the running or last ``update_weights`` call that every
    # worker has loaded in place or staged, as last polled (the minimum over the workers);
    # ``/weight_info``'s ``session.buckets_done``: how far a receive got
    buckets_done: int = 0
    ipc_refs: set = field(default_factory=set)  # ipc_handles_ref names used in this session
    # one-call ipc update in place on one replica (see WeightTransferManager._commits_in_engine):
    # the receive, the prefix-cache reset and the new version are one engine-thread command
    commit_in_engine: bool = False
    # a staged update loading its staged copy under a pause (not one engine command): generation
    # must stay frozen until the new version is stamped, as during an in-place update
    committing: bool = False
    commit_version: str | None = None  # the version asked for (None: the current one + 1)
    committed_version: str | None = None  # set by that command once it committed
    # an adapter-only update (rlserve.lora.sync): its checked update_info.lora; staged whatever
    # --weight-staging says, committed as a new adapter version
    lora: dict | None = None
