"""The manager's TRL routes (TRL <= 1.10 ``vllm-serve``): the communicator, per-tensor updates
queued and received in order, one update session per batch."""

from __future__ import annotations

import asyncio
import logging
import time

from rlserve.errors import NoTransferEngineError, WeightUpdateError, WeightUpdateStateError
from rlserve.transfer.server.engine_calls import TARGET as _ENGINE
from rlserve.transfer.wire.protocol import InitInfo, UpdateInfo, check_group_size, validate_against_spec

logger = logging.getLogger(__name__)


class TRLRoutes:
    """TRL's ``vllm-serve`` routes: ``/init_communicator/``, ``/update_named_param/``, the
    batch flush at ``/reset_prefix_cache/``, ``/close_communicator/``. Mixed into :class:`~rlserve.transfer.server.manager.WeightTransferManager`
    (its state and helpers live there)."""

    # ================================================================== TRL-style API
    async def trl_init_communicator(self, host: str, port: int, world_size: int | None = None,
                                    client_device_uuid: str | None = None, wire: str | None = None) -> dict:
        """TRL ``/init_communicator/``: returns at once; the workers join the group in the
        background (TRL's client creates its end after this answers). Layout (TRL's): server
        workers are ranks ``0..N-1`` (worker 0 hosts the TCPStore on ``port``), the trainer is
        rank ``N`` (``world_size - 1``); the trainer connects to the server's host.

        On NCCL the group speaks vLLM's wire (``StatelessProcessGroup`` + a unique id worker 0
        mints, a store barrier after each tensor: what TRL <= 1.10's own ``VLLMClient`` does;
        :mod:`rlserve.transfer.backends.vllm_group`) unless ``wire`` is ``"rlserve"`` (rlserve's
        :class:`~rlserve.transfer.sdk.trl.TRLWeightSyncClient` sends it).

        Raises:
            WeightUpdateError (400): the ipc backend, a bad port, a ``world_size`` that is not this
                server's workers + 1 (:func:`~rlserve.transfer.wire.protocol.check_group_size`, as
                ``/init_weight_transfer_engine`` checks it), or (NCCL) the trainer on one of the
                server's GPUs.
        """
        backend = self.backend
        if backend == "ipc":
            raise WeightUpdateError("the TRL protocol needs the nccl or gloo backend (this server uses ipc)")
        if backend is None:
            backend = "gloo" if str(getattr(self.aengine.engine, "device", "cpu")).startswith("cpu") else "nccl"
        n = self.num_workers
        wire = wire or ("vllm" if backend == "nccl" else "rlserve")
        if world_size is not None:  # the check of /init_weight_transfer_engine (TRL's layout: rank_offset 0)
            check_group_size(world_size, n, field="world_size")
        if client_device_uuid and backend == "nccl":
            uuids = await self._worker_device_uuids()
            if client_device_uuid in uuids:
                raise WeightUpdateError("the trainer shares a GPU with a server worker: NCCL cannot put two ranks on "
                                        "one GPU; use the ipc backend (init_weight_transfer_engine) instead")
        info = {"backend": backend, "master_address": "127.0.0.1", "master_port": port, "rank_offset": 0,
                "world_size": n + 1, "packed": False, "wire": wire}
        try:  # 400 now, by the checks of /init_weight_transfer_engine
            InitInfo.from_dict({**self._init_defaults(), **info})
        except WeightUpdateError as e:  # named as TRL's body names it (its "port" is init_info.master_port)
            if type(e) is not WeightUpdateError or not str(e).startswith("init_info.master_port"):
                raise
            raise WeightUpdateError("port" + str(e)[len("init_info.master_port"):], param="port") from None
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
            self._trl_error = self._trl_init_error = e

    def _raise_trl_error(self) -> None:
        if self._trl_error is not None:
            e, self._trl_error = self._trl_error, None
            raise e

    def _raise_trl_gone(self) -> None:
        """409 when the TRL group is gone: its failure (recorded for the next TRL call) is reported
        inside a conflict, not as a 500 -- nothing of this call was attempted, and the trainer's
        way out is a new ``/init_communicator/``."""
        if self._init is not None or (self._trl_init_task is not None and not self._trl_init_task.done()):
            return
        if self._trl_error is None:
            raise NoTransferEngineError("update_named_param: no communicator; call /init_communicator/ first")
        e, self._trl_error = self._trl_error, None
        raise NoTransferEngineError(f"update_named_param: no communicator (the last one failed or was torn down: "
                                    f"{type(e).__name__}: {e}); call /init_communicator/ again") from e

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
        503 until a full update lands once anything was loaded.

        Raises:
            WeightUpdateError (400): unknown name, wrong shape / dtype.
            NoTransferEngineError (409 ``no_transfer_engine``): no communicator -- never
                initialised, closed, or torn down (e.g. by a failed batch, a shutdown or another
                trainer's init: the message names why); call ``/init_communicator/`` again.
            A recorded failure of the batch in progress while its group is still up (500/504).
        """
        self._raise_trl_gone()
        self._raise_trl_error()
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
        batch, and :class:`~rlserve.transfer.errors.NonFiniteWeightsError` (400) when one of its
        tensors held NaN / inf (nothing is committed; in place, 503 until a full update)."""
        if self._trl_queue is not None:
            await asyncio.wait_for(self._trl_queue.join(), timeout_s or self._timeout() + 60)
        self._raise_trl_error()
        s = self._session
        if s is None or not s.trl:
            return None
        if s.refused is not None:  # a tensor held NaN / inf: the whole batch is refused
            await self._fail(s, s.refused)
            raise s.refused
        fin = await self.finish_update(None)
        return {"weight_version": fin["weight_version"], "tensors": fin["tensors"], "full": fin["full"]}

    async def trl_close_communicator(self) -> dict:
        """TRL ``/close_communicator/``: flush pending updates, then leave the group. A
        start / update / finish session still open on that group fails as under
        ``/shutdown_weight_transfer_engine`` (its pause is released; in place with something
        loaded, 503 until a full update). After an ``/init_communicator/`` that failed (no
        trainer joined, a cancelled rendezvous) there is no group: a 200 no-op whose message
        names that failure (it answered 500 / 504, the init's own error, before)."""
        e = self._trl_error
        if e is not None and e is self._trl_init_error and self._init is None and self._session is None \
                and not self._trl_pending:
            self._trl_error = None
            return {"message": f"no communicator to close: the last /init_communicator/ failed "
                               f"({type(e).__name__}: {e})"}
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
