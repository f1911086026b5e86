"""Server-side weight-sync state machine: :class:`WeightTransferManager`.

The HTTP routes (``rlserve/server/weight_routes.py``) call it; it reaches every engine replica
(in its engine-core process, or on a thread) through ``AsyncEngine.call_engines`` of the
functions in :mod:`rlserve.transfer.engine_calls`, and every TP worker through
``engine.collective_rpc`` of the functions in :mod:`rlserve.transfer.worker_ext`.

States::

    uninitialized --init--> ready --start--> updating --update*--> updating --finish--> ready
          ^                   |                  |  (failure: group torn down)
          +----shutdown-------+------------------+--> uninitialized

Out-of-order calls raise :class:`WeightUpdateStateError` (HTTP 409): update / finish without
start, start twice, update without init, a second long call while one runs.

Guarantees (beyond vLLM):

- the whole update's metadata (names known, shapes, float dtypes, full coverage unless
  ``partial``) is validated against the model's ``checkpoint_spec()`` /
  ``required_checkpoint_names()`` before any byte moves (400, nothing changed);
- a failure mid-update (trainer died, timeout, checksum mismatch, a worker raising) tears the
  group down on every worker; staged mode keeps the old weights; in-place mode marks the model
  unavailable (``AsyncEngine.set_unavailable``: generation answers 503) if any worker may have
  written into the parameters (its op reported ``touched``: a load began, or a direct receive
  posted into them, even if no bucket completed; or its end was never seen), until an update
  covering every required parameter commits; a fresh ``init_weight_transfer_engine`` then works;
- TRL's per-tensor protocol runs as one such session per batch (first ``update_named_param``
  to ``reset_prefix_cache``), so it gets the same guarantees;
- a trainer whose process dies is noticed within about a second
  (:mod:`rlserve.transfer.liveness`: its TCPStore connection closes) during init ... finish,
  inside a bucket receive as between calls: the update in progress fails as above (a receive
  blocked on the dead peer is aborted), and the group is torn down;
- an open update session that sees no call for ``timeout_s`` seconds is abandoned the same way
  (a live trainer that stopped calling never leaves the server paused);
- every commit resets the prefix cache and sets the weight version (auto-incremented when the
  trainer gives none).

Staging (``weight_staging``): ``"none"`` loads in place while generation is paused (the trainer
pauses, as with vLLM; if it did not, the manager pauses with mode ``keep`` from
``start_weight_update`` to ``finish_weight_update``). ``"device"`` / ``"host"`` receive into a
staging copy while generation continues; ``finish`` pauses briefly (``keep``), loads the staged
tensors with one local copy, resets the prefix cache and resumes.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import re
import time
import uuid
from dataclasses import dataclass, field

from rlserve.errors import (
    ModelUnavailableError,
    NoTransferEngineError,
    StaleSessionError,
    WeightUpdateError,
    WeightUpdateStateError,
)
from rlserve.transfer import errors as terr
from rlserve.transfer.engine_calls import TARGET as _ENGINE
from rlserve.transfer.checksums import compare_checksums
from rlserve.transfer.liveness import PeerLiveness, StoreLiveness
from rlserve.transfer.protocol import (
    BACKENDS,
    DEFAULT_TIMEOUT_S,
    InitInfo,
    UpdateInfo,
    validate_against_spec,
)
from rlserve.transfer.receiver import LayoutMismatchError, check_transport_fields, expected_checksum_count
from rlserve.transfer.safe_pickle import UnsafePickleError
from rlserve.transfer.vllm_ipc import translate_update_info

logger = logging.getLogger(__name__)

_WORKER = "rlserve.transfer.worker_ext"
#: Longest a poll of a paused engine's worker waits for its op (seconds): bounds how long a
#: control command (resume, abort) queued behind the poll on the engine thread waits.
_POLL_BLOCK_S = 0.05
STAGING_MODES = ("none", "device", "host")
#: keys of --weight-transfer-config that are init_info defaults; the others are the server's own
_INIT_DEFAULT_KEYS = {"timeout_s", "packed", "packed_buffer_size_bytes", "packed_num_buffers"}
_CONFIG_KEYS = {"backend", "direct_receive", "trainer_liveness", *_INIT_DEFAULT_KEYS}

_ERRORS = {
    "LayoutMismatchError": LayoutMismatchError,  # 400: the trainer's data disagrees with its update_info
    "UnsafePickleError": UnsafePickleError,  # 400: the trainer's unique-id pickle was refused (vLLM's wire)
    "ChecksumMismatchError": terr.ChecksumMismatchError,
    "TransferTimeoutError": terr.TransferTimeoutError,
    "TransferAbortedError": terr.TransferAbortedError,
    "WeightTransferFailedError": terr.WeightTransferFailedError,
}


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


def next_version(current: str) -> str:
    """``"7"`` → ``"8"``; ``"step-41"`` → ``"step-42"``; ``"abc"`` → ``"abc.1"``."""
    m = re.match(r"^(.*?)(\d+)$", str(current))
    if m:
        return f"{m.group(1)}{int(m.group(2)) + 1}"
    return f"{current}.1"


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
    bytes: int = 0
    seconds: float = 0.0
    calls: int = 0
    ipc_refs: set = field(default_factory=set)  # ipc_handles_ref names used in this session
    # one-call ipc update in place on one replica (see WeightTransferManager._commits_in_engine):
    # the receive, the prefix-cache reset and the new version are one engine-thread command
    commit_in_engine: bool = False
    commit_version: str | None = None  # the version asked for (None: the current one + 1)
    committed_version: str | None = None  # set by that command once it committed


class WeightTransferManager:
    """The server's weight-sync control plane.

    Args:
        aengine: the :class:`~rlserve.engine.async_engine.AsyncEngine` (``call_engines``,
            ``pause``/``resume``/``is_paused``, ``set_weight_version``, ``set_unavailable``,
            ``reset_prefix_cache``, ``config``).
        transfer_config: ``--weight-transfer-config`` JSON: ``{"backend": "gloo"|"nccl"|"ipc"}``
            plus optional defaults for ``init_info`` (``timeout_s``, ``packed``,
            ``packed_buffer_size_bytes``, ``packed_num_buffers``). A trainer asking for another
            backend is refused (400). ``"direct_receive": false`` keeps packed gloo updates of
            a CPU model going through the receive buffers (default true: from the second
            identical update on they land straight in the parameters, see
            :mod:`rlserve.transfer.direct`). ``"trainer_liveness": false`` stops watching the
            trainer's TCPStore (:mod:`rlserve.transfer.liveness`; default true): a dead trainer
            is then noticed by ``timeout_s`` only.
        staging: ``"none"`` (in place), ``"device"`` or ``"host"``.
        rpc_timeout_s: seconds for one short worker RPC (poll, abort, status).
        poll_interval_s: the longest pause between progress polls of a running transfer (seconds;
            polls start 0.2 ms apart and back off to this).

    Raises:
        ValueError: bad ``transfer_config`` or ``staging``.
    """

    def __init__(self, aengine, transfer_config: dict | None = None, staging: str = "none",
                 rpc_timeout_s: float = 60.0, poll_interval_s: float = 0.005):
        cfg = dict(transfer_config or {})
        unknown = set(cfg) - _CONFIG_KEYS
        if unknown:
            raise ValueError(f"weight transfer config: unknown key(s) {sorted(unknown)}; known: {sorted(_CONFIG_KEYS)}")
        if cfg.get("backend") is not None and cfg["backend"] not in BACKENDS:
            raise ValueError(f"weight transfer backend must be one of {BACKENDS}, got {cfg['backend']!r}")
        if staging not in STAGING_MODES:
            raise ValueError(f"weight staging must be one of {STAGING_MODES}, got {staging!r}")
        self.aengine = aengine
        self.config = cfg
        self.backend: str | None = cfg.get("backend")
        self.staging = staging
        if not isinstance(cfg.get("direct_receive", True), bool):
            raise ValueError(f"weight transfer config: direct_receive must be true or false, got {cfg['direct_receive']!r}")
        self.direct_receive: bool = cfg.get("direct_receive", True)
        if not isinstance(cfg.get("trainer_liveness", True), bool):
            raise ValueError(f"weight transfer config: trainer_liveness must be true or false, "
                             f"got {cfg['trainer_liveness']!r}")
        self.trainer_liveness: bool = cfg.get("trainer_liveness", True)
        self.rpc_timeout_s = float(rpc_timeout_s)
        self.poll_interval_s = float(poll_interval_s)
        self._init: InitInfo | None = None
        self._session: _Session | None = None
        self._init_cancelled: str | None = None  # why a pending init was cancelled (see _preempt)
        self._busy: str | None = None
        self._spec: tuple[dict, set] | None = None
        self._tied: dict[str, str] = {}  # tied_checkpoint_names(), set by _model_spec
        self._unavailable_by_us = False
        # ipc_handles_ref -> the validated metadata of its tensors (every worker holds the ref)
        self._ipc_refs: dict[str, dict] = {}
        self._watchdog: asyncio.Task | None = None
        # the trainer's liveness (rlserve.transfer.liveness), watched from init to teardown
        self._liveness: PeerLiveness | None = None
        self._liveness_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()  # background bookkeeping calls (forget, end_session)
        self.last_update: dict | None = None
        self.history: collections.deque = collections.deque(maxlen=32)
        #: callables ``fn(entry)`` told of every update recorded (``last_update``'s dict): metrics
        self.update_listeners: list = []
        self.num_updates = 0
        self.num_failures = 0
        # TRL protocol
        self._trl_queue: asyncio.Queue | None = None
        self._trl_worker: asyncio.Task | None = None
        self._trl_init_task: asyncio.Task | None = None
        self._trl_error: BaseException | None = None
        self._trl_pending = 0  # update_named_param calls queued or running

    # ================================================================== helpers
    @property
    def num_workers(self) -> int:
        """Server workers in the transfer group: TP x DP."""
        c = self.aengine.config
        return int(getattr(c, "tensor_parallel_size", 1) or 1) * int(getattr(c, "data_parallel_size", 1) or 1)

    def _init_defaults(self) -> dict:
        """The init_info defaults of the transfer config (``timeout_s``, ``packed*``)."""
        return {k: v for k, v in self.config.items() if k in _INIT_DEFAULT_KEYS}

    def _timeout(self) -> float:
        return self._init.timeout_s if self._init is not None else float(self.config.get("timeout_s", DEFAULT_TIMEOUT_S))

    async def _rpc(self, fn: str, *args, timeout_s: float | None = None) -> list:
        """``fn(worker, *args)`` on every worker of every replica; results flattened (replica-major,
        TP rank order). Raises TransferTimeoutError after ``timeout_s``."""
        return (await self._rpc_commit(fn, *args, timeout_s=timeout_s))[0]

    async def _rpc_commit(self, fn: str, *args, timeout_s: float | None = None,
                          commit: dict | None = None) -> tuple[list, str | None]:
        """:meth:`_rpc`; with ``commit`` (see ``engine_calls.worker_rpc``) the same engine command
        then commits (prefix-cache reset, new weight version) or, after a failure that may have
        written into the parameters, quarantines the replica (``AsyncEngine.quarantine``): nothing
        steps in between. Returns ``(results, the version committed or None)``."""
        t = timeout_s or self.rpc_timeout_s
        try:
            res = await self.aengine.call_engines(f"{_ENGINE}worker_rpc", f"{_WORKER}:{fn}", list(args), t, commit,
                                                  timeout_s=t + 5)
        except asyncio.TimeoutError as e:
            raise terr.TransferTimeoutError(f"worker call {fn} did not return within {t:.0f} s") from e
        for r in res:
            if r.get("quarantined"):
                self.aengine.set_unavailable(r["quarantined"])  # the 503 here; the replica halted there
        committed = [r["committed_version"] for r in res if r.get("committed_version") is not None]
        if committed:
            self.aengine.set_weight_version(committed[-1])  # the front's copy (the engines have it)
        return [x for r in res for x in r["results"]], (committed[-1] if committed else None)

    async def _model_spec(self) -> tuple[dict, set]:
        """``(checkpoint_spec, required names)`` of the served model; also sets ``self._tied``
        (``tied_checkpoint_names()``, for ``validate_against_spec(tied=...)``)."""
        if self._spec is None:
            res = await self.aengine.call_engines(f"{_ENGINE}model_spec", timeout_s=self.rpc_timeout_s)
            spec, req, self._tied = res[0]
            self._spec = ({k: tuple(v) for k, v in spec.items()}, set(req))
        return self._spec

    def _check_not_busy(self, what: str) -> None:
        if self._busy is not None:
            raise WeightUpdateStateError(f"{what}: a {self._busy} call is still running; wait for it to return")

    def _record(self, **kw) -> None:
        entry = {"time": time.time(), **kw}
        self.last_update = entry
        self.history.append(entry)
        for listener in self.update_listeners:
            try:
                listener(entry)
            except Exception:  # noqa: BLE001 - a metrics listener must not fail an update
                logger.exception("weight update listener failed")

    async def _run_op(self, start_fn: str, args: list, deadline_s: float, what: str,
                      session: _Session | None = None) -> list[dict]:
        """Start a background op on every worker and poll until all finished.

        Raises the first worker error as its rlserve class (TransferTimeoutError, ...)."""
        op_id = uuid.uuid4().hex
        # Paused engines (an in-place update, or a trainer that paused) step nothing: the engine
        # thread may then wait for the op (at most _POLL_BLOCK_S per call), so its end is seen at
        # once instead of after a back-off sleep; the first wait rides on the call that starts
        # the op. Running engines are polled between steps without blocking. A session that
        # commits in the engine holds the engine thread for the whole command anyway.
        commit = session is not None and session.commit_in_engine
        block = _POLL_BLOCK_S if (commit or self.aengine.is_paused()) else 0.0
        try:
            if block:
                results, committed = await self._rpc_commit(
                    "start_wait", start_fn, op_id, block, *args,
                    commit={"version": session.commit_version, "when": "all_ok",
                            "failure": "a weight update failed after it had changed some parameters"}
                    if commit else None)
                if committed is not None:
                    session.committed_version = committed
                done = self._poll_results(results, what, session)
                if done is not None:
                    return done
            else:
                await self._rpc(start_fn, op_id, *args)
            return await self._poll_op(op_id, deadline_s, what, session)
        finally:
            # off the caller's path: later calls to the same engine threads queue behind it
            self._background(self._forget(op_id))

    def _commits_in_engine(self) -> bool:
        """Whether a ``/sync_weights`` call runs as one engine-thread command, without pause and
        resume: ipc (the receive runs on the engine thread and waits for no peer), in place, one
        replica. A command runs between two steps by itself, so the running requests see the
        update exactly as under a keep-pause, and the next step already runs (and is stamped)
        with the new weights; it saves the pause, prefix-cache reset and resume round trips."""
        return (self._init is not None and self._init.backend == "ipc" and self.staging == "none"
                and len(self.aengine.engines) == 1)

    def _background(self, coro) -> None:
        """Run ``coro`` as a task off the caller's path, referenced until it ends (asyncio keeps
        only weak references to tasks)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _forget(self, op_id: str) -> None:
        await self._rpc_logged("forget", op_id)  # the op table is also cleared on teardown

    async def _rpc_logged(self, fn: str, *args) -> None:
        """:meth:`_rpc` whose failure is only logged (bookkeeping calls run as background tasks)."""
        try:
            await self._rpc(fn, *args, timeout_s=min(self.rpc_timeout_s, 30.0))
        except Exception as e:  # noqa: BLE001
            logger.warning("weight transfer worker call %s failed: %s", fn, e)

    @staticmethod
    def _poll_results(results: list, what: str, session: _Session | None) -> list | None:
        """The op's results once every worker finished, ``None`` while some still run.
        Raises the first worker error as its rlserve class (a root cause before the aborts it
        caused elsewhere)."""
        if session is not None:
            # a worker that began writing into the live parameters changed the model, whether or
            # not a bucket completed (a direct receive killed mid-bucket); one not seen to end may
            # still write: only an op seen ended on every worker without a write is proven clean
            if any(r.get("applied") or r.get("touched") for r in results):
                session.applied = True
            if all(r.get("done") for r in results):
                session.in_doubt = False
        failed = [r for r in results if r.get("done") and not r.get("ok")]
        if failed:
            failed.sort(key=lambda r: r.get("error_type") in ("TransferAbortedError", "WeightTransferFailedError"))
            r = failed[0]
            cls = _ERRORS.get(r.get("error_type"), terr.WeightTransferFailedError)
            raise cls(f"{what} failed on a server worker: {r.get('error_type')}: {r.get('error')}")
        if all(r.get("done") for r in results):
            return [r.get("result") for r in results]
        return None

    async def _poll_op(self, op_id: str, deadline_s: float, what: str, session: _Session | None) -> list:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + deadline_s
        sleep = 0.0002  # short ops (an ipc update of a few ms) are seen finished within ~0.2 ms
        while True:
            block = _POLL_BLOCK_S if self.aengine.is_paused() else 0.0  # see _run_op
            done = self._poll_results(await self._rpc("poll", op_id, block), what, session)
            if done is not None:
                return done
            if loop.time() > deadline:
                raise terr.TransferTimeoutError(f"{what} did not finish within {deadline_s:.0f} s")
            if block:
                continue
            await asyncio.sleep(sleep)
            sleep = min(sleep * 2, self.poll_interval_s)

    async def _teardown_group(self) -> None:
        """Abort and leave the group on every worker; never raises."""
        self._stop_liveness()
        self._init = None
        self._ipc_refs = {}
        for fn in ("abort", "shutdown_transfer"):
            try:
                await self._rpc(fn, timeout_s=min(self.rpc_timeout_s, 30.0))
            except Exception as e:  # noqa: BLE001
                logger.warning("weight transfer teardown (%s) failed: %s", fn, e)

    # ------------------------------------------------------------------ trainer liveness
    #: Seconds between two looks at the liveness watch (on the event loop; a look is a few
    #: attribute reads).
    LIVENESS_POLL_S = 0.05

    def _stop_liveness(self) -> None:
        if self._liveness is not None:
            self._liveness.stop()
        self._liveness = None

    def _new_liveness(self, info: InitInfo) -> StoreLiveness | None:
        """A watch on the trainer's TCPStore, or ``None`` where the trainer hosts none: TRL's
        layout (``rank_offset`` 0: server worker 0 hosts it) and ipc without ``master_port``
        (the SDK's ipc engine hosts one and sends its port; other ipc clients do not)."""
        if not self.trainer_liveness or info.rank_offset != 1 or not info.master_port:
            return None
        return StoreLiveness(info.master_address, info.master_port)

    def _watch_liveness(self, watch: StoreLiveness | None) -> None:
        """Make ``watch`` (started) the current one and poll it until it is replaced / stopped."""
        self._stop_liveness()
        if watch is None:
            return
        self._liveness = watch
        self._liveness_task = asyncio.get_running_loop().create_task(self._poll_liveness(watch))

    async def _poll_liveness(self, watch: PeerLiveness) -> None:
        while self._liveness is watch:
            reason = watch.gone()
            if reason is not None:
                try:
                    await self._trainer_gone(watch, reason)
                except Exception:  # noqa: BLE001 - a background task: log, never raise into the loop
                    logger.exception("handling the trainer's death failed")
                return
            await asyncio.sleep(self.LIVENESS_POLL_S)

    async def _trainer_gone(self, watch: PeerLiveness, reason: str) -> None:
        """The trainer died: fail the open update exactly as a broken transfer fails (a running
        receive is aborted: its error names ``reason``; in place with something loaded, 503
        until a full update; staged, the old weights stay; the pause is released) and leave the
        group. With no update open, the group is only torn down (the next init starts afresh)."""
        why = f"the trainer is gone: {reason}"
        if self._busy == "init":
            return  # a newer init is replacing the group (and stopped this watch)
        if self._busy in ("update", "trl"):
            logger.error("%s; aborting the weight update in progress", why)
        await self._preempt(why)  # a running call ends through its own failure path
        if self._liveness is not watch or self._busy is not None:
            return  # that failure path (or a newer init / shutdown) tore the group down
        self._busy = "teardown"  # a new init (the trainer restarted) waits for this to end
        try:
            if self._session is not None:
                await self._fail(self._session, terr.TrainerGoneError(why))
            else:
                logger.warning("%s; leaving the transfer group (no update was open)", why)
                await self._teardown_group()
        finally:
            self._busy = None

    async def _mark_unavailable(self, reason: str) -> None:
        """Generation answers 503 with ``reason`` until a full update lands, and the requests in
        flight or held end now with the same error (:meth:`AsyncEngine.fail_all`): frozen by the
        update's pause or not, their KV cache holds the old weights' keys and values and the
        model is now part old, part new."""
        self._unavailable_by_us = True
        self.aengine.set_unavailable(reason)
        logger.error("model marked unavailable: %s", reason)
        try:
            n = await self.aengine.fail_all(ModelUnavailableError(reason))
        except Exception as e:  # noqa: BLE001 - the 503 for new requests is in place already
            logger.warning("ending the requests in flight failed: %s", e)
        else:
            if n:
                logger.error("%d request(s) in flight ended with the same error", n)

    async def _end_session(self, session: _Session) -> None:
        if self._session is session:
            self._session = None
        if self._init is not None and self._init.backend == "ipc":
            # the workers drop the lists a session did not use
            self._ipc_refs = {r: m for r, m in self._ipc_refs.items() if r in session.ipc_refs}
            # off the caller's path: the next session's calls queue behind it on the engine threads
            self._background(self._rpc_logged("end_session"))
        if session.auto_paused:
            try:
                await self.aengine.resume()
            except Exception as e:  # noqa: BLE001
                logger.warning("resume after weight update failed: %s", e)

    async def _fail(self, session: _Session | None, err: BaseException, teardown: bool = True) -> None:
        """Failure path of an update: tear down, keep old weights (staged) or mark the model
        unavailable (in place, if anything was loaded), resume if we paused."""
        self.num_failures += 1
        msg = f"{type(err).__name__}: {err}"
        logger.error("weight update failed: %s", msg)
        if teardown:
            await self._teardown_group()
        elif self.staging != "none":
            try:
                await self._rpc("discard")
            except Exception:  # noqa: BLE001
                pass
        if session is not None:
            if self.staging == "none" and (session.applied or session.in_doubt):
                await self._mark_unavailable(f"a weight update failed after it had changed some parameters ({msg}); "
                                             "generation resumes once a full weight update lands")
            await self._end_session(session)
        self._record(ok=False, error=msg, staging=self.staging, backend=self._init.backend if self._init else self.backend,
                     **({"protocol": "trl"} if session is not None and session.trl else {}))

    def _arm_watchdog(self) -> None:
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            s = self._session
            if s is None:
                return
            limit = self._timeout()
            idle = time.monotonic() - s.last_activity
            if self._busy is None and idle > limit:
                logger.error("weight update session idle for %.0f s: abandoning it", idle)
                what = "/update_named_param/ or /reset_prefix_cache/" if s.trl else "weight-update"
                err = terr.TransferTimeoutError(f"no {what} call for {limit:.0f} s after the update started "
                                                "(trainer gone?)")
                if s.trl:
                    self._trl_error = err  # the next TRL call reports it
                await self._fail(s, err)
                return
            await asyncio.sleep(min(5.0, max(0.05, limit / 4)))

    # ================================================================== vLLM-style API
    async def init_engine(self, init_info: dict) -> dict:
        """``POST /init_weight_transfer_engine``: every worker joins the transfer group (the
        trainer joins concurrently). Replaces a previous group; an update in progress is
        abandoned. Returns once all workers joined, at most ``timeout_s`` (+30) seconds.

        Raises:
            WeightUpdateError (400): bad init_info, wrong backend / world size.
            WeightUpdateStateError (409): another init is running.
            TransferTimeoutError / WeightTransferFailedError: the rendezvous failed.
        """
        merged = self._init_defaults()
        if not isinstance(init_info, dict):
            raise WeightUpdateError("init_info must be a JSON object")
        merged.update(init_info)
        if "backend" not in init_info:
            # vLLM's trainers never name a backend (the server's config does); rlserve's SDK always
            # does. On NCCL such a trainer speaks vLLM's wire (rlserve.transfer.vllm_group).
            merged["backend"] = self.backend or "gloo"
            if merged["backend"] == "nccl":
                merged.setdefault("wire", "vllm")
        info = InitInfo.from_dict(merged)
        if self.backend is not None and info.backend != self.backend:
            raise WeightUpdateError(f"this server's weight transfer backend is {self.backend!r} "
                                    f"(--weight-transfer-config), the trainer asked for {info.backend!r}")
        n = self.num_workers
        if info.backend == "ipc":
            info.world_size = n + 1  # no group: the field is meaningless
        elif info.world_size != n + 1:
            raise WeightUpdateError(f"init_info.world_size must be {n + 1} (this server's {n} worker(s) + 1 trainer), "
                                    f"got {info.world_size}")
        if info.backend == "ipc" and str(getattr(self.aengine.engine, "device", "cpu")).startswith("cpu"):
            raise WeightUpdateError("the ipc backend needs a CUDA server")
        # a pending init (a trainer that never joined, or is still joining) is cancelled: the
        # newer init wins, as a new init also wins over an update in progress
        await self._preempt("a new init_weight_transfer_engine")
        if self._busy is not None:
            raise WeightUpdateStateError(f"init_weight_transfer_engine: a {self._busy} call is still running")
        if self._session is not None:
            await self._fail(self._session, WeightUpdateStateError("superseded by a new init_weight_transfer_engine"))
        self._busy = "init"
        t0 = time.perf_counter()
        self._stop_liveness()  # the previous trainer's watch: its group is being replaced
        watch = self._new_liveness(info)
        try:
            if watch is not None and info.backend == "ipc":
                # the SDK's ipc engine hosts a store for its liveness only, up before this call
                watch.start()
                if not await asyncio.to_thread(watch.wait_connected, min(10.0, info.timeout_s)):
                    raise WeightUpdateError(
                        f"init_info.master_port: no TCPStore answers at {info.master_address}:{info.master_port} "
                        "(ipc: the trainer's liveness store; send master_port 0 for none)")
            results = await self._run_op("init_transfer", [info.to_dict()], info.timeout_s + 30,
                                         "init_weight_transfer_engine")
            await self._model_spec()
            self._init = info
            self._ipc_refs = {}  # the workers' receivers are new
            if watch is not None and info.backend != "ipc":
                watch.start()  # the rendezvous went through the trainer's store: it is up
            self._watch_liveness(watch)
        except BaseException as e:
            if watch is not None:
                watch.stop()
            await self._teardown_group()
            why, self._init_cancelled = self._init_cancelled, None
            if why is not None:
                raise WeightUpdateStateError(f"init_weight_transfer_engine cancelled by {why}") from e
            raise
        finally:
            self._busy = None
        ranks = [r.get("rank") for r in results if isinstance(r, dict)]
        logger.info("weight transfer engine ready: %s, world size %d, worker ranks %s (%.2f s)",
                    info.backend, info.world_size, ranks, time.perf_counter() - t0)
        return {"status": "ok", "backend": info.backend, "world_size": info.world_size, "worker_ranks": ranks,
                "staging": self.staging}

    async def _preempt(self, why: str) -> None:
        """Abort a running update (workers fail fast) and wait for its failure path."""
        if self._busy is None:
            return
        if self._busy == "init":
            logger.warning("cancelling the pending rendezvous: %s", why)
            self._init_cancelled = why
            try:
                await self._rpc("abort_init", timeout_s=10.0)
            except Exception:  # noqa: BLE001
                pass
        if self._busy == "update":
            logger.warning("aborting the weight update in progress: %s", why)
            try:
                await self._rpc("abort", why, timeout_s=10.0)
            except Exception:  # noqa: BLE001
                pass
        deadline = time.monotonic() + self._timeout() + 30
        while self._busy is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def start_update(self, update_info: dict | None = None, pause: bool = True) -> dict:
        """``POST /start_weight_update``: open an update session.

        Args:
            update_info: optional declaration of the whole update (rlserve extension; the SDK
                sends it): validated now, so bad metadata is refused before any data moves;
                later ``update_weights`` calls must stay within it, and ``finish`` checks that all
                of it arrived.
            pause: in place, keep-pause generation until finish (``False``: the one-call path
                that commits in the engine command, :meth:`sync_weights`).
        Raises:
            WeightUpdateStateError (409): no transfer engine, or a session is already open.
            WeightUpdateError (400): the declared metadata is invalid.
        """
        if self._init is None:
            raise NoTransferEngineError("start_weight_update: no transfer engine; call "
                                        "/init_weight_transfer_engine first")
        if self._session is not None:
            raise WeightUpdateStateError("start_weight_update called twice: an update is already in progress; "
                                         "call /finish_weight_update (or /shutdown_weight_transfer_engine) first")
        self._check_not_busy("start_weight_update")
        self._busy = "start"
        try:
            return await self._start_update(update_info, pause)
        finally:
            self._busy = None

    def check_session(self, session: str | None) -> None:
        """Refuse an update call (start / update / finish / sync) that names the transfer group
        incarnation it belongs to (``session``: its ``init_info.session``) when another init has
        replaced that group since: its data would go to a group the server no longer listens
        on, and the current trainer's session would be the one to fail. ``None`` (vLLM-style
        clients): not checked.

        Raises:
            WeightUpdateStateError: (HTTP 409, code ``stale_session``).
        """
        if session is None:
            return
        if not isinstance(session, str):
            raise WeightUpdateError("session must be a string")
        current = None if self._init is None else self._init.session
        if current is not None and session != current:
            raise StaleSessionError(f"session {session[:40]!r} is not the transfer engine's current one: another "
                                    "/init_weight_transfer_engine replaced it; initialise again")

    def operator_generation_control(self, action: str) -> None:
        """Check an operator's ``POST /resume`` (``action="resume"``) or ``POST /pause?mode=M``
        (``"pause:M"``) against an open in-place update, whose tensors land in the running model.

        Generation must not run until that update finished: ``/resume`` and ``/pause?mode=wait``
        (which drains the frozen requests by stepping them) are refused. ``abort`` and ``keep``
        pauses are taken, and an explicit pause then outlives the update (its end no longer
        resumes; the operator resumes). Staged updates never pause, so nothing is refused there.

        Raises:
            WeightUpdateStateError: (HTTP 409) the action is refused.
        """
        s = self._session
        if s is None or self.staging != "none" or s.commit_in_engine:
            return
        if action in ("resume", "pause:wait"):
            what = "/resume" if action == "resume" else "/pause?mode=wait (it drains requests by running them)"
            raise WeightUpdateStateError(
                f"{what} refused: a weight update is in progress in place, and generation would run on partly "
                "loaded weights; it resumes when the update finishes or fails "
                "(/finish_weight_update, /shutdown_weight_transfer_engine)")
        s.auto_paused = False

    async def _start_update(self, update_info: dict | None, pause: bool = True) -> dict:
        declared = None
        if update_info:
            declared = UpdateInfo.from_dict(update_info).resolved(self._init)
            spec, req = await self._model_spec()
            validate_against_spec(declared, spec, req, tied=self._tied)
            declared.checksums = None
            declared.ipc_handles = None
        auto = False
        if self.staging == "none" and pause and not self.aengine.is_paused():
            await self.aengine.pause(mode="keep")
            auto = True
        self._session = _Session(declared=declared, auto_paused=auto)
        self._arm_watchdog()
        return {"status": "started", "staging": self.staging, "paused_by_server": auto,
                "declared_tensors": None if declared is None else len(declared.names)}

    async def update_weights(self, update_info: dict) -> dict:
        """``POST /update_weights``: validate, then receive and load (or stage) this update's
        tensors; returns when every worker has them.

        Raises:
            WeightUpdateStateError (409): no session / engine, or another call running.
            WeightUpdateError (400): metadata refused (nothing changed, the group stays usable).
            WeightTransferFailedError / ChecksumMismatchError / TransferTimeoutError: the transfer
                broke; the group was torn down (re-init needed).
        """
        # vLLM's ipc_handles_pickled: read (restricted) before anything else, so a refused pickle
        # is a 400 in any state and nothing it names runs
        update_info = translate_update_info(update_info)
        if self._init is None:
            raise NoTransferEngineError("update_weights: no transfer engine; call /init_weight_transfer_engine first")
        s = self._session
        if s is None:
            raise WeightUpdateStateError("update_weights without start_weight_update: call /start_weight_update first")
        self._check_not_busy("update_weights")
        self._busy = "update"  # claimed before the first await: a concurrent call gets 409
        try:
            return await self._update_weights(s, update_info)
        finally:
            self._busy = None
            s.last_activity = time.monotonic()

    async def _update_weights(self, s: _Session, update_info: dict) -> dict:
        s.last_activity = time.monotonic()
        t_in = time.perf_counter()
        try:
            info = UpdateInfo.from_dict(update_info).resolved(self._init)
            meta = None
            if info.by_ref:  # the tensors of a known ipc handle list: its record has the metadata
                meta = self._ipc_refs.get(info.ipc_handles_ref)
                if meta is None:
                    raise WeightUpdateError(f"update_info.ipc_handles_ref {info.ipc_handles_ref!r} is unknown to this "
                                            "server: send names, dtype_names, shapes and ipc_handles with it")
                info.names, info.dtype_names, info.shapes = meta["names"], meta["dtype_names"], meta["shapes"]
            spec, req = await self._model_spec()
            if not (meta is not None and s.declared is None and not s.received and info.partial == meta["partial"]):
                # (the same tensors with the same coverage rule were validated when the ref was given)
                validate_against_spec(info, spec, req,
                                      allowed_names=None if s.declared is None else set(s.declared.names),
                                      already_received=frozenset() if s.trl else s.received,
                                      check_coverage=s.declared is None, tied=self._tied)
            check_transport_fields(info, self._init.backend, self._ipc_refs)
        except WeightUpdateError as e:
            # The trainer may already be broadcasting (it calls update_weights concurrently with
            # its collective): leave the group so both ends re-initialise cleanly. No parameter
            # changed in this call.
            if self._init.backend != "ipc":
                await self._fail(s, e)
                raise WeightUpdateError(f"{e} (the transfer group was torn down: re-initialise with "
                                        "/init_weight_transfer_engine)") from None
            raise
        n_steps = expected_checksum_count(info)
        t0 = time.perf_counter()
        try:
            wire = info.to_dict()
            if meta is not None:  # the workers fill the metadata from their own record of the ref
                wire.update(names=[], dtype_names=[], shapes=[])
            # in place: assume the parameters change from here on until every worker's op was
            # seen to end without writing (an error before that, e.g. a poll that timed out,
            # counts as a changed model)
            s.in_doubt = self.staging == "none"
            results = await self._run_op("start_receive", [wire, self.staging, self.direct_receive],
                                         self._init.timeout_s * (n_steps + 2) + 30, "update_weights", session=s)
        except BaseException as e:
            await self._fail(s, e if isinstance(e, WeightUpdateError) else terr.WeightTransferFailedError(str(e)))
            raise
        secs = time.perf_counter() - t0
        nbytes = int(results[0].get("bytes", 0)) if results and isinstance(results[0], dict) else 0
        s.received |= set(info.names)
        if info.ipc_handles_ref is not None:
            s.ipc_refs.add(info.ipc_handles_ref)
            self._ipc_refs[info.ipc_handles_ref] = meta or {
                "names": info.names, "dtype_names": info.dtype_names, "shapes": info.shapes, "partial": info.partial}
        s.bytes += nbytes
        s.seconds += secs
        s.calls += 1
        if self.staging == "none" and info.names:
            s.applied = True
        first = results[0] if results and isinstance(results[0], dict) else {}
        replayed = int(first.get("replayed_loads", 0))
        out = {"status": "ok", "tensors": len(info.names), "bytes": nbytes, "seconds": round(secs, 6),
               "gbps": round(nbytes / secs / 1e9, 4) if secs > 0 else None, "staged": self.staging != "none",
               "replayed_loads": replayed, "validate_seconds": round(t0 - t_in, 6),
               "worker_seconds": round(float(first.get("seconds", 0.0)), 6),
               "worker_op_seconds": round(float(first.get("op_seconds", 0.0)), 6)}
        if "checksums_fused" in first:
            out["checksums_fused"] = bool(first["checksums_fused"])
        # every worker received straight into its parameters (rlserve.transfer.direct)
        out["direct_receive"] = bool(results) and all(isinstance(r, dict) and r.get("direct") for r in results)
        if first.get("phases_s"):
            out["worker_phases_s"] = {k: round(v, 6) for k, v in first["phases_s"].items()}
        return out

    async def finish_update(self, weight_version: str | None = None) -> dict:
        """``POST /finish_weight_update``: commit. Staged: one local copy, run by the engine thread
        between two steps (one replica) or under a brief keep-pause of every replica (DP); always:
        prefix-cache reset and the new weight version (``weight_version`` or the current one
        incremented).

        Raises:
            WeightUpdateStateError (409): no session, or a call still running.
            WeightUpdateError (400): the declared update did not fully arrive (staged: nothing
                committed; in place: the model is marked unavailable if anything was loaded).
        """
        weight_version = check_weight_version(weight_version)  # a bad one leaves the session open
        s = self._session
        if s is None:
            raise WeightUpdateStateError("finish_weight_update without start_weight_update")
        self._check_not_busy("finish_weight_update")
        self._busy = "finish"
        try:
            return await self._finish_update(s, weight_version)
        finally:
            self._busy = None

    async def _finish_update(self, s: _Session, weight_version: str | None) -> dict:
        if s.declared is not None:
            missing = [n for n in s.declared.names if n not in s.received]
            if missing:
                err = WeightUpdateError(self._incomplete_message(s, missing))
                await self._fail(s, err, teardown=False)
                raise err
        _spec, req = await self._model_spec()
        paused_here = False
        pause_t0 = None
        phases: dict[str, float] = {}
        commit_replayed = None
        version = weight_version if weight_version is not None else next_version(self.aengine.weight_version)
        staged = self.staging != "none" and bool(s.received)
        # One replica: a single engine-thread command runs between two steps by itself, so commit +
        # prefix-cache reset + version need no pause/resume round trips; the next step already runs
        # (and is stamped) with the new weights. Several replicas switch together, all frozen.
        in_engine = staged and len(self.aengine.engines) == 1 and not self.aengine.is_paused()
        try:
            if staged:
                if not in_engine and not self.aengine.is_paused():
                    pause_t0 = time.perf_counter()
                    await self.aengine.pause(mode="keep")
                    paused_here = True
                    phases["pause_s"] = time.perf_counter() - pause_t0
                t_c = time.perf_counter()
                workers = await self._commit_staged(version if in_engine else None)
                phases["commit_in_engine_thread_s" if in_engine else "commit_s"] = time.perf_counter() - t_c
                phases["worker_commit_s"] = max((r.get("seconds", 0.0) for r in workers), default=0.0)
                for k in ("load", "post_load", "device_sync"):
                    phases[f"worker_{k}_s"] = max((r.get("phases_s", {}).get(k, 0.0) for r in workers), default=0.0)
                commit_replayed = all(r.get("replayed") for r in workers)
            if s.committed_version is not None:  # the receive's engine command committed
                version = s.committed_version
            elif not in_engine:
                t_r = time.perf_counter()
                await self.aengine.reset_prefix_cache()
                phases["reset_prefix_cache_s"] = time.perf_counter() - t_r
                self.aengine.set_weight_version(version)
            full = req.issubset(s.received)
            if full and self._unavailable_by_us:
                self.aengine.set_unavailable(None)
                self._unavailable_by_us = False
                logger.info("full weight update landed: generation available again")
        except BaseException as e:
            await self._fail(s, e, teardown=False)
            if paused_here:
                await self.aengine.resume()
            raise
        if paused_here:
            await self.aengine.resume()
            phases["paused_s"] = time.perf_counter() - pause_t0
        await self._end_session(s)
        self.num_updates += 1
        total = time.monotonic() - s.started
        self._record(ok=True, weight_version=version, tensors=len(s.received), bytes=s.bytes,
                     transfer_seconds=round(s.seconds, 6), total_seconds=round(total, 6), full=full,
                     staging=self.staging, backend=self._init.backend if self._init else self.backend,
                     **({"protocol": "trl"} if s.trl else {}))
        return {"status": "ok", "weight_version": version, "tensors": len(s.received), "full": full,
                "bytes": s.bytes, "transfer_seconds": round(s.seconds, 6), "total_seconds": round(total, 6),
                "commit_phases_s": {k: round(v, 6) for k, v in phases.items()}, "commit_replayed": commit_replayed,
                "committed_in_engine_command": s.committed_version is not None}

    def _incomplete_message(self, s: _Session, missing: list[str]) -> str:
        """What ``finish_weight_update`` of a declared update that did not fully arrive did."""
        head = (f"finish_weight_update: {len(missing)} of the {len(s.declared.names)} declared tensors never "
                f"arrived (e.g. {missing[:3]})")
        if self.staging != "none":
            return f"{head}; nothing was committed: the staged tensors were dropped and the old weights keep serving"
        if s.applied:
            return (f"{head}; the {len(s.received)} that arrived were loaded in place, so the model is part old, "
                    "part new: generation answers 503 until a full weight update lands")
        return f"{head}; nothing was loaded: the old weights keep serving"

    async def _commit_staged(self, version: str | None) -> list[dict]:
        """Every worker loads its staging dict into the model (worker_ext ``commit``). With
        ``version`` (one replica), as one engine-thread command that also resets the prefix cache
        and sets the weight version. Returns the workers' answers.

        Raises:
            WeightTransferFailedError: a commit failed; the model is marked unavailable (some
                workers may have loaded, others not).
        """
        t = max(self.rpc_timeout_s, self._timeout())
        try:
            # some workers may have loaded when a commit fails: the command quarantines the replica
            # so that no step runs before the failure path below ends the requests
            res, _ = await self._rpc_commit("commit", timeout_s=t, commit=None if version is None else {
                "version": version, "when": "always", "failure": "committing staged weights failed"})
        except BaseException as e:
            await self._mark_unavailable(f"committing staged weights failed ({type(e).__name__}: {e}); "
                                         "generation resumes once a full weight update lands")
            raise terr.WeightTransferFailedError(f"commit failed: {e}") from e
        return [r for r in res if isinstance(r, dict)]

    async def sync_weights(self, update_info: dict, weight_version: str | None = None) -> dict:
        """``POST /sync_weights`` (rlserve extension): ``start_weight_update`` +
        ``update_weights(update_info)`` + ``finish_weight_update(weight_version)`` in one call,
        for a trainer whose whole update is one ``update_weights`` call (ipc with per-tensor
        handles). Same validation (everything checked before any byte moves: 400), same failure
        handling and answers as the three calls; saves two HTTP round trips and the declaration.
        A refused call leaves no session open (the trainer may retry at once). ipc in place on
        one replica: no pause / resume; the receive, prefix-cache reset and new version are one
        engine-thread command (:meth:`_commits_in_engine`).

        Returns:
            ``finish_weight_update``'s answer plus ``"update"``: ``update_weights``' answer, and
            ``"sync_phases_s"``: seconds in the start, update and finish steps.
        Raises:
            What the three calls raise.
        """
        t0 = time.perf_counter()
        weight_version = check_weight_version(weight_version)  # before anything starts
        update_info = translate_update_info(update_info)
        in_engine = self._commits_in_engine()
        await self.start_update(None, pause=not in_engine)
        s = self._session
        if s is not None and in_engine:
            s.commit_in_engine, s.commit_version = True, weight_version
        t1 = time.perf_counter()
        try:
            upd = await self.update_weights(update_info)
        except BaseException as e:
            if s is not None and self._session is s:  # refused before anything moved (ipc 400)
                await self._fail(s, e, teardown=False)
            raise
        t2 = time.perf_counter()
        fin = await self.finish_update(weight_version)
        fin["update"] = upd
        fin["sync_phases_s"] = {"start": round(t1 - t0, 6), "update": round(t2 - t1, 6),
                                "finish": round(time.perf_counter() - t2, 6)}
        return fin

    async def shutdown_engine(self) -> dict:
        """``POST /shutdown_weight_transfer_engine``: leave the group (an update in progress is
        abandoned: its failure path runs). Serving continues."""
        await self._preempt("shutdown_weight_transfer_engine")
        await self._leave_group("the transfer engine was shut down during an update")
        return {"status": "ok"}

    async def _leave_group(self, session_error: str) -> None:
        """Leave the transfer group; an open session fails with ``session_error`` first (its
        pause is released; in place with something loaded, 503 until a full update). The caller
        has preempted a running call (:meth:`_preempt`)."""
        if self._session is not None:
            await self._fail(self._session, WeightUpdateStateError(session_error))
        await self._teardown_group()

    def weight_info(self) -> dict:
        """``GET /weight_info``: version, transfer state, the last update."""
        s = self._session
        if self._busy:
            state = self._busy
        elif s is not None:
            state = "updating"
        elif self._init is not None:
            state = "ready"
        else:
            state = "uninitialized"
        eng = getattr(self.aengine, "engine", None)
        dtype = str(getattr(eng, "dtype", "")).removeprefix("torch.") if eng is not None else None
        return {
            "weight_version": self.aengine.weight_version,
            "state": state,
            "backend": self._init.backend if self._init else self.backend,
            "initialized": self._init is not None,
            "staging": self.staging,
            "dtype": dtype,
            "num_workers": self.num_workers,
            "world_size": self.num_workers + 1,
            "init_info": None if self._init is None else {k: v for k, v in self._init.to_dict().items()},
            "session": None if s is None else {"received_tensors": len(s.received), "calls": s.calls,
                                               "declared_tensors": None if s.declared is None else len(s.declared.names),
                                               "paused_by_server": s.auto_paused},
            "unavailable": getattr(self.aengine, "unavailable_reason", None),
            "trl": {"pending": self._trl_pending,
                    "uncommitted_tensors": len(s.received) if s is not None and s.trl else 0,
                    "error": None if self._trl_error is None else str(self._trl_error)},
            "num_updates": self.num_updates,
            "num_failures": self.num_failures,
            "last_update": self.last_update,
        }

    async def checksums(self, compare: dict[str, str] | None = None) -> dict:
        """``POST /weight_checker``: sha256 per HF tensor of the served weights (replica 0; every
        replica is hashed and checked equal), optionally compared with ``compare``.

        Raises:
            WeightUpdateError (400): ``compare`` is not ``{name: hex}``.
        """
        if compare is not None and (not isinstance(compare, dict) or
                                    not all(isinstance(k, str) and isinstance(v, str) for k, v in compare.items())):
            raise WeightUpdateError("compare must be an object {hf_name: sha256 hex}")
        results = [r for r in await self._rpc("model_checksums", None, timeout_s=max(self.rpc_timeout_s, 300.0))
                   if r is not None]
        first = results[0]
        out = {
            "weight_version": self.aengine.weight_version,
            "algorithm": "sha256",
            "dtype": first.get("dtype"),
            "num_tensors": len(first["checksums"]),
            "checksums": first["checksums"],
            "skipped": first.get("skipped", []),
            "replicas": len(results),
            "replicas_consistent": all(r["checksums"] == first["checksums"] for r in results),
        }
        if compare is not None:
            out["compare"] = compare_checksums(first["checksums"], compare)
        return out

    # ================================================================== TRL-style API
    async def trl_init_communicator(self, host: str, port: int, world_size: int | None = None,
                                    client_device_uuid: str | None = None, wire: str | None = None) -> dict:
        """TRL ``/init_communicator/``: returns at once; the workers join the group in the
        background (TRL's client creates its end after this answers). Layout (TRL's): server
        workers are ranks ``0..N-1`` (worker 0 hosts the TCPStore on ``port``), the trainer is
        rank ``N`` (``world_size - 1``); the trainer connects to the server's host.

        On NCCL the group speaks vLLM's wire (``StatelessProcessGroup`` + a unique id worker 0
        mints, a store barrier after each tensor: what TRL <= 1.10's own ``VLLMClient`` does;
        :mod:`rlserve.transfer.vllm_group`) unless ``wire`` is ``"rlserve"`` (rlserve's
        :class:`~rlserve.transfer.trl.TRLWeightSyncClient` sends it).

        Raises:
            WeightUpdateError (400): the ipc backend, a bad port, or (NCCL) the trainer on one of
                the server's GPUs.
        """
        backend = self.backend
        if backend == "ipc":
            raise WeightUpdateError("the TRL protocol needs the nccl or gloo backend (this server uses ipc)")
        if backend is None:
            backend = "gloo" if str(getattr(self.aengine.engine, "device", "cpu")).startswith("cpu") else "nccl"
        n = self.num_workers
        wire = wire or ("vllm" if backend == "nccl" else "rlserve")
        if wire == "vllm" and world_size is not None and world_size != n + 1:
            raise WeightUpdateError(f"world_size must be {n + 1} (this server's {n} worker(s) + 1 trainer), got "
                                    f"{world_size}")
        if world_size is not None and world_size != n + 1:
            logger.warning("TRL init_communicator: world_size %s ignored; the group has %d ranks", world_size, n + 1)
        if client_device_uuid and backend == "nccl":
            uuids = await self._worker_device_uuids()
            if client_device_uuid in uuids:
                raise WeightUpdateError("the trainer shares a GPU with a server worker: NCCL cannot put two ranks on "
                                        "one GPU; use the ipc backend (init_weight_transfer_engine) instead")
        info = {"backend": backend, "master_address": "127.0.0.1", "master_port": port, "rank_offset": 0,
                "world_size": n + 1, "packed": False, "wire": wire}
        InitInfo.from_dict({**self._init_defaults(), **info})  # 400 now
        self._trl_error = None
        self._trl_init_task = asyncio.get_running_loop().create_task(self._trl_run_init(info))
        return {"message": "Request received, initializing communicator"}

    async def _worker_device_uuids(self) -> set:
        res = await self.aengine.call_engines(f"{_ENGINE}device_uuids", timeout_s=self.rpc_timeout_s)
        return {u for r in res for u in r}

    async def _trl_run_init(self, info: dict) -> None:
        try:
            await self.init_engine(info)
        except BaseException as e:  # noqa: BLE001 - reported on the next TRL call
            logger.error("TRL init_communicator failed: %s", e)
            self._trl_error = e

    def _raise_trl_error(self) -> None:
        if self._trl_error is not None:
            e, self._trl_error = self._trl_error, None
            raise e

    async def trl_update_named_param(self, name: str, dtype: str, shape: list[int]) -> dict:
        """TRL ``/update_named_param/``: validate (400 on a bad name / shape / dtype), queue the
        receive, return at once; the trainer then broadcasts. A failure is reported by the next
        TRL call (and tears the group down).

        The tensors up to the next ``/reset_prefix_cache/`` (:meth:`trl_flush`) form one update
        session, opened by the first of them: each tensor is one ``update_weights`` of it and
        the flush is its ``finish``. So a TRL batch gets the SDK's guarantees: in place, every
        tensor is loaded into the live model with generation keep-paused from the first tensor
        to the flush (never served part old, part new); staged, the tensors are staged and the
        flush commits them together. A trainer that dies in between (no call for
        ``timeout_s``) is noticed by the session watchdog: staged, nothing changed; in place,
        503 until a full update lands once anything was loaded."""
        self._raise_trl_error()
        if self._init is None and (self._trl_init_task is None or self._trl_init_task.done()):
            raise WeightUpdateStateError("update_named_param: no communicator; call /init_communicator/ first")
        info = UpdateInfo(names=[name], dtype_names=[str(dtype)], shapes=[list(shape)], packed=False, partial=True)
        info.validate()
        spec, req = await self._model_spec()
        validate_against_spec(info, spec, req, check_coverage=False, tied=self._tied)
        if self._trl_queue is None:
            self._trl_queue = asyncio.Queue()
        if self._trl_worker is None or self._trl_worker.done():
            self._trl_worker = asyncio.get_running_loop().create_task(self._trl_loop())
        if self._session is not None and self._session.trl:
            self._session.last_activity = time.monotonic()
        self._trl_pending += 1
        self._trl_queue.put_nowait(info)
        return {"message": "Request received, updating named parameter"}

    async def _trl_loop(self) -> None:
        q = self._trl_queue
        while True:
            info = await q.get()
            failures = self.num_failures
            try:
                if self._trl_error is not None:
                    continue  # drop the rest of a failed batch
                if self._trl_init_task is not None and not self._trl_init_task.done():
                    await self._trl_init_task
                if self._init is None:
                    raise WeightUpdateStateError("no communicator (init failed or was closed)")
                while self._busy is not None:
                    await asyncio.sleep(0.005)
                s = self._session
                if s is None:
                    await self.start_update(None)  # the batch's session (see trl_update_named_param)
                    s = self._session
                    s.trl = True
                elif not s.trl:
                    raise WeightUpdateStateError("update_named_param during a start_weight_update session")
                await self.update_weights(info.to_dict())  # a failure runs the session's failure path
            except BaseException as e:  # noqa: BLE001
                self._trl_error = e
                s = self._session
                if s is not None and s.trl:
                    await self._fail(s, e)
                elif self.num_failures == failures:  # not recorded by a failure path yet
                    self.num_failures += 1
                    await self._teardown_group()
                    self._record(ok=False, error=f"{type(e).__name__}: {e}", protocol="trl")
            finally:
                self._trl_pending -= 1
                q.task_done()

    async def trl_flush(self, timeout_s: float | None = None) -> dict | None:
        """Wait for queued TRL updates, then commit the batch (its session's finish: staged
        tensors loaded, prefix cache reset, weight version bumped, generation resumed). The
        server's ``/reset_prefix_cache/`` route calls this first so that TRL's
        ``update_named_param``... ``reset_prefix_cache`` sequence commits in order. Returns the
        commit summary or ``None`` when nothing was pending. Raises a recorded failure of the
        batch."""
        if self._trl_queue is not None:
            await asyncio.wait_for(self._trl_queue.join(), timeout_s or self._timeout() + 60)
        self._raise_trl_error()
        s = self._session
        if s is None or not s.trl:
            return None
        fin = await self.finish_update(None)
        return {"weight_version": fin["weight_version"], "tensors": fin["tensors"], "full": fin["full"]}

    async def trl_close_communicator(self) -> dict:
        """TRL ``/close_communicator/``: flush pending updates, then leave the group. A
        start / update / finish session still open on that group fails as under
        ``/shutdown_weight_transfer_engine`` (its pause is released; in place with something
        loaded, 503 until a full update)."""
        err = None
        try:
            await self.trl_flush()
        except BaseException as e:  # noqa: BLE001
            err = e
        if self._session is not None:
            await self._preempt("close_communicator")
        await self._leave_group("the transfer group was closed (/close_communicator/) during an update")
        if err is not None:
            raise err
        return {"message": "Request received, closing communicator"}
