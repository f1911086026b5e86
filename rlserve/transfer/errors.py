"""Errors of the weight-sync layer.

All derive from :class:`rlserve.errors.WeightUpdateError`, so code that catches that class
catches everything here. The HTTP layer (``rlserve/server/weight_routes.py``) maps them:

==============================  =====  ==========================================
class                           HTTP   meaning
==============================  =====  ==========================================
``WeightUpdateStateError``      409    call out of order (update without start, ...)
``WeightUpdateError``           400    refused: bad ``init_info`` / ``update_info``
``WeightTransferFailedError``   500    the data plane failed mid-update (peer died,
                                       checksum mismatch, broken group)
``TransferTimeoutError``        504    a rendezvous / collective / RPC ran past its
                                       timeout
``TrainerUnreachableError``     502    the trainer's store at ``master_address:port``
                                       closed, reset or answered no TCPStore
                                       handshake within ``timeout_s`` (code
                                       ``weight_transfer_unreachable``, type
                                       ``bad_gateway_error``)
``NonFiniteWeightsError``       400    a synced tensor holds NaN / inf (code
                                       ``non_finite_weights``)
``DeviceOutOfMemoryError``      507    the server's device had no room for the update
                                       (code ``weight_update_out_of_memory``)
``ModelUnavailableError``       503    (rlserve.errors) generation refused after a
                                       failed in-place update
==============================  =====  ==========================================
"""

from __future__ import annotations

from rlserve.errors import WeightUpdateError, WeightUpdateStateError  # noqa: F401  (re-export)


class WeightTransferFailedError(WeightUpdateError):
    """The transfer itself failed (peer closed the connection, checksum mismatch, a worker
    raised while loading). The transfer group has been torn down; re-initialise it."""


class ChecksumMismatchError(WeightTransferFailedError):
    """A received bucket's checksum differs from the one the trainer announced."""


class TransferTimeoutError(WeightTransferFailedError, TimeoutError):
    """A rendezvous, collective or RPC did not finish within ``timeout_s``."""


class TrainerUnreachableError(WeightTransferFailedError):
    """``/init_weight_transfer_engine``: a server worker could not connect to the trainer's TCPStore at
    ``init_info.master_address:master_port`` -- the connection was closed or reset, or what answers
    there is not a TCPStore (an HTTP server, say; a listener that sends no handshake answer within ``timeout_s``:
    :mod:`rlserve.transfer.wire.store_probe`) -- before ``timeout_s`` (past it:
    :class:`TransferTimeoutError`, 504). HTTP 502 (a peer the server relies on failed, as a gateway's
    upstream), code ``weight_transfer_unreachable``; the group is torn down and a new init to a live
    trainer works. (vLLM 0.32 answers any failed init with a 500.)"""


class TransferAbortedError(WeightTransferFailedError):
    """The local side aborted the transfer (shutdown, the peer's HTTP call failed)."""


class TrainerGoneError(TransferAbortedError):
    """The trainer's process died (its TCPStore connection closed or stopped answering, see
    :mod:`rlserve.transfer.server.liveness`): the open update failed the way a broken transfer fails."""


class NonFiniteWeightsError(WeightTransferFailedError):
    """A synced tensor holds a NaN or an infinity (:mod:`rlserve.transfer.finite`): the update is
    refused before it is committed (HTTP 400, code ``non_finite_weights``; staged, the old
    weights keep serving; in place, once anything was written, generation answers 503 until a
    complete good update lands)."""

    code = "non_finite_weights"


class DeviceOutOfMemoryError(WeightTransferFailedError):
    """The server's device had no room for a weight update (HTTP 507, code
    ``weight_update_out_of_memory``): refused before a byte moved when the worker's room check
    saw that the staging copy would not fit (``--weight-staging device``, adapter-only syncs:
    :func:`rlserve.transfer.server.worker_load.check_staging_room`), else an allocation that
    failed mid-update (``torch.OutOfMemoryError`` on a worker). Like every failed transfer the
    group is torn down; staged, the served weights are unchanged; in place, once anything was
    written, generation answers 503 until a complete update lands."""

    code = "weight_update_out_of_memory"
