"""vLLM's NCCL wire: the transfer group of an unmodified vLLM (or TRL) trainer.

A :class:`~rlserve.transfer.backends.group.TransferGroup` whose rendezvous and communicator are vLLM's
(``StatelessProcessGroup`` + ``PyNcclCommunicator``, vLLM 0.32), so that vLLM's
``NCCLTrainerWeightTransferEngine`` (what TRL >= 1.11's ``VLLMClient`` uses) and TRL <= 1.10's
legacy ``/init_communicator/`` client can sync into rlserve:

1. the store (:class:`~rlserve.transfer.wire.vllm_store.StatelessStore`): vLLM's trainer is rank 0 and
   hosts it (``init_info.rank_offset`` 1); with TRL's legacy layout (``rank_offset`` 0) server
   worker 0 is rank 0 and hosts it, the trainer is the last rank;
2. the unique id: rank 0 mints it (``ncclGetUniqueId``) and stores its pickle at
   ``broadcast_from/0/0``; the other ranks read it through the restricted unpickler (vLLM's
   ``ncclUniqueId`` class only, exactly 128 bytes: anything else is a 400, ``unsafe_pickle``).
   ``init_info.nccl_unique_id_b64`` (vLLM's torch-free trainers) gives the 128 bytes instead and
   skips the store;
3. ``ncclCommInitRank(world_size, id, rank)`` on the worker's GPU (:mod:`rlserve.transfer.backends.nccl_lib`)
   and vLLM's warm-up: a one-element float32 zeros all-reduce.

Data: what the receiver posts (:mod:`rlserve.transfer.server.receiver` with ``init_info.wire ==
"vllm"``): packed, one uint8 broadcast per bucket, the raw bytes of the bucket's tensors in
metadata order with no header, padding or checksum (:func:`plan_vllm_buckets`); unpacked, one
broadcast per tensor in its own dtype. TRL's legacy layout: one tensor per
``/update_named_param/``, followed by a store barrier (:meth:`after_update`).

Bounds: every collective's completion is polled with the group's deadline (a CUDA event per
operation) and a timeout or an abort ends the communicator with ``ncclCommAbort``. The store
waits poll the abort event. ``ncclCommInitRank`` itself blocks until every rank arrived; it runs on
the worker's rendezvous thread (a daemon), whose wait the manager bounds by ``timeout_s``.
"""

from __future__ import annotations

import base64
import binascii
import logging

import torch

from rlserve.errors import WeightUpdateError
from rlserve.transfer.errors import TransferAbortedError, WeightTransferFailedError
from rlserve.transfer.backends.group import TransferGroup
from rlserve.transfer.wire.packing import Bucket, plan_buckets
from rlserve.transfer.wire.safe_pickle import UnsafePickleError
from rlserve.transfer.wire.vllm_store import (
    UNIQUE_ID_BYTES,
    StatelessStore,
    dumps_unique_id,
    loads_unique_id,
)

logger = logging.getLogger(__name__)


def plan_vllm_buckets(names, dtypes, shapes, bucket_size_bytes: int) -> list[Bucket]:
    """vLLM's packed layout (``packed_nccl_broadcast_consumer``): tensors back to back in metadata
    order, no alignment or padding; a bucket closes right after the tensor that takes its bytes
    past ``bucket_size_bytes`` (so a tensor larger than that is sent in a bucket with what
    preceded it). ``Bucket.nbytes`` is the exact message size. Raises ValueError for a size < 1."""
    return plan_buckets(names, dtypes, shapes, bucket_size_bytes, align=1)


def decode_unique_id_b64(s: str) -> bytes:
    """``init_info.nccl_unique_id_b64`` -> 128 bytes (standard base64, as vLLM requires).

    Raises:
        WeightUpdateError: not standard base64, or not 128 bytes.
    """
    try:
        raw = base64.b64decode(s.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError, AttributeError):
        raise WeightUpdateError("init_info.nccl_unique_id_b64 is not valid standard base64",
                                param="init_info.nccl_unique_id_b64") from None
    if len(raw) != UNIQUE_ID_BYTES:
        raise WeightUpdateError(f"init_info.nccl_unique_id_b64 must decode to {UNIQUE_ID_BYTES} bytes, got {len(raw)}",
                                param="init_info.nccl_unique_id_b64")
    return raw


class _Comm:
    """An NCCL communicator handle; ``abort()`` is what :meth:`TransferGroup.destroy` calls."""

    def __init__(self, lib, comm: int):
        self.lib = lib
        self.comm = comm
        self.closed = False

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self.lib.abort(self.comm)


class _Work:
    """One queued NCCL operation: done once the CUDA event recorded after it completed."""

    def __init__(self, group: "VLLMWireGroup", event: torch.cuda.Event, what: str):
        self.group = group
        self.event = event
        self.what = what

    def _error(self) -> int:
        comm = self.group.pg
        if comm is None or comm.closed:
            raise TransferAbortedError(f"{self.what}: the communicator was aborted")
        code = comm.lib.async_error(comm.comm)
        return 0 if code in (0, 7) else code

    def is_completed(self) -> bool:
        return bool(self.event.query()) or self._error() != 0

    def wait(self) -> None:
        """Raise the communicator's error, else order the current stream after the operation."""
        code = self._error()
        if code:
            raise WeightTransferFailedError(f"{self.what}: NCCL reported error {code} "
                                            f"({self.group.pg.lib.error_string(code)})")
        torch.cuda.current_stream(self.group.device).wait_event(self.event)


class VLLMWireGroup(TransferGroup):
    """The transfer group on vLLM's wire (see the module docstring). Built through
    :meth:`TransferGroup.create` with ``backend="nccl"``.

    Args (beyond :class:`TransferGroup`'s):
        unique_id_b64: vLLM's ``nccl_unique_id_b64`` (no store), or ``None``.
        barrier_after_update: run the store barrier after each update (TRL's legacy layout).
    """

    def __init__(self, *args, unique_id_b64: str | None = None, barrier_after_update: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.unique_id_b64 = unique_id_b64
        self.barrier_after_update = barrier_after_update
        self.sps: StatelessStore | None = None
        self.unique_id: bytes | None = None

    def _build(self) -> None:
        if self.unique_id_b64:
            self.unique_id = decode_unique_id_b64(self.unique_id_b64)
        else:
            self.sps = StatelessStore.join(self.master_address, self.master_port, self.rank, self.world_size,
                                           self.timeout_s, self.abort_event)
            self.store = self.sps.store
            what = "the NCCL unique id (broadcast_from/0/0)"
            if self.rank == 0:
                from rlserve.transfer.backends.nccl_lib import nccl

                self.unique_id = nccl().unique_id()
                self.sps.broadcast_bytes(dumps_unique_id(self.unique_id), 0, what)
            else:
                try:
                    self.unique_id = loads_unique_id(self.sps.broadcast_bytes(None, 0, what))
                except UnsafePickleError:
                    logger.error("refused the trainer's unique-id pickle: nothing it named was run")
                    raise
        if self.device.type != "cuda":
            raise WeightTransferFailedError(
                f"vLLM's NCCL wire: rendezvous done and the unique id received (rank {self.rank}/{self.world_size}), "
                f"but the NCCL communicator needs a CUDA device; this server worker runs on {self.device}")
        from rlserve.transfer.backends.nccl_lib import NcclError, nccl

        try:
            lib = nccl()
            torch.cuda.set_device(self.device)
            self.pg = _Comm(lib, lib.comm_init_rank(self.world_size, self.unique_id, self.rank))
        except NcclError as e:
            raise WeightTransferFailedError(str(e)) from e

    def _enqueue(self, op, t: torch.Tensor, what: str) -> _Work:
        if self.pg is None or self.pg.closed or self.abort_event.is_set():
            raise TransferAbortedError("the transfer group has been torn down")
        if not t.is_cuda or not t.is_contiguous():
            raise WeightTransferFailedError(f"{what}: NCCL needs a contiguous CUDA tensor")
        stream = torch.cuda.current_stream(self.device)
        from rlserve.transfer.backends.nccl_lib import NcclError

        try:
            op(t, stream.cuda_stream)
        except NcclError as e:
            raise WeightTransferFailedError(f"{what}: {e}") from e
        ev = torch.cuda.Event()
        ev.record(stream)
        return _Work(self, ev, what)

    def _warmup(self) -> None:
        x = torch.zeros(1, dtype=torch.float32, device=self.device)
        lib, comm = self.pg.lib, self.pg.comm
        w = self._enqueue(lambda t, s: lib.all_reduce(t, comm, s), x, "warm-up all-reduce")
        self.wait(w, what="the warm-up all-reduce (vLLM's rendezvous)")
        if float(x.item()) != 0.0:
            raise WeightTransferFailedError(f"the warm-up all-reduce of zeros gave {x.item()}")

    def broadcast(self, tensor: torch.Tensor, src: int) -> _Work:
        """Queue ``ncclBroadcast`` of ``tensor`` (its own dtype and element count) from ``src`` on
        the current stream; returns the work (poll with :meth:`wait`)."""
        lib, comm = self.pg.lib, self.pg.comm
        return self._enqueue(lambda t, s: lib.broadcast(t, src, comm, s), tensor, f"broadcast from rank {src}")

    def barrier(self) -> None:
        """vLLM's store barrier (:meth:`StatelessStore.barrier`)."""
        if self.sps is None:
            raise WeightTransferFailedError("no rendezvous store (nccl_unique_id_b64): no barrier")
        self.sps.barrier()

    def after_update(self) -> None:
        """Called by the receiver once an update's data arrived: TRL's legacy layout runs a store
        barrier after each tensor (its client does the same)."""
        if self.barrier_after_update:
            self.barrier()
