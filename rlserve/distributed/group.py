"""Standalone process groups: a gloo or NCCL group built on its own ``TCPStore`` +
``PrefixStore``, without ``torch.distributed.init_process_group``.

Several groups can live in one process this way (each tensor-parallel replica's TP group,
and the weight-transfer group that joins a trainer), and none touches torch's global
default group. Collectives are called on the ``ProcessGroup`` object directly.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist


def get_open_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def local_address_toward(host: str) -> str:
    """The IP address of this machine's interface that routes to ``host`` (a name or an IP).

    A UDP socket is "connected" to ``host`` (no packet is sent) and its local address read: on
    a cluster that is the NIC the peers reach this machine by; toward ``127.0.0.1`` it is the
    loopback address. Used to bind gloo (whose default, the address the hostname resolves to,
    is often ``127.0.0.1`` or ``127.0.1.1`` from ``/etc/hosts``, unreachable from other hosts).

    Raises:
        OSError: ``host`` does not resolve, or no route leads to it.
    """
    family, _type, _proto, _name, addr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return s.getsockname()[0]


def primary_address() -> str:
    """This machine's address on its default route (what other hosts most likely reach it by),
    or ``127.0.0.1`` when it has no route off the machine."""
    try:
        return local_address_toward("192.0.2.123")  # TEST-NET-1: only the routing table is read
    except OSError:
        return "127.0.0.1"


def new_backend(backend: str, store, rank: int, world_size: int, timeout: timedelta,
                nccl_async_error_handling: str | None = None, gloo_address: str | None = None):
    """Construct a ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` directly on ``store`` (no
    ``init_process_group``). The caller has set the CUDA device for NCCL.

    Args:
        nccl_async_error_handling: a value for ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` while the
            NCCL backend is built (e.g. "2" = clean up only, so a timed-out watchdog never
            kills the process); the previous value is restored.
        gloo_address: gloo binds this local address (:func:`local_address_toward` the master)
            instead of the one the hostname resolves to; ignored when ``GLOO_SOCKET_IFNAME``
            is set (the operator's choice wins). NCCL picks its interfaces itself
            (``NCCL_SOCKET_IFNAME``).

    Raises:
        ValueError: unknown backend; RuntimeError: this torch build has no NCCL.
    """
    if backend == "gloo":
        if gloo_address is None or os.environ.get("GLOO_SOCKET_IFNAME"):
            return dist.ProcessGroupGloo(store, rank, world_size, timeout)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=gloo_address)]
        return dist.ProcessGroupGloo(store, rank, world_size, opts)
    if backend != "nccl":
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not hasattr(dist, "ProcessGroupNCCL"):
        raise RuntimeError("this torch build has no NCCL")
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    key = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    old = os.environ.get(key)
    if nccl_async_error_handling is not None:
        os.environ[key] = nccl_async_error_handling
    try:
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


class StandaloneGroup:
    """A process group of ``world_size`` ranks rendezvousing at ``master_address:master_port``.

    Rank 0 hosts the ``TCPStore``. Every blocking call is bounded by ``timeout_s``.

    Args:
        backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors on ``device``).
        master_address / master_port: where rank 0's store listens.
        rank / world_size: this process's rank and the group size.
        timeout_s: rendezvous and collective timeout in seconds.
        prefix: key prefix in the store (separates groups sharing a store).
        device: the CUDA device for "nccl".

    Raises:
        ValueError: unknown backend or rank out of range.
        RuntimeError / DistNetworkError: rendezvous failed or timed out.
    """

    def __init__(
        self,
        backend: str,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        timeout_s: float = 300.0,
        prefix: str = "rlserve",
        device: torch.device | None = None,
    ):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world size {world_size}")
        self.backend = backend
        self.rank = rank
        self.world_size = world_size
        self.device = device
        timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(
            master_address, master_port, world_size, is_master=(rank == 0), timeout=timeout, wait_for_workers=False
        )
        self.pg = new_backend(backend, dist.PrefixStore(prefix, self.store), rank, world_size, timeout)
        self._destroyed = False

    # ---- collectives (blocking unless async_op) --------------------------------------
    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        work = self.pg.broadcast([tensor], opts)
        if async_op:
            return work
        work.wait()
        return None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place sum over the group. Returns ``tensor``."""
        self.pg.allreduce([tensor]).wait()
        return tensor

    def all_reduce_min(self, tensor: torch.Tensor) -> torch.Tensor:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.pg.allreduce([tensor], opts).wait()
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Each rank's ``tensor`` (same shape everywhere), in rank order."""
        outs = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.pg.allgather([outs], [tensor.contiguous()]).wait()
        return outs

    def barrier(self) -> None:
        t = torch.zeros(1, device=self.device if self.backend == "nccl" else "cpu")
        self.all_reduce(t)

    def destroy(self) -> None:
        """Drop the group; never blocks (an NCCL communicator is aborted)."""
        if self._destroyed:
            return
        self._destroyed = True
        try:
            if self.backend == "nccl" and hasattr(self.pg, "abort"):
                self.pg.abort()
        except Exception:  # noqa: BLE001 - teardown must not raise
            pass
        self.pg = None
        self.store = None
