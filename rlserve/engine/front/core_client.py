"""An engine replica in its own engine-core process (the default): :class:`CoreProcReplica`.

The API process binds two ZMQ sockets per replica on local ``ipc://`` paths -- input (``PUSH``,
API → core) and output (``PULL``, core → API) -- and starts ``python -m
rlserve.engine.core.core_proc`` in a session of its own (a Ctrl-C to the server's process group
reaches only the API process, which stops its cores; killing the core's group also takes its
TP workers; :mod:`rlserve.engine.front.core_spawn` starts it, or hands a prestarted one its
arguments, and makes the sockets' directory). The engine's step loop, scheduler, KV cache and
model runner live there, off this process's GIL. Messages: :mod:`rlserve.engine.core_protocol`.

A reader thread here receives each step's token deltas as one message, decodes it, turns the
deltas into cumulative outputs with text (:class:`~rlserve.engine.front.output_processor.OutputProcessor`:
detokenization and stop strings run here, not in the engine's step) and hands them to their
requests' event loops (one ``call_soon_threadsafe`` per loop and step); samples that a stop
string ended here are stopped in the core with one message per request. It
also watches the process itself (a Linux pidfd, else a 100 ms poll): the moment the core dies,
its requests in flight end with :class:`~rlserve.errors.EngineDeadError` (HTTP 503), its
pending calls fail the same way, and the replica reads as not alive (``/health`` 503).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import contextlib
import logging
import os
import subprocess
import threading
import time

import zmq

from rlserve.engine import core_protocol as proto
from rlserve.engine.front import core_spawn
from rlserve.engine.front.core_stop import CoreProcStop
from rlserve.engine.front.output_processor import OutputProcessor
from rlserve.engine.front.replica import EngineView, Replica, failed_future, prefetch_tokenizer
from rlserve.errors import EngineDeadError, InvalidRequestError
from rlserve.proc_state import child_ended, exit_text
from rlserve.startup_log import log_phase

logger = logging.getLogger(__name__)

#: while a :meth:`CoreProcReplica._handle_pending` callback is on its way to an event loop, the reader
#: thread wakes at least this often (seconds), frames or not, to see whether that loop stopped before
#: running it (a loop that stops for good, as the server's does at shutdown, and closes drops its
#: queued callbacks): the frames are then handled on the reader thread (:meth:`CoreProcReplica._reclaim`).
#: Only a wake-up with nothing to do (a non-blocking receive and a check) while the loop is merely busy.
_RECLAIM_S = 0.1


class CoreProcReplica(CoreProcStop, Replica):
    """One engine replica in an engine-core process.

    Args:
        front: the AsyncEngine.
        index: replica index.
        config: this replica's :class:`~rlserve.config.EngineConfig`.
        weight_version: initial version stamped on outputs.
        tokenizer_loader: ``() -> tokenizer`` shared by the replicas (loaded once, in this
            process, for the routes).
        api_server_count: API processes the core serves (``--api-server-count``): it also
            connects to processes 1..N-1's sockets in this one's socket directory
            (:func:`~rlserve.engine.front.core_spawn.client_addresses`).
        core_dir / client_index: an API process > 0 (:class:`~rlserve.engine.front.core_attach.AttachedCoreReplica`)
            binds its sockets in process 0's ``core_dir`` under its ``client_index``.
    """

    def __init__(self, front, index: int, config, weight_version: str, tokenizer_loader=None,
                 api_server_count: int = 1, core_dir: str | None = None, client_index: int = 0):
        super().__init__(front, index)
        self.config = config
        self._version = weight_version
        self._tokenizer_loader = tokenizer_loader
        self.api_server_count = api_server_count
        self.client_index = client_index
        self._dir = core_dir or core_spawn.socket_dir()
        in_addr, out_addr = core_spawn.client_addresses(self._dir, client_index)
        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.setsockopt(zmq.SNDHWM, 0)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.bind(in_addr)
        self._out = self._ctx.socket(zmq.PULL)
        self._out.setsockopt(zmq.RCVHWM, 0)
        self._out.bind(out_addr)
        self._enc = proto.input_encoder()
        self._dec = proto.output_decoder()
        self._send_lock = threading.Lock()
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count(1)
        self._closing = False
        self._stop_t: float | None = None  # time.monotonic() of stop()
        self.proc: subprocess.Popen | None = None
        self._pidfd: int | None = None
        self._view: EngineView | None = None
        self._outputs: OutputProcessor | None = None  # built with the view (needs the tokenizer)
        self._reader: threading.Thread | None = None
        # frames the reader received and nobody handled yet (see _drain)
        self._pending: collections.deque = collections.deque()
        self._scheduled_on = None  # the event loop a _handle_pending callback is on its way to
        self._handle_lock = threading.Lock()
        self.death: str | None = None  # why the core is gone, once it is
        self.exit_cause: str | None = None  # the same without what it means for serving (a restart's message)
        #: set when the core has said it is exiting (left its loop after Shutdown; only the
        #: process's end remains)
        self.exiting = threading.Event()

    @property
    def engine(self) -> EngineView | None:
        return self._view

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def socket_dir(self) -> str:
        """The directory of the core's ``ipc://`` sockets (API processes > 0 bind theirs there)."""
        return self._dir

    # ---- start ----------------------------------------------------------------------------
    def start(self) -> None:
        cmd = core_spawn.core_command(self._dir, self.index, self._version, self.config, self.api_server_count)
        self.proc = (core_spawn.take_prestarted(self.index, cmd)
                     or core_spawn.spawn(cmd, start_new_session=True, stdin=subprocess.DEVNULL))
        prefetch_tokenizer(self._tokenizer_loader)  # the tokenizer loads here while the core starts
        try:
            self._pidfd = os.pidfd_open(self.proc.pid)
        except (AttributeError, OSError):  # not Linux >= 5.3: poll the process instead
            self._pidfd = None

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self._out.poll(100):
                msg = self._dec.decode(self._out.recv())
                if isinstance(msg, proto.CoreReady):
                    break
                if isinstance(msg, proto.CoreFailed):
                    self._reap()
                    raise proto.rebuild_error(msg.error)
                continue
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine-core process of replica {self.index} {exit_text(self.proc.returncode)} "
                                   "before it was ready (its log is above)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine replica {self.index} did not start in {timeout_s}s")
        t = time.perf_counter()
        tok = self._tokenizer_loader() if self._tokenizer_loader is not None else None
        log_phase(logger, f"engine replica {self.index}: its ready message -> the API process's tokenizer",
                  time.perf_counter() - t)
        self._view = EngineView(msg.info, tok)
        self._outputs = OutputProcessor(tok, self.count_tokens)
        self.alive = True
        self._reader = threading.Thread(target=self._read, name=f"rlserve-core-reader-{self.index}", daemon=True)
        self._reader.start()
        logger.info("engine replica %d ready in process %d (%s, %s)", self.index, msg.info.pid, msg.info.device,
                    msg.info.dtype)

    # ---- sending --------------------------------------------------------------------------
    def _send(self, msg) -> None:
        data = self._enc.encode(msg)
        with self._send_lock:
            if not self.alive:
                raise self._dead()
            self._in.send(data, copy=False)

    def _call(self, method: str, *args) -> concurrent.futures.Future:
        if not self.alive:
            return failed_future(self._dead())
        call_id = next(self._call_ids)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._calls[call_id] = fut
        try:
            self._send(proto.UtilityCall(call_id, method, list(args)))
        except BaseException as e:  # noqa: BLE001
            self._calls.pop(call_id, None)
            if not fut.done():
                fut.set_exception(e)
        if not self.alive:  # died between the check and the registration: the reader may have missed it
            self._fail_calls()
        return fut

    def submit(self, req) -> None:
        self.reqs[req.request_id] = req
        try:
            self._send(proto.AddRequest(req.request_id, req.prompt, req.params, req.stream, req.arrival_time,
                                        self.client_index))
        except (UnicodeEncodeError, OverflowError, TypeError) as e:  # what MessagePack cannot carry
            self.reqs.pop(req.request_id, None)
            raise InvalidRequestError(f"request {req.request_id} cannot be sent to the engine core: {e} (build its "
                                      "parameters with core_protocol.params_from_fields to have the field named)") \
                from None
        except BaseException:
            self.reqs.pop(req.request_id, None)
            raise

    def abort(self, request_ids) -> concurrent.futures.Future:
        return self._call("abort", list(request_ids))

    def abort_nowait(self, request_ids) -> None:
        """Abort without an answer (a client went away)."""
        try:
            self._send(proto.Abort(list(request_ids)))
        except EngineDeadError:
            pass

    def abort_all(self, lift_quarantine: bool = False) -> concurrent.futures.Future:
        return self._call("abort_all", bool(lift_quarantine))

    def set_quarantined(self, quarantined: bool) -> None:
        if not quarantined:
            try:
                self._send(proto.UtilityCall(0, "lift_quarantine"))  # call id 0: no answer
            except EngineDeadError:
                pass

    def set_frozen(self, frozen: bool) -> concurrent.futures.Future:
        return self._call("set_frozen", bool(frozen))

    def wait_drained(self) -> concurrent.futures.Future:
        return self._call("wait_drained")

    def reset_prefix_cache(self) -> concurrent.futures.Future:
        return self._call("reset_prefix_cache")

    def call(self, target: str, *args) -> concurrent.futures.Future:
        return self._call("call", target, *args)

    def front_state(self, *state) -> concurrent.futures.Future:
        """Relay API process 0's admission state (``FrontSync.state()``) to the others; done once
        each applied it (:mod:`rlserve.engine.front.front_sync`)."""
        return self._call("front_state", *state)

    def front_pending(self) -> concurrent.futures.Future:
        """The indices of the API processes that have not acked a relayed state yet (a list of int)."""
        return self._call("front_pending")

    def set_weight_version(self, version: str) -> None:
        self._version = version
        try:
            self._send(proto.SetWeightVersion(version))
        except EngineDeadError:
            pass

    # ---- receiving (reader thread) ---------------------------------------------------------
    def _read(self) -> None:
        poller = zmq.Poller()
        poller.register(self._out, zmq.POLLIN)
        if self._pidfd is not None:
            poller.register(self._pidfd, zmq.POLLIN)
        try:
            while True:
                poller.poll(None if self._pidfd is not None and self._scheduled_on is None else int(_RECLAIM_S * 1000))
                self._drain()
                self._reclaim()
                if self.proc.poll() is not None:
                    self._drain()  # whatever it sent before it went
                    break
        except zmq.ZMQError:
            if not self._closing:
                logger.exception("engine replica %d: reading its outputs failed", self.index)
        except Exception:  # noqa: BLE001 - a bug here must not leave requests hanging
            logger.exception("engine replica %d: output reader crashed", self.index)
            try:
                self.proc.kill()
            except OSError:
                pass
        self._on_exit()

    def _drain(self) -> None:
        """Receive every frame waiting and have them handled on the front's event loop (one
        callback for all of them, :meth:`_handle_pending`), in order; here where no loop is
        running. Handling them there rather than on this thread: this thread's Python work
        (decoding, detokenization: ~13 us per request per step on the CPU machine) held the GIL
        against the event loop, whose every socket write (a syscall that drops the GIL) then
        waited for this thread to give it back (up to the interpreter's 5 ms switch interval);
        on the loop, frames that piled up while it was busy are handled together, one output per
        request (:meth:`OutputProcessor.process`), so a loop that falls behind does less work per
        step instead of the same."""
        got = False
        while True:
            try:
                raw = self._out.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self._pending.append(raw)
            got = True
        if not got:
            return
        loop = getattr(self.front, "loop", None)
        if loop is not None and loop.is_running():
            if self._scheduled_on is loop:
                return  # the callback on its way takes these too
            self._scheduled_on = loop
            try:
                loop.call_soon_threadsafe(self._handle_pending)
                return
            except RuntimeError:  # the loop closed meanwhile
                self._scheduled_on = None
        self._handle_pending()  # no loop serving (yet): here, as the loop would

    def _reclaim(self) -> None:
        """Handle the frames here (the reader thread) when the loop their callback went to is no
        longer running: it stopped, or closed, before running the callback, and a closed loop drops
        it. Before, those frames waited for the next frame from the core or its exit: a call's
        answer (its ``concurrent.futures.Future``), a request's last output (the replica's
        ``reqs`` and ``load``) and ``CoreExiting`` stayed unhandled. A loop that runs again later
        finds nothing left (the frames are taken under ``_handle_lock``)."""
        loop = self._scheduled_on
        if loop is not None and not loop.is_running():
            self._handle_pending()

    def _handle_pending(self) -> None:
        """Handle the frames received so far, in order (the event loop's callback, or the
        reader's own call; one at a time: ``_handle_lock``).

        On the event loop only the frames waiting when the callback starts are handled: frames
        that arrive meanwhile get a callback of their own (the reader schedules one once
        ``_scheduled_on`` is cleared), queued behind the streams this one wakes. Handling them
        here too (as before) kept the loop in this callback for as long as the core sent steps
        faster than they were handled, and no stream wrote a byte meanwhile: at 256 streams,
        gaps of hundreds of ms between a stream's chunks (issue 37's p99 inter-token latency)."""
        self._scheduled_on = None
        on_loop = asyncio._get_running_loop() is not None
        with self._handle_lock:
            while self._pending:
                try:
                    msgs = [self._dec.decode(self._pending.popleft().buffer) for _ in range(len(self._pending))]
                    i = 0
                    while i < len(msgs):  # consecutive steps' outputs together: one output per request
                        j = i
                        while j < len(msgs) and isinstance(msgs[j], proto.CoreOutputs):
                            j += 1
                        if j > i:
                            self._handle_outputs(msgs[i:j])
                            i = j
                        else:
                            self._handle(msgs[i])
                            i += 1
                except Exception:  # noqa: BLE001 - a bug here must not leave requests hanging
                    logger.exception("engine replica %d: handling an engine-core message failed", self.index)
                    with contextlib.suppress(OSError):
                        self.proc.kill()  # the reader sees it exit and ends its requests (503)
                if on_loop:
                    break  # the rest has its own callback (above)

    def _handle_outputs(self, msgs) -> None:
        """``CoreOutputs`` of consecutive steps (one, unless the loop fell behind), in order."""
        for msg in msgs:
            if msg.stats is not None:  # before the outputs reach their requests
                self.stats = msg.stats
        deltas = msgs[0].deltas if len(msgs) == 1 else [d for m in msgs for d in m.deltas]
        outputs, errors, stops, aborts = self._outputs.process(deltas, self.reqs)
        for msg in msgs:
            for e in msg.errors:
                self._outputs.drop(e.request_id)
                errors.append((e.request_id, proto.rebuild_error(e.error)))
        try:  # first: the core stops their work sooner, and before anyone sees these outputs
            for rid, indices in stops:
                self._send(proto.StopSamples(rid, indices))
            if aborts:
                self._send(proto.Abort(aborts))
        except EngineDeadError:
            pass
        self.route(outputs, errors)

    def _handle(self, msg) -> None:
        if isinstance(msg, proto.CoreOutputs):
            self._handle_outputs([msg])
        elif isinstance(msg, proto.CoreExiting):
            self.exiting.set()
        elif isinstance(msg, proto.FrontState):  # API processes > 0: process 0's admission state
            aborted = self.front.front_sync.apply(msg)
            with contextlib.suppress(EngineDeadError):  # after the state: nothing more is submitted unheld
                self._send(proto.FrontStateAck(msg.epoch, self.client_index, aborted))
        elif isinstance(msg, proto.UtilityResult):
            fut = self._calls.pop(msg.call_id, None)
            if fut is None or fut.done():
                return
            if msg.error is not None:
                fut.set_exception(proto.rebuild_error(msg.error))
            else:
                fut.set_result(msg.result)

    def _on_exit(self) -> None:
        self._handle_pending()  # what it sent before it went, before its requests fail
        self.proc.poll()
        rc = self.proc.returncode
        with self._send_lock:
            self.alive = False
        if self._closing:
            self.death = f"engine replica {self.index} was shut down"
        else:
            self.exit_cause = (f"the engine-core process of replica {self.index} (pid {self.proc.pid}) "
                               f"{exit_text(rc)}")
            self.death = f"{self.exit_cause}; the server cannot generate until it is restarted"
            logger.error("%s", self.death)
        self.fail_routed(self._dead())
        if self._outputs is not None:
            self._outputs.clear()
        self._fail_calls()
        if not self._closing:
            self.front._replica_died(self)

    def ended_now(self) -> str | None:
        """Why the core's process cannot serve, read from the kernel now: killed (a SIGKILL
        pending), exiting, or exited, though the reader thread (woken by the process's end, then
        needing the GIL) has not said so yet; ``None`` while it runs. One ``/proc`` read (plus a
        non-reaping ``waitid`` once it has ended): for ``/health``, not the request path."""
        if not self.alive:
            return self.death or f"engine replica {self.index} is not running"
        proc = self.proc
        if proc is None:
            return None
        # reaped by the reader already (its Popen.poll): the status is there, the process is not
        why = exit_text(proc.returncode) if proc.returncode is not None else child_ended(proc.pid)
        if why == "is gone":  # reaped by the reader between the two reads: its status is on the Popen at once
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.2)  # (waits on the reaper's lock, never on the process: it is gone)
            why = exit_text(proc.returncode)
        return None if why is None else f"the engine-core process of replica {self.index} (pid {proc.pid}) {why}"

    def _dead(self) -> EngineDeadError:
        return EngineDeadError(self.death or f"engine replica {self.index} is not running")

    def _fail_calls(self) -> None:
        while self._calls:
            _cid, fut = self._calls.popitem()
            if not fut.done():
                fut.set_exception(self._dead())
