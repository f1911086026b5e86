"""What :class:`~rlserve.engine.front.async_engine.AsyncEngine` needs from one engine replica,
wherever it runs: :class:`Replica` (the interface and the request routing both drivers share).

Drivers: :class:`~rlserve.engine.front.thread_replica.ThreadReplica` (the engine on a thread of this
process) and :class:`~rlserve.engine.front.core_client.CoreProcReplica` (the engine in its own
engine-core process). Every method that reaches the engine returns a
``concurrent.futures.Future``; outputs reach the front through :meth:`Replica.route`, called on
the driver's delivering thread, in the order the engine produced them.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

from rlserve.errors import EngineDeadError


def failed_future(exc: BaseException) -> concurrent.futures.Future:
    fut: concurrent.futures.Future = concurrent.futures.Future()
    fut.set_exception(exc)
    return fut


def prefetch_tokenizer(loader) -> None:
    """Start loading the API process's tokenizer on a thread (:meth:`~rlserve.engine.front.replica_setup.TokenizerOnce.prefetch`), so that it
    loads while the engine core starts; nothing for a loader without ``prefetch`` (a test fake's)."""
    prefetch = getattr(loader, "prefetch", None)
    if prefetch is not None:
        prefetch()


class Replica:
    """One engine replica as the async front sees it.

    Attributes:
        index: data-parallel index.
        load: requests submitted here and not finished (guarded by the front's lock).
        alive: the replica runs (False once stopped or dead).
        stats: the engine's latest stats snapshot (numbers only).
    """

    def __init__(self, front, index: int):
        self.front = front
        self.index = index
        self.load = 0
        self.alive = False
        self.stats: dict = {}
        self.reqs: dict[str, Any] = {}  # request id -> the front's _Request, until its final item

    # ---- routing (the driver's delivering thread) ---------------------------------------
    def route(self, outputs=(), errors=()) -> None:
        """Deliver stamped outputs and ``(request_id, exception)`` errors to their requests;
        a finished output or an error is a request's last item."""
        items = []
        for out in outputs:
            req = self.reqs.get(out.request_id)
            if req is None:
                continue
            if out.finished:
                del self.reqs[out.request_id]
                self._done(req)
            items.append((req, out))
        for rid, exc in errors:
            req = self.reqs.pop(rid, None)
            if req is not None:
                self._done(req)
                items.append((req, exc))
        if items:
            self.front._deliver(items)

    def count_tokens(self, generation: int, prompt: int) -> None:
        """Add tokens the engine made (generation) and prompts whose first token came (prompt) to
        the front's ``token_sink`` (the server's ``vllm:generation_tokens_total`` / ``prompt_tokens_total``;
        None: nobody counts). The driver calls it before it routes the outputs that hold them."""
        sink = getattr(self.front, "token_sink", None)
        if sink is not None and (generation or prompt):
            sink(generation, prompt)

    def fail_routed(self, exc: BaseException) -> None:
        """End every request routed here with ``exc`` (the replica stopped or died)."""
        self.route(errors=[(rid, exc) for rid in list(self.reqs)])

    def _done(self, req) -> None:
        req.finished = True
        with self.front._lock:
            self.load -= 1

    def dead_error(self) -> EngineDeadError:
        return EngineDeadError(f"engine replica {self.index} is not running")

    # ---- the driver's part ------------------------------------------------------------
    @property
    def engine(self):
        """The engine (thread driver) or an :class:`EngineView` of it (process driver)."""
        raise NotImplementedError

    def start(self) -> None:
        """Begin building the engine (non-blocking)."""
        raise NotImplementedError

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the engine is built. Raises its build error, or TimeoutError."""
        raise NotImplementedError

    def submit(self, req) -> None:
        """Queue ``req`` (its failure is routed to it)."""
        raise NotImplementedError

    def abort(self, request_ids: list[str]) -> concurrent.futures.Future:
        """Abort; their final outputs are routed before the future resolves."""
        raise NotImplementedError

    def abort_nowait(self, request_ids: list[str]) -> None:
        """Abort without waiting for the answer (a client went away)."""
        self.abort(request_ids)

    def abort_all(self, lift_quarantine: bool = False) -> concurrent.futures.Future:
        """Abort every request here; resolves to how many. ``lift_quarantine``: then let a
        quarantined replica step again (it has no requests left)."""
        raise NotImplementedError

    def set_quarantined(self, quarantined: bool) -> None:
        """``False``: lift a quarantine (``EngineCore.quarantine``); no answer."""
        raise NotImplementedError

    def set_frozen(self, frozen: bool) -> concurrent.futures.Future:
        """Stop (keep-pause) or restart stepping, between two steps; a freeze also refreshes
        :attr:`stats` before the future resolves."""
        raise NotImplementedError

    def wait_drained(self) -> concurrent.futures.Future:
        """Unfreeze; resolves once no request is left."""
        raise NotImplementedError

    def reset_prefix_cache(self) -> concurrent.futures.Future:
        raise NotImplementedError

    def call(self, target: str, *args) -> concurrent.futures.Future:
        """Run ``target(core, *args)`` (``"module:function"``, given the replica's
        :class:`~rlserve.engine.core.engine_core.EngineCore`) between two steps; resolves to its result
        (through the process boundary: MessagePack-able, sets and tuples become lists)."""
        raise NotImplementedError

    def run(self, fn) -> concurrent.futures.Future:
        """Run ``fn(engine)`` between two steps (only where the engine is in this process)."""
        return failed_future(TypeError("run_in_engines(callable) needs the engine in this process "
                                       "(engine_mode='thread'); use call_engines('module:function')"))

    def set_weight_version(self, version: str) -> None:
        """Stamp ``version`` on the outputs of the steps that follow."""
        raise NotImplementedError

    def stop(self) -> None:
        """Begin stopping (non-blocking): requests in flight end with EngineDeadError."""
        raise NotImplementedError

    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the stop, then force it; frees the engine."""
        raise NotImplementedError


class EngineView:
    """Read-only facts of an engine that runs in another process (what routes and the weight
    manager read from ``AsyncEngine.engine``): ``tokenizer`` (loaded in this process),
    ``vocab_size``, ``max_model_len``, ``device``, ``dtype`` (names, e.g. ``"cpu"``,
    ``"bfloat16"``), ``pid`` (the engine-core process)."""

    def __init__(self, info, tokenizer):
        self.info = info
        self.tokenizer = tokenizer
        self.vocab_size = info.vocab_size
        self.max_model_len = info.max_model_len
        self.device = info.device
        self.dtype = info.dtype
        self.pid = info.pid
        self.eos_token_ids = list(info.eos_token_ids)

    def __repr__(self) -> str:
        return f"EngineView(pid={self.pid}, device={self.device!r}, dtype={self.dtype!r})"
