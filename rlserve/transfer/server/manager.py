"""Server-side weight-sync state machine: :class:`WeightTransferManager`.

The HTTP routes (``rlserve/server/weight_routes.py``) call it; it reaches every engine replica
(in its engine-core process, or on a thread) through ``AsyncEngine.call_engines`` of the
functions in :mod:`rlserve.transfer.server.engine_calls`, and every TP worker through
``engine.collective_rpc`` of the functions in :mod:`rlserve.transfer.server.worker_ext`.

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
  (:mod:`rlserve.transfer.server.liveness`: its TCPStore connection closes) during init ... finish,
  inside a bucket receive as between calls: the update in progress fails as above (a receive
  blocked on the dead peer is aborted), and the group is torn down;
- an open update session that sees no call for ``timeout_s`` seconds is abandoned the same way
  (a live trainer that stopped calling never leaves the server paused);
- every commit resets the prefix cache and sets the weight version (auto-incremented when the
  trainer gives none, past every label the server used; a label already used is refused: 409
  ``weight_version_in_use``); whether the weights are served is ``AsyncEngine.weights``'
  (:mod:`rlserve.engine.front.weight_state`): lost weights (a failed update, a level-2 sleep, an
  engine-core restart) come back once syncs committed since have written every parameter.

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
import time
import uuid

from rlserve.errors import ModelUnavailableError, WeightUpdateError, WeightUpdateStateError
from rlserve.transfer import errors as terr
from rlserve.transfer.server.engine_calls import TARGET as _ENGINE
from rlserve.transfer.server.liveness import PeerLiveness
from rlserve.transfer.wire.protocol import BACKENDS, DEFAULT_TIMEOUT_S, InitInfo
from rlserve.transfer.wire.header import LayoutMismatchError
from rlserve.transfer.wire.safe_pickle import UnsafePickleError
from rlserve.transfer.server.manager_control import GenerationControl
from rlserve.transfer.server.manager_group import GroupRoutes
from rlserve.transfer.server.manager_info import InfoRoutes
from rlserve.transfer.server.manager_lora import LoRASyncRoutes
from rlserve.transfer.server.manager_trl import TRLRoutes
from rlserve.transfer.server.manager_update import UpdateRoutes
from rlserve.transfer.server.session import _Session

logger = logging.getLogger(__name__)

_WORKER = "rlserve.transfer.server.worker_ext"
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
    "NonFiniteWeightsError": terr.NonFiniteWeightsError,  # 400 non_finite_weights: a NaN / inf was synced
    "TransferTimeoutError": terr.TransferTimeoutError,
    "TrainerUnreachableError": terr.TrainerUnreachableError,  # 502: no trainer's store at the address
    "TransferAbortedError": terr.TransferAbortedError,
    "WeightTransferFailedError": terr.WeightTransferFailedError,
    "DeviceOutOfMemoryError": terr.DeviceOutOfMemoryError,  # 507: the worker's room check refused it
    "OutOfMemoryError": terr.DeviceOutOfMemoryError,  # 507: torch.OutOfMemoryError (an allocation mid-update)
}


def check_transfer_config(transfer_config: dict | None, staging: str = "none", device: str | None = None) -> dict:
    """``--weight-transfer-config`` and ``--weight-staging`` checked (``rlserve serve`` calls
    this before any engine starts, with ``device``; :class:`WeightTransferManager` again).
    Returns a copy of the config.

    Args:
        device: the engine's device type (``"cpu"``, ``"cuda"``), when known: ipc needs CUDA
            (refused); nccl too, but ``trl vllm-serve`` passes it on any machine, so on the CPU
            it is a warning (generation works).

    Raises:
        ValueError: an unknown key, a backend not in ``BACKENDS`` (or ipc on the CPU), a
            staging mode not in ``STAGING_MODES``, ``direct_receive`` / ``trainer_liveness``
            not a boolean, an init_info default (``timeout_s``, ``packed*``) that
            ``/init_weight_transfer_engine`` would refuse (the same check, its message).
    """
    cfg = dict(transfer_config or {})
    unknown = set(cfg) - _CONFIG_KEYS
    if unknown:
        raise ValueError(f"weight transfer config: unknown key(s) {sorted(unknown)}; known: {sorted(_CONFIG_KEYS)}")
    if cfg.get("backend") is not None and cfg["backend"] not in BACKENDS:
        raise ValueError(f"weight transfer backend must be one of {BACKENDS}, got {cfg['backend']!r}")
    if staging not in STAGING_MODES:
        raise ValueError(f"weight staging must be one of {STAGING_MODES}, got {staging!r}")
    for key in ("direct_receive", "trainer_liveness"):
        if not isinstance(cfg.get(key, True), bool):
            raise ValueError(f"weight transfer config: {key} must be true or false, got {cfg[key]!r}")
    if device == "cpu" and cfg.get("backend") == "ipc":
        raise ValueError("weight transfer backend 'ipc' shares CUDA memory; this server runs on --device cpu: use "
                         "{\"backend\": \"gloo\"}")
    if device == "cpu" and cfg.get("backend") == "nccl":  # `trl vllm-serve` always passes it: serving still works
        logger.warning("weight transfer backend 'nccl' on --device cpu: generation works, a weight sync cannot "
                       "(NCCL needs CUDA); use {\"backend\": \"gloo\"} to sync weights on the CPU")
    defaults = {k: v for k, v in cfg.items() if k in _INIT_DEFAULT_KEYS}
    try:  # a placeholder peer: only the defaults are under test
        InitInfo.from_dict({"backend": "gloo", "master_port": 1, **defaults})
    except WeightUpdateError as e:
        raise ValueError("weight transfer config: " + str(e).removeprefix("init_info.")) from None
    return cfg


def _amend(err: BaseException, note: str) -> None:
    """Append ``note`` (what the failure did to the served model) to ``err``'s message, which the
    caller re-raises to the trainer (HTTP error body); ``err`` unchanged if its first arg is not a string."""
    if err.args and isinstance(err.args[0], str) and note not in err.args[0]:
        err.args = (err.args[0] + note,) + err.args[1:]


class WeightTransferManager(GroupRoutes, UpdateRoutes, GenerationControl, InfoRoutes, TRLRoutes, LoRASyncRoutes):
    """The server's weight-sync control plane.

    Args:
        aengine: the :class:`~rlserve.engine.front.async_engine.AsyncEngine` (``call_engines``,
            ``pause``/``resume``/``is_paused``, ``set_weight_version``, ``set_unavailable``,
            ``reset_prefix_cache``, ``config``).
        transfer_config: ``--weight-transfer-config`` JSON: ``{"backend": "gloo"|"nccl"|"ipc"}``
            plus optional defaults for ``init_info`` (``timeout_s``, ``packed``,
            ``packed_buffer_size_bytes``, ``packed_num_buffers``). A trainer asking for another
            backend is refused (400). ``"direct_receive": false`` keeps packed gloo updates of
            a CPU model going through the receive buffers (default true: from the second
            identical update on they land straight in the parameters, see
            :mod:`rlserve.transfer.server.direct`). ``"trainer_liveness": false`` stops watching the
            trainer's TCPStore (:mod:`rlserve.transfer.server.liveness`; default true): a dead trainer
            is then noticed by ``timeout_s`` only.
        staging: ``"none"`` (in place), ``"device"`` or ``"host"``.
        rpc_timeout_s: seconds for one short worker RPC (poll, abort, status).
        poll_interval_s: the longest pause between progress polls of a running transfer (seconds;
            polls start 0.2 ms apart and back off to this).
        check_finite: refuse an update whose tensor holds NaN / inf (``--weight-check-finite``,
            default on; :mod:`rlserve.transfer.finite`): 400 ``non_finite_weights`` naming it,
            staged the old weights stay, in place 503 until a complete good update.

    Raises:
        ValueError: bad ``transfer_config`` or ``staging``.
    """

    def __init__(self, aengine, transfer_config: dict | None = None, staging: str = "none",
                 rpc_timeout_s: float = 60.0, poll_interval_s: float = 0.005, check_finite: bool = True):
        cfg = check_transfer_config(transfer_config, staging)
        self.aengine = aengine
        self.config = cfg
        self.backend: str | None = cfg.get("backend")
        self.staging = staging
        self.direct_receive: bool = cfg.get("direct_receive", True)
        self.trainer_liveness: bool = cfg.get("trainer_liveness", True)
        self.check_finite = bool(check_finite)
        self.rpc_timeout_s = float(rpc_timeout_s)
        self.poll_interval_s = float(poll_interval_s)
        self._init: InitInfo | None = None
        self._session: _Session | None = None
        self._init_cancelled: str | None = None  # why a pending init was cancelled (see _preempt)
        self._busy: str | None = None
        self._spec: tuple[dict, set] | None = None
        self._tied: dict[str, str] = {}  # tied_checkpoint_names(), set by _model_spec
        # ipc_handles_ref -> the validated metadata of its tensors (every worker holds the ref)
        self._ipc_refs: dict[str, dict] = {}
        self._watchdog: asyncio.Task | None = None
        # the trainer's liveness (rlserve.transfer.server.liveness), watched from init to teardown
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
        self._trl_init_error: BaseException | None = None  # the last failed TRL init's (close: a no-op)
        self._trl_pending = 0  # update_named_param calls queued or running
        if hasattr(aengine, "resume_deferral"):  # a resume during an in-place update waits for its end
            aengine.resume_deferral = self.defer_resume
        restarter = getattr(aengine, "restarter", None)  # rlserve.engine.front.core_restart
        if restarter is not None:
            restarter.listeners.append(self.on_engine_restart)

    # ================================================================== helpers
    #: sleep mode's front (``rlserve.engine.front.async_sleep.AsyncSleep``), set by the server when
    #: ``--enable-sleep-mode`` is on: every update session asks it first (``before_weight_sync``)
    sleep_mode = None

    def sleep_blocker(self) -> str | None:
        """Why a ``/sleep`` must be refused now (409), or None: an update session is open, a
        call is running, or TRL tensors are queued (their weights would land in released
        memory)."""
        if self._session is not None:
            return "a weight update is in progress (finish or shut it down first)"
        if self._busy is not None:
            return f"a weight-transfer {self._busy} call is running"
        if self._trl_pending:
            return f"{self._trl_pending} TRL update_named_param tensor(s) are queued"
        return None

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
        # (the front's copy of a committed version is set by finish, with the names written)
        committed = [r["committed_version"] for r in res if r.get("committed_version") is not None]
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
        # an adapter's ipc receive (megabytes, no peer to wait for) runs inline on the engine
        # thread as well: its end is seen in the answer of the call that starts it
        lora_ipc = session is not None and session.lora is not None and self._init is not None \
            and self._init.backend == "ipc" and start_fn == "start_receive"
        block = _POLL_BLOCK_S if (commit or lora_ipc or self.aengine.is_paused()) else 0.0
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
            if results:
                session.buckets_done = min(int(r.get("applied") or 0) + int(r.get("staged") or 0) for r in results)
            if all(r.get("done") for r in results):
                session.in_doubt = False
        failed = [r for r in results if r.get("done") and not r.get("ok")]
        if failed:
            failed.sort(key=lambda r: r.get("error_type") in ("TransferAbortedError", "WeightTransferFailedError"))
            r = failed[0]
            kind = r.get("error_type")
            cls = _ERRORS.get(kind, terr.WeightTransferFailedError)
            # the worker's class is named once: by the class raised here, or (another class,
            # e.g. a RuntimeError raised as WeightTransferFailedError) in the message
            detail = r.get("error") if kind == cls.__name__ else f"{kind}: {r.get('error')}"
            raise cls(f"{what} failed on a server worker: {detail}")
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

    async def _mark_unavailable(self, reason: str) -> None:
        """Generation answers 503 with ``reason`` until a full update lands, and the requests in
        flight or held end now with the same error (:meth:`AsyncEngine.fail_all`): frozen by the
        update's pause or not, their KV cache holds the old weights' keys and values and the
        model is now part old, part new."""
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
        elif self._staging_of(session) != "none":
            try:
                await self._rpc("discard")
            except Exception:  # noqa: BLE001
                pass
        if session is not None:
            if self._staging_of(session) != "none":
                _amend(err, "; the served weights are unchanged (staged update)")
            elif session.applied or session.in_doubt:
                _amend(err, "; in place (--weight-staging none) parameters had already changed, so generation "
                            "answers 503 model_unavailable until a full weight update lands (--weight-staging host "
                            "or device keeps the old weights serving when an update is refused)")
                await self._mark_unavailable(f"a weight update failed after it had changed some parameters ({msg}); "
                                             "generation resumes once a full weight update lands")
            await self._end_session(session)
        self._record(ok=False, error=msg, staging=self.staging, backend=self._init.backend if self._init else self.backend,
                     **({"buckets_done": session.buckets_done} if session is not None else {}),
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
