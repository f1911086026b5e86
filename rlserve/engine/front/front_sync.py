"""Admission state shared by the API processes of ``rlserve serve --api-server-count N``:
:class:`FrontSync` (``AsyncEngine.front_sync``).

API process 0 owns every control state (weights valid / lost and their version, pause, sleep,
weight-sync sessions: its routes run them, the other processes forward their control routes to it,
:mod:`rlserve.server.multi_api`). What the others must know to admit a request is process 0's
answer to "would ``generate`` admit it now": held (a pause, with its mode), refused (503
``model_sleeping`` while asleep, ``weights_lost`` / ``model_unavailable`` while the weights are
not valid) or admitted. Process 0 publishes that state through every engine core
(:meth:`FrontSync.publish`: utility ``front_state``); each core relays it to processes 1..N-1 as
:class:`~rlserve.engine.core_protocol.FrontState`, each applies it on its event loop
(:meth:`FrontSync.apply`) and acks on its own input pipe (:class:`~rlserve.engine.core_protocol.FrontStateAck`);
the core answers process 0 once every process acked. One pipe per process keeps its order, so when
``publish`` returns, every request another process admitted before it applied the state has
reached the core: a pause that then aborts, drains or freezes the cores treats those requests
exactly as process 0's own (as with one API process), and every request admitted after is held or
refused there. Weight updates run with the cores frozen or generation paused, so no process can
get a step of half-updated weights.

Process 0 publishes and waits at every pause (before it acts on the cores) and resume (after), at
an ``abort_all`` (the others abort the requests they hold, as process 0 does), and at a wake that
leaves generation paused; it publishes without waiting (:meth:`FrontSync.notify`)
when the weights change state (lost, valid again): those changes happen under a pause, whose
resume publishes again and waits.

With one API process (``count == 1``) nothing is sent. Known differences from one process: a
request of another process that :meth:`AsyncEngine.fail_all` ends (weights unusable under running
requests) is aborted in the core and ends with ``finish_reason == "abort"``, not the 503 process 0's
own requests get. ``/abort_requests``'s ``aborted`` counts every process's requests: each process
> 0 acks with the number of its own that the state's abort ended (once per abort, ``abort_seq``:
with data parallelism every core relays the state), each core answers their sum.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from rlserve.errors import ModelSleepingError

logger = logging.getLogger(__name__)

#: seconds process 0 waits for every other API process to ack a state (a dead one ends the server
#: anyway: :mod:`rlserve.server.multi_api`); past it the pause or resume fails
#: (:class:`~rlserve.errors.APIServerTimeoutError`, HTTP 504 ``api_server_timeout`` naming the process)
ACK_TIMEOUT_S = 60.0
#: seconds process 0 waits for the cores to say which processes owe an ack, for that error's message
PENDING_QUERY_S = 5.0
#: ``/proc/PID/stat`` states (proc(5)) as the error names them
_STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible sleep", "T": "stopped (SIGSTOP or SIGTSTP)",
           "t": "stopped by a tracer", "Z": "exited (a zombie)"}


class FrontSync:
    """One API process's side of the shared admission state.

    Args:
        aengine: this process's :class:`~rlserve.engine.front.async_engine.AsyncEngine`.
        count: API processes (``--api-server-count``).
        client_index: this process's index (0: the owner, which publishes; else it applies).

    Attributes:
        refusal: in processes > 0, ``() -> exception`` that ``generate`` (and the routes' check
            before a stream) raises instead of admitting while process 0 sleeps, else None. Lost
            weights are set on this process's own ``WeightState`` (its ``reason`` / ``code``: the
            503 of ``generate``, ``/health``, ``server_info``), which nothing else here changes.
    """

    def __init__(self, aengine, count: int = 1, client_index: int = 0):
        self.aengine = aengine
        self.count = count
        self.client_index = client_index
        self.refusal = None
        self.applied = 0  # states applied (processes > 0)
        self.abort_seq = 0  # process 0: aborts published; processes > 0: the highest one applied
        self._abort_lock = threading.Lock()  # (processes > 0: one core-reader thread per replica applies)
        self.peer_pids: dict[int, int] = {}  # process 0: index -> pid of processes 1..N-1 (for error messages)

    # ---- process 0 --------------------------------------------------------------------
    def state(self, abort_held: bool = False, abort_ids: list[str] | None = None, abort_seq: int = 0) -> list:
        """``[paused, pause_mode, refusal, weight_version, abort_held, abort_ids, abort_seq]`` as :meth:`publish`
        sends it (see :class:`~rlserve.engine.core_protocol.FrontState`)."""
        a = self.aengine
        refusal = None
        try:
            if a.sleep_mode is not None:
                a.sleep_mode.check_generate()
            if a.weights.reason is not None:
                refusal = {"type": "unavailable", "message": a.weights.reason, "code": a.weights.code}
        except ModelSleepingError as e:
            refusal = {"type": "sleeping", "message": str(e), "code": "model_sleeping"}
        return [bool(a._paused), a._pause_mode if a._paused else None, refusal, a.weights.version, abort_held, abort_ids,
                abort_seq]

    def _send(self, abort_held: bool = False, abort_ids: list[str] | None = None) -> list:
        seq = 0
        if abort_held or abort_ids:
            self.abort_seq += 1
            seq = self.abort_seq
        state = self.state(abort_held, abort_ids, seq)
        return [r.front_state(*state) for r in self.aengine._replicas if r.alive]

    async def publish(self, abort_held: bool = False, abort_ids: list[str] | None = None,
                      timeout_s: float | None = None) -> int:
        """Send the state to every other API process and wait until each applied it (no-op with
        one process); ``abort_held``: they abort the requests they hold; ``abort_ids``: the requests
        these ids name (:meth:`AsyncEngine.ids_matching`), their final outputs on their way. Returns how many
        requests of the other processes that ended (0 with one process).

        Raises:
            APIServerTimeoutError: a process did not apply it within ``timeout_s`` seconds (None or more than
                :data:`ACK_TIMEOUT_S`: that); the message names it (:meth:`not_applied`). The state still
                reaches it when it runs again (each process applies process 0's states in order).
            EngineDeadError: a core is gone."""
        if self.count == 1 or self.client_index:
            return 0
        from rlserve.engine.front.front_request import wait_all

        bound = ACK_TIMEOUT_S if timeout_s is None else min(float(timeout_s), ACK_TIMEOUT_S)
        sent = self._send(abort_held, abort_ids)
        try:
            results = await asyncio.wait_for(wait_all(sent, raise_first=True), bound)
        except asyncio.TimeoutError:
            from rlserve.errors import APIServerTimeoutError

            raise APIServerTimeoutError(f"{await self.not_applied()} did not apply API server 0's "
                                        f"{self._what(abort_held, abort_ids)} within {bound:g} s") from None
        return sum(x for x in results if isinstance(x, int))

    def _what(self, abort_held: bool, abort_ids) -> str:
        """The state being published, in words (for the timeout's message)."""
        if abort_held or abort_ids:
            return "abort"
        return f"pause (mode={self.aengine._pause_mode})" if self.aengine._paused else "resume"

    async def not_applied(self) -> str:
        """Which processes 1..N-1 owe an ack, as the cores say (``front_pending``), each with its pid and
        its state from ``/proc`` (stopped, sleeping, ...); "another API server" when the cores did not say
        within :data:`PENDING_QUERY_S`."""
        from rlserve.engine.front.front_request import wait_all
        from rlserve.proc_state import stat_fields

        try:
            lists = await asyncio.wait_for(wait_all([r.front_pending() for r in self.aengine._replicas if r.alive],
                                                    raise_first=True), PENDING_QUERY_S)
        except Exception:  # noqa: BLE001 - only the message's detail is lost
            return "another API server (the engine cores did not say which)"
        names = []
        for i in sorted({i for pending in lists if isinstance(pending, list) for i in pending}):
            pid = self.peer_pids.get(i)
            fields = stat_fields(pid) if pid else None
            state = "gone" if pid and fields is None else _STATES.get(fields[0], fields[0]) if fields else None
            names.append(f"API server {i}" + (f" (pid {pid}, {state})" if pid else ""))
        return " and ".join(names) or "another API server (it applied the state meanwhile)"

    def notify(self) -> None:
        """Send the state without waiting for the acks (the weights changed state; a failed pause undone
        after a process did not ack)."""
        if self.count == 1 or self.client_index:
            return
        for fut in self._send():
            fut.add_done_callback(_log_failure)

    # ---- processes 1..N-1 -------------------------------------------------------------
    def apply(self, msg) -> int:
        """Apply process 0's :class:`~rlserve.engine.core_protocol.FrontState` (on the event loop,
        before the ack): hold new requests while paused, release the held ones at its end; refuse
        while it refuses. Returns how many of this process's requests its abort ended (at the first
        relay of its ``abort_seq``; 0 at the others and without an abort)."""
        r = msg.refusal or {}
        a = self.aengine
        sleeping = r.get("type") == "sleeping"
        self.refusal = (lambda m=r.get("message", ""): ModelSleepingError(m)) if sleeping else None
        lost = r.get("type") == "unavailable"
        a.weights.reason = r.get("message", "") if lost else None
        a.weights.code = r.get("code") if lost else None
        if msg.weight_version is not None:
            a.weights.version = msg.weight_version
        aborted = 0
        with self._abort_lock:
            # (each core relays process 0's increasing abort_seq in order: the first relay of each is the
            # first one above the highest applied, whichever core's thread it comes from)
            first = msg.abort_seq > self.abort_seq
            self.abort_seq = max(self.abort_seq, msg.abort_seq)
            if msg.abort_held:
                aborted += a.abort_held()
            if msg.abort_ids:
                ids = a.ids_matching(msg.abort_ids)
                if ids and a.loop is not None:  # (this process's replicas send Abort: no answer awaited)
                    asyncio.run_coroutine_threadsafe(a.abort(ids), a.loop)
                    aborted += len(ids)
        if not first:
            aborted = 0
        if msg.paused:
            a.hold_new(msg.pause_mode)
        elif a._paused:
            n = a.release_held()
            logger.info("generation resumed by API server 0 (%d held request(s) submitted)", n)
        self.applied += 1
        return aborted


def _log_failure(fut) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        logger.warning("publishing the admission state to the other API processes failed: %s", fut.exception())
