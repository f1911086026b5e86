"""The transfer process group: trainer + server workers, separate from any TP group.

Built on its own ``TCPStore`` (hosted by rank 0, ``is_master``) and a ``PrefixStore``, with
``ProcessGroupGloo`` / ``ProcessGroupNCCL`` constructed directly, never through
``torch.distributed.init_process_group``, so it coexists with the server's tensor-parallel
group and with a trainer's own default group (FSDP).

Every wait has a deadline: :meth:`TransferGroup.wait` polls the work handle and raises
:class:`TransferTimeoutError` after ``timeout_s`` seconds, or :class:`TransferAbortedError`
when the ``abort`` event is set. :meth:`TransferGroup.destroy` never blocks the caller: it
aborts the backend and drops the last references on a daemon thread (a gloo backend's
destructor waits for pending operations, which end at the backend's own timeout).

NCCL: the backend's own timeout is ``timeout_s + 60`` so that our deadline always fires first
and we abort the communicator ourselves; ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is set to 2
(clean up only) while the backend is built so a timed-out watchdog never kills the server.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from rlserve.distributed.group import local_address_toward, new_backend
from rlserve.server.launch import address_in_use
from rlserve.transfer.wire.store_probe import probe_store
from rlserve.errors import WeightUpdateError
from rlserve.transfer.errors import (TrainerUnreachableError, TransferAbortedError, TransferTimeoutError,
                                     WeightTransferFailedError)

logger = logging.getLogger(__name__)

#: Key prefix of every key this layer writes in the TCPStore.
STORE_PREFIX = "rlserve/weight_transfer"


def _is_timeout(e: BaseException) -> bool:
    """Whether a backend's exception is its own deadline firing (gloo: "Timed out waiting 1000ms for recv
    operation"; c10d's store: "... timeout ..."), i.e. an HTTP 504 (TransferTimeoutError), not a failure (500)."""
    msg = str(e).lower()
    return isinstance(e, TimeoutError) or "timed out" in msg or "timeout" in msg


def bind_master_store(master_address: str, timeout_s: float):
    """Rank 0's ``TCPStore``, listening now on a port the kernel picked (``.port``): hand it to
    :meth:`TransferGroup.create` (``store=``) and tell the other ranks ``.port``. No port is free
    between its choice and its use, unlike a port picked first and bound later (another
    process's ``bind(0)`` can take that one: ``EADDRINUSE``). It listens on every interface, as a
    store on a given port does (``master_address``: where this rank's own client connects, as
    for :meth:`TransferGroup.create`). Does not wait for the other ranks; ``timeout_s`` bounds
    its operations (seconds).

    Raises:
        WeightTransferFailedError: the store could not be created (no port left, say)."""
    try:
        return dist.TCPStore(master_address, 0, None, True, timedelta(seconds=float(timeout_s)), wait_for_workers=False)
    except Exception as e:  # noqa: BLE001
        raise WeightTransferFailedError(f"could not host the transfer group's TCPStore on a free port: {e}") from e


class TransferGroup:
    """One rank's handle on the transfer group.

    Args:
        backend: ``"gloo"`` or ``"nccl"``.
        master_address / master_port: the TCPStore. Rank 0 hosts it.
        rank / world_size: this rank and the group size.
        timeout_s: seconds for the store connection, the group's operations and every
            :meth:`wait`.
        device: ``torch.device`` whose tensors this rank sends (NCCL: the CUDA device; it becomes
            this thread's current device).
        session: a name both sides agree on (``init_info.session``); keys live under
            ``rlserve/weight_transfer/<session>`` so a stale store never matches a new group.

    Raises (from :meth:`create`):
        TransferTimeoutError: the other ranks did not arrive within ``timeout_s``.
        TrainerUnreachableError: (a rank other than 0) the store did not take the connection, or what listens
            there is not a TCPStore (closed, reset, or no handshake answer within ``timeout_s``:
            :func:`~rlserve.transfer.wire.store_probe.probe_store`).
        WeightTransferFailedError: the store or backend could not be built.
    """

    def __init__(self, backend: str, master_address: str, master_port: int, rank: int,
                 world_size: int, timeout_s: float, device: torch.device | None = None, session: str = ""):
        self.backend = backend
        self.master_address = master_address
        self.master_port = master_port
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.session = session
        self.device = torch.device(device) if device is not None else (
            torch.device("cpu") if backend == "gloo" else torch.device("cuda", torch.cuda.current_device()))
        self.store = None
        self.pg = None
        self.abort_event = threading.Event()
        self.abort_reason: str | None = None  # why abort() was called (named by the waits' errors)
        self._destroyed = False
        self._teardown_thread: threading.Thread | None = None

    # ------------------------------------------------------------------ setup
    @classmethod
    def create(cls, backend: str, master_address: str, master_port: int, rank: int,
               world_size: int, timeout_s: float, device: torch.device | None = None,
               warmup: bool = True, session: str = "", store=None, **kwargs) -> "TransferGroup":
        """Connect to (rank 0: host) the store, build the backend and run one all-reduce so that
        this returns only once every rank has joined. ``kwargs`` go to a subclass's constructor
        (:class:`~rlserve.transfer.backends.vllm_group.VLLMWireGroup`). A ``WeightUpdateError`` raised
        while building (e.g. a refused pickle: HTTP 400) passes through unchanged.

        ``store``: rank 0's store, already listening (:func:`bind_master_store`, whose ``.port`` is
        ``master_port``); the group owns it from here (closed with the group, also on failure)."""
        g = cls(backend, master_address, master_port, rank, world_size, timeout_s, device, session, **kwargs)
        g.store = store
        try:
            g._build()
            if warmup:
                g._warmup()
        except BaseException as e:
            g.destroy()
            if isinstance(e, WeightUpdateError):
                raise
            msg = str(e)
            if _is_timeout(e):
                raise TransferTimeoutError(
                    f"transfer group rendezvous at {master_address}:{master_port} (rank {rank}/{world_size}, "
                    f"{backend}) did not complete within {timeout_s:.0f} s: {msg}") from e
            raise WeightTransferFailedError(
                f"could not build the {backend} transfer group at {master_address}:{master_port} "
                f"(rank {rank}/{world_size}): {msg}") from e
        return g

    def _build(self) -> None:
        td = timedelta(seconds=self.timeout_s)
        if self.rank != 0:  # torch's client would wait for ever on a listener that never answers its handshake
            probe_store(self.master_address, self.master_port, self.timeout_s,
                        f"rank {self.rank}/{self.world_size}, {self.backend}")
        try:
            if self.store is None:
                self.store = self._make_store(td)
        except Exception as e:  # noqa: BLE001 - a client's failed connect is the peer's (502), not ours
            if self.rank == 0 or _is_timeout(e):
                raise
            raise TrainerUnreachableError(
                f"could not connect to the transfer group's TCPStore at {self.master_address}:{self.master_port} "
                f"(rank {self.rank}/{self.world_size}, {self.backend}): {e} -- is the trainer's store listening "
                "there (init_info.master_address / master_port)?") from e
        prefix = dist.PrefixStore(f"{STORE_PREFIX}/{self.session}" if self.session else STORE_PREFIX, self.store)
        if self.backend not in ("gloo", "nccl"):
            raise WeightTransferFailedError(f"unknown group backend {self.backend!r}")
        if self.backend == "nccl":
            torch.cuda.set_device(self.device)
        try:
            # NCCL's own timeout is ours + 60 s so that our deadline fires first
            nccl_extra = 60 if self.backend == "nccl" else 0
            # gloo binds the interface that routes to the master (the trainer), not the address
            # the hostname resolves to (often 127.0.x.1: unreachable from other hosts)
            self.pg = new_backend(self.backend, prefix, self.rank, self.world_size,
                                  timedelta(seconds=self.timeout_s + nccl_extra), nccl_async_error_handling="2",
                                  gloo_address=local_address_toward(self.master_address)
                                  if self.backend == "gloo" else None)
        except RuntimeError as e:
            raise WeightTransferFailedError(str(e)) from e

    def _make_store(self, td: timedelta):
        # The master retries a busy port for a few seconds: a group torn down just before (same
        # port, e.g. a re-init) releases its listening socket on a background thread.
        deadline = time.monotonic() + min(self.timeout_s, 10.0)
        while True:
            try:
                return dist.TCPStore(self.master_address, self.master_port, None, self.rank == 0, td,
                                     wait_for_workers=False)
            except Exception as e:  # noqa: BLE001
                if self.rank != 0 or not address_in_use(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _warmup(self) -> None:
        x = torch.ones(1, dtype=torch.float32, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        opts.timeout = timedelta(seconds=self.timeout_s)
        self.wait(self.pg.allreduce([x], opts), what="rendezvous all-reduce")
        if int(x.item()) != self.world_size:
            raise WeightTransferFailedError(f"rendezvous all-reduce gave {x.item()} != world size {self.world_size}")

    # ------------------------------------------------------------------ data
    def broadcast(self, tensor: torch.Tensor, src: int):
        """Post a broadcast of ``tensor`` from rank ``src``; returns the work handle (async)."""
        if self.pg is None:
            raise TransferAbortedError("the transfer group has been torn down")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = timedelta(seconds=self.timeout_s)
        return self.pg.broadcast([tensor], opts)

    def barrier(self) -> None:
        """All ranks meet (an all-reduce of one element, waited with the deadline)."""
        x = torch.zeros(1, dtype=torch.float32, device=self.device)
        opts = dist.AllreduceOptions()
        opts.timeout = timedelta(seconds=self.timeout_s)
        self.wait(self.pg.allreduce([x], opts), what="barrier")

    def wait(self, work, what: str = "broadcast", timeout_s: float | None = None,
             check: Callable[[], None] | None = None) -> None:
        """Wait for ``work`` with a deadline.

        Polls ``work.is_completed()`` (sleeping 0.02 → 0.5 ms: a late wake-up delays the next bucket), then ``work.wait()`` to raise the
        backend's error if it failed. NCCL: completion means the GPU finished the operation.

        Args:
            timeout_s: seconds; default ``self.timeout_s``.
            check: called on every poll; may raise to give up early (e.g. the peer's HTTP call
                failed).
        Raises:
            TransferTimeoutError, TransferAbortedError, WeightTransferFailedError.
        """
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        sleep = 0.00002
        while not work.is_completed():
            if self.abort_event.is_set():
                raise self._aborted(what)
            if check is not None:
                check()
            if time.monotonic() > deadline:
                raise TransferTimeoutError(
                    f"{what} did not complete within {self.timeout_s if timeout_s is None else timeout_s:.0f} s "
                    f"(rank {self.rank}/{self.world_size}, {self.backend}); is the peer alive?")
            time.sleep(sleep)
            sleep = min(sleep * 2, 0.0005)
        try:
            work.wait()
        except Exception as e:  # gloo: peer closed / timed out; nccl: comm error
            if _is_timeout(e):  # gloo's own recv deadline ("Timed out waiting ... for recv"): HTTP 504, not 500
                raise TransferTimeoutError(f"{what} timed out in the {self.backend} backend (rank {self.rank}/"
                                           f"{self.world_size}): {e}") from e
            raise WeightTransferFailedError(f"{what} failed (rank {self.rank}/{self.world_size}, "
                                            f"{self.backend}): {e}") from e

    def order(self, work, what: str = "broadcast") -> None:
        """Order later work after ``work`` without blocking the host where the backend allows.

        NCCL: the current CUDA stream waits for the collective (``work.wait()`` enqueues that
        wait and returns); kernels queued afterwards -- e.g. refilling the buffer it read -- run
        once it finished. The host is not blocked, so a caller must end with :meth:`wait` (or
        :meth:`wait_stream`) to apply the deadline. gloo: :meth:`wait` (the host waits).

        Raises:
            WeightTransferFailedError (NCCL reported an error), what :meth:`wait` raises (gloo).
        """
        if self.backend != "nccl":
            self.wait(work, what=what)
            return
        if self.abort_event.is_set():
            raise self._aborted(what)
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001 - a communicator error
            raise WeightTransferFailedError(f"{what} failed (rank {self.rank}/{self.world_size}, nccl): {e}") from e

    def wait_stream(self, stream, what: str = "transfer", timeout_s: float | None = None) -> None:
        """Block until everything queued on CUDA ``stream`` so far finished, with the deadline
        and abort checks of :meth:`wait` (a hung collective raises instead of hanging).

        Raises:
            TransferTimeoutError, TransferAbortedError.
        """
        ev = torch.cuda.Event()
        ev.record(stream)
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        sleep = 0.00005
        while not ev.query():
            if self.abort_event.is_set():
                raise self._aborted(what)
            if time.monotonic() > deadline:
                raise TransferTimeoutError(f"{what} did not complete within {limit:.0f} s "
                                           f"(rank {self.rank}/{self.world_size}, {self.backend}); is the peer alive?")
            time.sleep(sleep)
            sleep = min(sleep * 2, 0.001)

    # ------------------------------------------------------------------ teardown
    def abort(self, reason: str | None = None) -> None:
        """Make every current and future :meth:`wait` fail fast (within one poll, < 1 ms): a
        receive blocked on a peer that will never send (gloo does not always report a dead peer,
        NCCL never does) ends here. Does not free anything. ``reason`` is named by the errors."""
        if reason and self.abort_reason is None:
            self.abort_reason = reason
        self.abort_event.set()

    def _aborted(self, what: str) -> TransferAbortedError:
        return TransferAbortedError(f"{what} aborted" + (f": {self.abort_reason}" if self.abort_reason else ""))

    def destroy(self, wait_s: float = 0.0) -> None:
        """Tear the group down: abort the backend, drop references on a daemon thread (a gloo
        destructor waits for pending operations). Safe to call twice and after failures.

        Args:
            wait_s: wait up to this many seconds for the teardown to finish (the trainer waits
                a little so that its TCPStore port is free for a re-init); 0 never blocks.
        """
        if self._destroyed:
            if wait_s and self._teardown_thread is not None:
                self._teardown_thread.join(wait_s)
            return
        self._destroyed = True
        self.abort_event.set()
        holder = [self.pg, self.store]
        self.pg = self.store = None
        backend = self.backend

        def _run():
            try:
                if backend == "nccl" and holder[0] is not None:
                    holder[0].abort()  # unblocks pending NCCL kernels
            except Exception as e:  # pragma: no cover - depends on the backend
                logger.debug("transfer group abort: %s", e)
            finally:
                holder.clear()  # a gloo destructor waits for pending ops: here, not in the caller

        self._teardown_thread = threading.Thread(target=_run, daemon=True, name="transfer-teardown")
        self._teardown_thread.start()
        if wait_s:
            self._teardown_thread.join(wait_s)

    @property
    def torn_down(self) -> bool:
        """True once :meth:`destroy` finished releasing the backend and the store."""
        return self._destroyed and (self._teardown_thread is None or not self._teardown_thread.is_alive())

    @property
    def alive(self) -> bool:
        return self.pg is not None and not self.abort_event.is_set()
