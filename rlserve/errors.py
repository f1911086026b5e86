"""Exceptions shared across rlserve. Each maps onto one HTTP status in the server."""


class RLServeError(Exception):
    """Base class of rlserve's own errors."""


class InvalidRequestError(RLServeError, ValueError):
    """Bad user input (prompt, sampling parameters, request body). HTTP 400."""


class UnsupportedArchitectureError(RLServeError, ValueError):
    """The checkpoint's ``architectures`` / ``model_type`` is not implemented."""


class WeightUpdateError(RLServeError):
    """A weight update failed or was refused (bad metadata, transfer failure)."""


class WeightUpdateStateError(WeightUpdateError):
    """A weight-update call arrived out of order (update without start, ...). HTTP 409."""


class NoTransferEngineError(WeightUpdateStateError):
    """An update call reached a server with no transfer engine (never initialised, shut down,
    abandoned by the idle watchdog, or the server restarted). HTTP 409, error code
    ``no_transfer_engine``: the trainer SDK re-initialises on it."""


class StaleSessionError(WeightUpdateStateError):
    """An update call names a transfer group incarnation (``init_info.session``) that a later
    init replaced. HTTP 409, error code ``stale_session``."""


class ModelUnavailableError(RLServeError):
    """The model's weights are inconsistent after a failed in-place update; generation is
    refused until a full update lands. HTTP 503."""
