"""Trainer SDK, init infos: the trainer-side ``*TrainerInitInfo`` of each backend (gloo, NCCL,
ipc) and the server ``init_info`` each one becomes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


from rlserve.transfer.wire.protocol import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    DEFAULT_TIMEOUT_S,
    InitInfo,
)

@dataclass
class TrainerInitInfo:
    """Common fields of the trainer-side init infos.

    Attributes:
        master_address / master_port: the TCPStore the trainer hosts (rank 0). ``master_port=0``
            (the default): each init hosts it on a port the kernel picks, listening before the
            server is told of it, so no other process can take it in between (a port picked by
            the caller and bound later can be: the init then fails with ``EADDRINUSE``);
            ``master_port`` names that port after the init. A port given is used as given
            (after a broken transfer whose store still holds it, a picked one is).
        world_size: server workers + 1 (``client.get_world_size() + 1``).
        rank: this trainer process's rank in its own job; only rank 0 talks to the server and
            sends (FSDP: the others only take part in ``full_tensor()`` gathers).
        packed / packed_buffer_size_bytes / packed_num_buffers: bucket layout (bytes).
        timeout_s: seconds for the rendezvous, every collective wait and every HTTP call.
        checksums: compute and announce per-bucket checksums (costs one extra pass over the
            tensors).
    """

    master_address: str = "127.0.0.1"
    master_port: int = 0
    world_size: int = 2
    rank: int = 0
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    timeout_s: float = DEFAULT_TIMEOUT_S
    checksums: bool = True

    backend: ClassVar[str] = ""

    def to_server_init_info(self) -> dict:
        """The ``init_info`` JSON the server receives."""
        d = InitInfo(backend=self.backend, master_address=self.master_address, master_port=self.master_port,
                     rank_offset=1, world_size=self.world_size, packed=self.packed,
                     packed_buffer_size_bytes=self.packed_buffer_size_bytes,
                     packed_num_buffers=self.packed_num_buffers, timeout_s=float(self.timeout_s))
        d.validate()
        return d.to_dict()


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """gloo data plane (CPU tensors; GPU tensors are staged through host memory)."""

    backend: ClassVar[str] = "gloo"


@dataclass
class NCCLTrainerInitInfo(TrainerInitInfo):
    """NCCL data plane. ``device``: the trainer's GPU (default: the current device). NCCL
    refuses two ranks on one GPU: use ``IPCTrainerInitInfo`` when sharing the server's GPU."""

    device: str | None = None
    backend: ClassVar[str] = "nccl"


@dataclass
class IPCTrainerInitInfo(TrainerInitInfo):
    """CUDA IPC data plane: trainer and server on one GPU; no process group (``master_*`` and
    ``world_size`` are unused). ``device``: the GPU of the trainer's buffers.

    ``packed`` defaults to ``False`` here (``True`` for gloo / NCCL): the server then copies
    straight out of the trainer's own tensors, whose handles travel once, and a sync of a plain
    module is one ``/sync_weights`` call (Qwen3-8B on one H200: ~15 ms against 0.4-0.8 s packed,
    BENCHMARKS.md). ``packed=True`` copies every tensor into a bucket first and maps a fresh
    handle per bucket."""

    device: str | None = None
    packed: bool = False
    backend: ClassVar[str] = "ipc"

    def to_server_init_info(self) -> dict:
        d = InitInfo(backend="ipc", master_address=self.master_address, master_port=0, rank_offset=1,
                     world_size=max(2, self.world_size), packed=self.packed,
                     packed_buffer_size_bytes=self.packed_buffer_size_bytes,
                     packed_num_buffers=self.packed_num_buffers, timeout_s=float(self.timeout_s))
        d.validate()
        return d.to_dict()


def _port_in_use(port: int) -> bool:
    """Whether a socket still listens on TCP ``port`` (any address, IPv4 or IPv6): a bind with
    ``SO_REUSEADDR`` (as the ``TCPStore`` binds) fails. Connections left in ``TIME_WAIT`` by a
    closed store do not count (that bind succeeds, as the store's own would)."""
    import errno
    import socket

    for family, host in ((socket.AF_INET, ""), (socket.AF_INET6, "::")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this host
            continue
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                if family == socket.AF_INET6 and e.errno == errno.EADDRNOTAVAIL:
                    continue  # IPv6 sockets exist but no IPv6 address is configured
                return True
    return False
