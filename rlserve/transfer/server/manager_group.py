"""The transfer group's lifecycle on the manager: ``/init_weight_transfer_engine`` joins it,
``/shutdown_weight_transfer_engine`` (or an engine-core restart) leaves it, and the trainer's liveness
watch (:mod:`rlserve.transfer.server.liveness`, :mod:`rlserve.transfer.server.tcp_peer`) tears it down
when the trainer dies."""

from __future__ import annotations

import asyncio
import logging
import time

from rlserve.errors import WeightUpdateError, WeightUpdateStateError
from rlserve.transfer import errors as terr
from rlserve.transfer.server.address import check_master_address
from rlserve.transfer.server.liveness import PeerLiveness, StoreLiveness
from rlserve.transfer.server.tcp_peer import StoreConnectionLiveness
from rlserve.transfer.wire.protocol import InitInfo, check_group_size

logger = logging.getLogger(__name__)


class GroupRoutes:
    """Join / leave the transfer group and watch the trainer. Mixed into
    :class:`~rlserve.transfer.server.manager.WeightTransferManager` (its state and helpers live there)."""

    async def init_engine(self, init_info: dict) -> dict:
        """``POST /init_weight_transfer_engine``: every worker joins the transfer group (the
        trainer joins concurrently). Replaces a previous group; an update in progress is
        abandoned. Returns once all workers joined, at most ``timeout_s`` (+30) seconds (the +30 is the
        manager's backstop; a worker's store connection and handshake are bounded by ``timeout_s``:
        :mod:`rlserve.transfer.wire.store_probe`).

        Raises:
            WeightUpdateError (400): bad init_info, wrong backend / world size.
            WeightUpdateStateError (409): another init is running.
            TrainerUnreachableError (502): what listens at the trainer's address is not a TCPStore
                (closed, reset, other bytes, or no handshake answer within ``timeout_s``).
            TransferTimeoutError / WeightTransferFailedError: the rendezvous failed.
        """
        merged = self._init_defaults()
        if not isinstance(init_info, dict):
            raise WeightUpdateError("init_info must be a JSON object", param="init_info")
        merged.update(init_info)
        if "backend" not in init_info:
            # vLLM's trainers never name a backend (the server's config does); rlserve's SDK always
            # does. On NCCL such a trainer speaks vLLM's wire (rlserve.transfer.backends.vllm_group).
            merged["backend"] = self.backend or "gloo"
            if merged["backend"] == "nccl":
                merged.setdefault("wire", "vllm")
        info = InitInfo.from_dict(merged)
        if self.backend is not None and info.backend != self.backend:
            raise WeightUpdateError(f"this server's weight transfer backend is {self.backend!r} "
                                    f"(--weight-transfer-config), the trainer asked for {info.backend!r}",
                                    param="init_info.backend")
        n = self.num_workers
        if info.backend == "ipc":
            info.world_size = n + 1  # no group: the field is meaningless
        else:  # shared_group / rank_offset > 1: several servers share it (rlserve.transfer.sdk.fanout)
            check_group_size(info.world_size, n, info.rank_offset, info.shared_group)
        if info.backend == "ipc" and str(getattr(self.aengine.engine, "device", "cpu")).startswith("cpu"):
            raise WeightUpdateError("the ipc backend needs a CUDA server", param="init_info.backend")
        if info.master_port and info.nccl_unique_id_b64 is None:  # a store to reach: 400 now for a bad address
            await check_master_address(info.master_address, info.master_port)
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
                        "(ipc: the trainer's liveness store; send master_port 0 for none)", param="init_info.master_port")
            results = await self._run_op("init_transfer", [info.to_dict()], info.timeout_s + 30,
                                         "init_weight_transfer_engine")
            await self._model_spec()
            self._init = info
            self._ipc_refs = {}  # the workers' receivers are new
            if watch is None:
                watch = await self._server_store_liveness(info)
            elif info.backend != "ipc":
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
        secs = time.perf_counter() - t0
        logger.info("weight transfer engine ready: %s, world size %d, worker ranks %s (%.2f s)",
                    info.backend, info.world_size, ranks, secs)
        return {"status": "ok", "backend": info.backend, "world_size": info.world_size, "worker_ranks": ranks,
                "staging": self.staging, "seconds": round(secs, 6)}

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

    async def on_engine_restart(self, index: int) -> None:
        """An engine-core process died and its replacement is about to serve: the transfer
        group (which held the dead core's workers) is left, an open update fails (its trainer
        gets 409 ``no_transfer_engine`` on its next call, and re-initialises)."""
        logger.warning("engine replica %d restarted: leaving the weight transfer group", index)
        await self._preempt(f"the engine-core process of replica {index} died")
        await self._leave_group(f"the engine-core process of replica {index} died during the update")

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
        if not self.trainer_liveness or info.rank_offset == 0 or not info.master_port:
            return None
        return StoreLiveness(info.master_address, info.master_port)

    async def _server_store_liveness(self, info: InitInfo) -> StoreConnectionLiveness | None:
        """TRL's layout (worker 0 hosts the store): a watch on the trainer's connections to it,
        started (:mod:`rlserve.transfer.server.tcp_peer`); ``None`` for other layouts or when
        liveness is off."""
        if not self.trainer_liveness or info.rank_offset != 0 or info.backend == "ipc" or not info.master_port:
            return None
        res = await self._rpc("store_endpoints", info.master_port)
        watch = StoreConnectionLiveness(info.master_port, [tuple(e) for r in res for e in r])
        watch.start()
        return watch

    def _watch_liveness(self, watch: PeerLiveness | None) -> None:
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
