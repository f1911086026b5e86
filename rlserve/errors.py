"""Exceptions shared across rlserve. Each maps onto one HTTP status in the server."""


class RLServeError(Exception):
    """Base class of rlserve's own errors."""


class InvalidRequestError(RLServeError, ValueError):
    """Bad user input (prompt, sampling parameters, request body). HTTP 400."""


class UnsupportedArchitectureError(RLServeError, ValueError):
    """The checkpoint's ``architectures`` / ``model_type`` is not implemented."""


class WeightUpdateError(RLServeError):
    """A weight update failed or was refused (bad metadata, transfer failure).

    ``param``: the request field at fault, as the route's body names it (``init_info.master_port``), or None; the
    HTTP answer's ``param`` (``rlserve/server/weight_routes.py``)."""

    def __init__(self, *args, param: str | None = None):
        super().__init__(*args)
        self.param = param


class WeightUpdateStateError(WeightUpdateError):
    """A weight-update call arrived out of order (update without start, ...). HTTP 409."""


class NoTransferEngineError(WeightUpdateStateError):
    """An update call reached a server with no transfer engine (never initialised, shut down,
    abandoned by the idle watchdog, or the server restarted). HTTP 409, error code
    ``no_transfer_engine``: the trainer SDK re-initialises on it."""


class StaleSessionError(WeightUpdateStateError):
    """An update call names a transfer group incarnation (``init_info.session``) that a later
    init replaced. HTTP 409, error code ``stale_session``."""


class EngineStepError(RLServeError):
    """An engine step (or adding a request) raised unexpectedly. The requests that were in
    that replica fail with this error (HTTP 500); the replica keeps serving."""


class EngineDeadError(RLServeError):
    """The engine replica is stopped (shutdown, a fatal error, or its process died). HTTP 503."""


class APIServerTimeoutError(RLServeError, TimeoutError):
    """``--api-server-count N``: another API process did not apply API process 0's admission state (a
    pause, resume or abort) within its bound (a process hung or stopped): the action did not take effect
    there. The message names the process (index, pid, its state). HTTP 504, code ``api_server_timeout``."""


class ModelUnavailableError(RLServeError):
    """The served weights are not valid (a failed in-place update left them part old, part new:
    code ``model_unavailable``; a level-2 sleep's refill is incomplete or an engine-core restart
    lost them: ``weights_lost``); generation is refused until a complete update lands. HTTP 503
    with ``code``."""

    def __init__(self, message: str = "", code: str = "model_unavailable"):
        super().__init__(message)
        self.code = code


class ModelSleepingError(ModelUnavailableError):
    """Generation was asked of a sleeping engine (sleep mode: ``/sleep`` freed its memory until
    ``/wake_up``). HTTP 503, error code ``model_sleeping``."""


class SleepStateError(RLServeError):
    """A sleep-mode call out of order: wake_up while awake, sleep while asleep or during a
    weight update, a weight sync into weights offloaded by a level-1 sleep. Nothing changed.
    HTTP 409; ``code`` names the conflict (``not_sleeping``, ``already_sleeping``,
    ``weight_update_in_progress``, ``weights_offloaded``, ``requests_in_flight``)."""

    def __init__(self, message: str, code: str = "sleep_state_conflict"):
        super().__init__(message)
        self.code = code


class SleepMemoryError(RLServeError):
    """wake_up could not get its GPU memory back (another process holds it); the engine stays
    asleep and a later wake_up may succeed. HTTP 503, error code ``wake_up_out_of_memory``."""


class MissingExtraError(RLServeError, ImportError):
    """A setting needs a package of one of rlserve's optional extras that is not installed; the
    message names the setting and the ``pip install`` that brings it."""


class LoRAAdapterError(InvalidRequestError):
    """A LoRA adapter that cannot be served (unsupported config, wrong shapes, a rank above
    ``--max-lora-rank``, too many adapters loaded) or a LoRA route called out of order. HTTP 400."""


class LoRAAdapterNotFoundError(LoRAAdapterError):
    """No adapter at the given path, or no adapter of that name is loaded. HTTP 404 (vLLM's
    ``LoRAAdapterNotFoundError`` / unload of an unknown name)."""
