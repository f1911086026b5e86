"""Trainer SDK, engines: :class:`TrainerWeightTransferEngine` (``send_weights``: start ->
update -> finish, re-init after a failure) and :class:`GroupTrainerEngine`, the gloo / NCCL
engine (trainer = rank 0 of a process group with every server worker). The ipc engine is
:mod:`rlserve.transfer.sdk.ipc_engine`."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
import uuid
from typing import Callable

import torch

from rlserve.errors import WeightUpdateStateError
from rlserve.transfer.errors import TransferAbortedError, TransferTimeoutError, WeightTransferFailedError
from rlserve.transfer.backends.group import TransferGroup, bind_master_store
from rlserve.transfer.wire.packing import (
    BucketBuffers,
    bucket_checksums_from_tensors,
    plan_buckets,
)
from rlserve.transfer.multi_tensor import tensor_checksums
from rlserve.transfer.wire.protocol import UpdateInfo, dtype_to_name
from rlserve.transfer.sdk.sender import send_packed, send_unpacked
from rlserve.transfer.sdk.client import HTTPWeightSyncClient, WeightSyncConflictError
from rlserve.transfer.sdk.init_info import TrainerInitInfo, _port_in_use
from rlserve.transfer.sdk.sources import TensorListSource

logger = logging.getLogger(__name__)


# ============================================================================ engines
class TrainerWeightTransferEngine:
    """What :meth:`WeightTransferTrainerFactory.trainer_init` returns.

    Attributes:
        init_info: the trainer init info.
        client: the HTTP client (``None`` on ranks != 0).
        source: the weight source.
        last_stats: ``{"bytes", "buckets", "seconds", "gbps", "phases_s", ...}`` of the last
            ``send_weights``; ``phases_s`` (seconds): ``metadata``, ``checksum_pass`` (gloo / NCCL:
            the per-tensor checksums before the data), ``start_call``, ``send`` (data + the
            ``update_weights`` call(s)), ``finish_call``; ``server``: the ``update_weights``
            answer (``worker_seconds``, ``worker_phases_s``: the server's own phases).
        init_stats: the last init handshake (gloo / NCCL): ``{"seconds", "phases_s": {"group":
            seconds until this side's process group was up (the rendezvous), "init_call": until
            the server answered /init_weight_transfer_engine}, "server": that answer}``.
    """

    def __init__(self, init_info: TrainerInitInfo, client: HTTPWeightSyncClient | None, source):
        self.init_info = init_info
        self.client = client
        self.source = source
        self.last_stats: dict = {}
        self.init_stats: dict = {}
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlserve-weight-sync-http")
        self._closed = False

    # subclasses
    def _connect(self) -> None:
        raise NotImplementedError

    def _send(self, info: UpdateInfo, declared: dict) -> dict:
        raise NotImplementedError

    def _teardown(self) -> None:
        pass

    def _send_one_call(self, partial: bool, weight_version: str | None) -> tuple[dict, dict] | None:
        """Subclasses that can push the whole update in one ``/sync_weights`` call do it here and
        return ``(stats, finish answer)``; ``None``: use start / update / finish."""
        return None

    @property
    def is_sender(self) -> bool:
        return self.init_info.rank == 0

    # public
    def reinit(self) -> None:
        """Tear down and redo the init handshake (server + own group)."""
        self._teardown()
        if self.is_sender:
            self._connect()

    def _metadata_info(self, partial: bool) -> UpdateInfo:
        meta = self.source.metadata()
        info = UpdateInfo(
            names=[m[0] for m in meta], dtype_names=[dtype_to_name(m[1]) for m in meta],
            shapes=[list(m[2]) for m in meta], packed=self.init_info.packed,
            packed_buffer_size_bytes=self.init_info.packed_buffer_size_bytes,
            packed_num_buffers=self.init_info.packed_num_buffers, partial=partial,
            lora=getattr(self.source, "lora", None))  # an adapter-only update (sdk/lora_source.py)
        info.validate()
        return info

    def _source_is_persistent(self) -> bool:
        """Whether the source yields tensors that exist anyway (a plain module's parameters with
        no dtype cast, a TensorListSource's tensors): listing them all at once costs no memory.
        FSDP (DTensor) parameters and casts create a tensor per item: those are streamed."""
        if isinstance(self.source, TensorListSource):
            return True
        mod = getattr(self.source, "module", None)
        if mod is None or getattr(self.source, "dtype", None) is not None:
            return False
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # pragma: no cover
            return True
        return not any(isinstance(p, DTensor) for p in mod.parameters())

    def _checksums_after_data(self, info: UpdateInfo) -> bool:
        """gloo / NCCL packed with checksums: each bucket's checksum is taken from the packed buffer
        and sent after the data (``update_info.checksums_after_data``), with no pass over the
        tensors before the update. SmolLM2-135M in fp32 on the H200 host's 16 cores: that pass
        took 15-75 ms before any byte moved."""
        return bool(self.init_info.checksums and self.init_info.backend != "ipc" and info.packed)

    def _checksum_pass(self, info: UpdateInfo) -> list[int] | None:
        if not self.init_info.checksums or self.init_info.backend == "ipc" or info.checksums_after_data:
            return None  # ipc: checksummed per packed bucket, right before its call
        tensors = (t for _n, t in self.source.named_tensors())
        if self._source_is_persistent():
            tensors = list(tensors)  # the module's own tensors: one Triton launch on a GPU
        per_tensor = tensor_checksums(tensors)
        if not self.is_sender:
            return None
        if not info.packed:
            return per_tensor
        plan = plan_buckets(info.names, info.dtypes(), info.shapes, info.packed_buffer_size_bytes)
        return bucket_checksums_from_tensors(plan, per_tensor)

    def send_weights(self, weight_version: str | None = None, partial: bool = False) -> dict:
        """Push the source's current weights: start → update (+ data) → finish.

        Args:
            weight_version: version label to commit; ``None``: the server increments its own.
            partial: the source holds only some parameters (e.g. ``ModuleSource(include=...)``).
        Returns:
            The server's ``finish_weight_update`` answer (``{"weight_version": ...}``) on rank 0,
            ``{}`` on other ranks. Timing in :attr:`last_stats`.
        Raises:
            WeightSyncHTTPError (server refused; 400 = bad metadata, nothing changed),
            WeightTransferFailedError / TransferTimeoutError (the transfer broke; the group was
            torn down and the next call re-initialises).
        """
        if self._closed:
            raise WeightUpdateStateError("this trainer engine was shut down")
        t0 = time.perf_counter()
        if not self.is_sender:
            # follow rank 0's collectives (FSDP full_tensor gathers) in the same order
            info = self._metadata_info(partial)
            info.checksums_after_data = self._checksums_after_data(info)
            self._checksum_pass(info)
            for _ in self.source.named_tensors():
                pass
            return {}
        if getattr(self, "_broken", False):
            self.reinit()
        one = self._guarded(self._send_one_call, partial, weight_version)
        if one is not None:
            stats, fin = one
            return self._done(stats, fin, t0, {})
        info = self._metadata_info(partial)
        info.checksums_after_data = self._checksums_after_data(info)
        t_meta = time.perf_counter()
        info.checksums = self._checksum_pass(info)
        declared = info.to_dict()
        t_ck = time.perf_counter()
        try:
            self.client.start_weight_update(declared)
        except WeightSyncConflictError as e:
            if e.code != "no_transfer_engine":
                raise
            # the server dropped its transfer engine (shut down, idle watchdog, restart): nothing
            # of this update has moved yet, so join again and start once more
            logger.warning("%s: re-initialising the transfer engine", e)
            self.reinit()
            self.client.start_weight_update(declared)
        t_start = time.perf_counter()
        stats = self._guarded(self._send, info, declared)
        t_send = time.perf_counter()
        fin = self.client.finish_weight_update(weight_version)
        return self._done(stats, fin, t0, {"metadata": t_meta - t0, "checksum_pass": t_ck - t_meta,
                                           "start_call": t_start - t_ck, "send": t_send - t_start,
                                           "finish_call": time.perf_counter() - t_send})

    def _guarded(self, fn, *args):
        """``fn(*args)``; if it raises, the transfer is broken: tear down (the next
        ``send_weights`` re-initialises) and re-raise."""
        try:
            return fn(*args)
        except BaseException:
            self._broken = True
            self._teardown()
            raise

    def _done(self, stats: dict, fin: dict, t0: float, phases: dict) -> dict:
        """Complete :attr:`last_stats` (totals, version, GB/s, ``phases_s``); returns ``fin``."""
        stats.update(total_seconds=time.perf_counter() - t0, weight_version=fin.get("weight_version"))
        stats["phases_s"] = {**stats.get("phases_s", {}), **phases}
        if stats.get("bytes") and stats.get("seconds"):
            stats["gbps"] = stats["bytes"] / stats["seconds"] / 1e9
        self.last_stats = stats
        return fin

    def shutdown(self) -> None:
        """Leave the transfer group (server and trainer sides). Never raises for a dead server."""
        if self._closed:
            return
        self._closed = True
        if self.is_sender and self.client is not None:
            try:
                self.client.shutdown_weight_transfer_engine()
            except Exception as e:
                logger.warning("shutdown_weight_transfer_engine: %s", e)
        self._teardown()
        self._pool.shutdown(wait=False, cancel_futures=True)


#: Seconds a trainer whose broadcast failed waits for the server's answer to ``update_weights``
#: (its error says why, e.g. a refused update; gloo's only says the connection closed).
_SERVER_ANSWER_WAIT_S = 30.0


def _raise_if_failed(fut: cf.Future) -> Callable[[], None]:
    """A ``check`` for :meth:`TransferGroup.wait`: raise the HTTP call's error as soon as it
    failed (a server that refused the update never joins the broadcast)."""
    def check() -> None:
        if fut.done() and fut.exception() is not None:
            raise fut.exception()
    return check


class GroupTrainerEngine(TrainerWeightTransferEngine):
    """gloo / NCCL: the trainer is rank 0 of a process group with every server worker."""

    def __init__(self, init_info, client, source):
        super().__init__(init_info, client, source)
        self.group: TransferGroup | None = None
        self._buffers = BucketBuffers()  # packed send buffers, kept across syncs
        self._broken = False
        self._port_busy = False
        # master_port 0: every init hosts its store on a port the kernel picks, bound before the
        # server hears of it (bind_master_store); init_info.master_port then names the last one
        self._pick_port = not init_info.master_port
        if init_info.backend == "nccl":
            dev = getattr(init_info, "device", None)
            self.device = torch.device(dev) if dev else torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        if self.is_sender:
            self._connect()

    def _connect(self) -> None:
        ii = self.init_info
        store = None
        if not self._pick_port and self._port_busy and _port_in_use(ii.master_port):
            logger.warning("the previous transfer group still holds port %s (a broken transfer: an operation "
                           "can stay pending until its timeout); re-initialising on a fresh port", ii.master_port)
            self._pick_port = True
        if self._pick_port:
            store = bind_master_store(ii.master_address, ii.timeout_s)  # listening before the server is told
            ii.master_port = store.port
        self._port_busy = False
        server_init = ii.to_server_init_info()
        server_init["session"] = uuid.uuid4().hex
        self.client.session = None  # the init itself, and a failed one, carry no session
        http = self._pool.submit(self.client.init_weight_transfer_engine, server_init, ii.timeout_s + 30)
        # a daemon thread, not a pool: when the server refuses (e.g. 404, no transfer config) the
        # rendezvous waits for ranks that never come, and a pool thread would hold the
        # interpreter's exit for up to timeout_s
        grp = _run_in_daemon_thread("rlserve-transfer-rendezvous", TransferGroup.create, ii.backend,
                                    ii.master_address, ii.master_port, 0, ii.world_size, ii.timeout_s,
                                    self.device, session=server_init["session"], store=store)
        t0 = time.perf_counter()
        ends: dict[str, float] = {}
        http.add_done_callback(lambda _f: ends.setdefault("init_call", time.perf_counter() - t0))
        grp.add_done_callback(lambda _f: ends.setdefault("group", time.perf_counter() - t0))
        try:
            done, _ = cf.wait([http, grp], timeout=ii.timeout_s + 60, return_when=cf.FIRST_EXCEPTION)
            if http.done() and http.exception() is not None:
                raise http.exception()
            if grp.done() and grp.exception() is not None:
                # the server's answer usually says more
                try:
                    http.result(timeout=min(10.0, ii.timeout_s))
                except Exception as e:
                    raise e from grp.exception()
                raise grp.exception()
            self.group = grp.result(timeout=ii.timeout_s + 60)
            ans = http.result(timeout=ii.timeout_s + 60)
            self.client.session = server_init["session"]
            self.init_stats = {"seconds": time.perf_counter() - t0,
                               "phases_s": {"group": ends.get("group"), "init_call": ends.get("init_call")},
                               "server": ans if isinstance(ans, dict) else {}}
        except BaseException:
            def _cleanup(f=grp):
                try:
                    f.result().destroy()
                except BaseException:
                    pass
            threading.Thread(target=_cleanup, daemon=True).start()
            self.group = None
            raise
        self._broken = False

    def _teardown(self) -> None:
        self._buffers.release()
        if self.group is not None:
            self.group.destroy(wait_s=5.0)  # free the store's port for a re-init
            # after a broken transfer the old store can outlive the teardown (a pending gloo
            # operation, or an exception's traceback, still holds the process group): the next
            # _connect checks whether its port is still bound (a refused update, whose
            # operations all completed, leaves it free: the same port is used again)
            self._port_busy = self._broken or not self.group.torn_down
        self.group = None

    def _send(self, info: UpdateInfo, declared: dict) -> dict:
        if self.group is None:
            raise TransferAbortedError("not connected: call reinit()")
        ii = self.init_info
        n_buckets = len(plan_buckets(info.names, info.dtypes(), info.shapes, info.packed_buffer_size_bytes)) \
            if info.packed else len(info.names)
        http = self._pool.submit(self.client.update_weights, declared, ii.timeout_s * (n_buckets + 2))
        check = _raise_if_failed(http)
        fn = send_packed if info.packed else send_unpacked
        try:
            kw = {"buffers": self._buffers} if info.packed else {}
            stats = fn(self.group, info, self.source.named_tensors(), self.device, check=check, **kw)
        except Exception as e:
            # Prefer the server's explanation: a server that refuses the update (e.g. a layout
            # mismatch, 400) tears the group down before it answers, so the broadcast often
            # fails first ("Connection closed by peer"); its answer follows within moments. (An
            # error of this side -- a source yielding other tensors, a timeout -- is raised at once.)
            closed = isinstance(e, WeightTransferFailedError) and \
                not isinstance(e, (TransferTimeoutError, TransferAbortedError))
            try:
                http.result(timeout=min(ii.timeout_s, _SERVER_ANSWER_WAIT_S) if closed else 0)
            except Exception as he:  # noqa: BLE001 - the server's error wins
                if he is not e and not isinstance(he, cf.TimeoutError):
                    raise he from e
            raise
        ans = http.result(timeout=ii.timeout_s * (n_buckets + 2))
        stats["server"] = ans
        return stats


def _liveness_store(host: str, timeout_s: float):
    """A ``TCPStore`` this process hosts on a free port (``.port``) for the server's liveness
    watch of an ipc trainer (no process group there): its connection closes when this process
    dies, which the server notices within about a second (:mod:`rlserve.transfer.server.liveness`)."""
    import torch.distributed as dist
    from datetime import timedelta

    return dist.TCPStore(host, 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)


def _run_in_daemon_thread(name: str, fn, *args, **kwargs) -> cf.Future:
    """``fn(*args, **kwargs)`` on a daemon thread; its result or exception in the returned future."""
    fut: cf.Future = cf.Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            fut.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut
