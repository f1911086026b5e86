"""Trainer side of TRL's ``vllm-serve`` weight protocol, against rlserve.

TRL's protocol, per tensor: ``POST /update_named_param/ {"name", "dtype", "shape"}`` (answered
at once), then a broadcast from the trainer, which is the LAST rank of the group; the server's
workers are ranks ``0..N-1`` and worker 0 hosts the TCPStore on ``group_port``. After all
tensors: ``POST /reset_prefix_cache/``; at the end ``POST /close_communicator/``.

The HTTP side is TRL's. The data plane is rlserve's (a ``ProcessGroupGloo`` / ``ProcessGroupNCCL``
on a ``TCPStore``), not vLLM's ``StatelessProcessGroup`` + ``PyNcclCommunicator``, whose store
messages are pickled. It tells the server so (``"wire": "rlserve"``); without it an NCCL server
speaks vLLM's wire, which TRL <= 1.10's own ``VLLMClient`` joins (:mod:`rlserve.transfer.backends.vllm_group`).
This class is the same protocol on rlserve's data plane (same method names; gloo too)::

    client = TRLWeightSyncClient("http://127.0.0.1:8000", group_port=51216)   # or 0: see below
    client.init_communicator()
    client.update_model_params(model)      # update_named_param per tensor
    client.reset_prefix_cache()            # the server commits: prefix cache, weight version
    client.close_communicator()

In TRL's protocol the server binds the port the trainer names (its worker 0 hosts the store), so
a port picked free by the trainer can be taken by another process before the server binds it.
``group_port=0`` handles that: each init picks a free port, and when the server reports that its
bind failed with ``EADDRINUSE`` (``/weight_info``'s ``trl.error``; its init failed, so it is back
to ``uninitialized``) the client picks another and asks again, logging a warning, up to
:data:`PORT_TRIES` times. TRL's wire is unchanged (a port in ``/init_communicator/``).
"""

from __future__ import annotations

import logging
import socket
import time
from urllib.parse import urlparse

import torch

from rlserve.server.launch import PORT_TRIES, address_in_use, free_port
from rlserve.transfer.backends.group import TransferGroup
from rlserve.transfer.errors import TransferTimeoutError
from rlserve.transfer.wire.packing import as_bytes
from rlserve.transfer.wire.protocol import DEFAULT_TIMEOUT_S
from rlserve.transfer.sdk.trainer import HTTPWeightSyncClient, ModuleSource


logger = logging.getLogger(__name__)

#: Seconds between two looks at the server's ``/weight_info`` (and its port) while the group forms.
_POLL_S = 0.1


class PortTakenError(RuntimeError):
    """The server could not bind the group's port (``EADDRINUSE``); its init failed cleanly."""


class TRLWeightSyncClient:
    """Args:
        base_url: the server, e.g. ``"http://127.0.0.1:8000"``.
        group_port: the TCPStore port (server worker 0 listens on it); 0: a free one per init,
            another if the server finds it taken (module docstring). :attr:`group_port` names
            the port of the last init.
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"``.
        device: the trainer's GPU for NCCL.
        admin_key / timeout_s: as :class:`HTTPWeightSyncClient`.
    """

    def __init__(self, base_url: str, group_port: int = 51216, backend: str = "gloo",
                 device: str | torch.device | None = None, admin_key: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        self.http = HTTPWeightSyncClient(base_url, admin_key=admin_key, timeout_s=timeout_s)
        self.host = urlparse(base_url).hostname or "127.0.0.1"
        self.group_port = group_port
        self._pick_port = not group_port
        self.backend = backend
        self.timeout_s = float(timeout_s)
        self.device = torch.device(device) if device is not None else (
            torch.device("cpu") if backend == "gloo" else torch.device("cuda", torch.cuda.current_device()))
        self.group: TransferGroup | None = None
        self.rank: int | None = None

    def init_communicator(self) -> None:
        """Ask the server to open the group (it answers at once), then join it as the last rank.

        Raises:
            PortTakenError: (``group_port=0``) the server found :data:`PORT_TRIES` ports in a row
                taken; (a port given) the server could not bind it.
            TransferTimeoutError: nothing listened on the port within ``timeout_s``.
            What :meth:`TransferGroup.create` raises (e.g. ``TransferTimeoutError``)."""
        world = self.http.get_world_size() + 1
        self.rank = world - 1
        for attempt in range(1, (PORT_TRIES if self._pick_port else 1) + 1):
            if self._pick_port:
                self.group_port = free_port()
            self.http.init_communicator("0.0.0.0", self.group_port, world, wire="rlserve")
            try:
                self.group = self._join(world)
                return
            except PortTakenError as e:
                if not self._pick_port or attempt == PORT_TRIES:
                    raise
                logger.warning("%s; init_communicator again on a fresh port (try %d of %d)", e, attempt + 1,
                               PORT_TRIES)

    def _join(self, world: int) -> TransferGroup:
        """Join the group as rank ``world - 1`` once something listens on :attr:`group_port` (the
        server's worker 0 binds it after ``/init_communicator/`` answered). Raises
        :class:`PortTakenError` when the server reports that it could not bind the port: before
        anything listens (the port was held by a socket that does not listen), or after this
        side's join failed (a foreign listener took it). Nothing of this side is left running."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            self._raise_if_port_taken()
            try:
                socket.create_connection((self.host, self.group_port), timeout=_POLL_S * 10).close()
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise TransferTimeoutError(
                        f"nothing listened on {self.host}:{self.group_port} (the server's worker 0 hosts the group's "
                        f"store there) within {self.timeout_s:g} s (timeout_s; last: {e}); the server's TRL error: "
                        f"{self._server_error()}") from e
                time.sleep(_POLL_S)
        try:
            return TransferGroup.create(self.backend, self.host, self.group_port, self.rank, world, self.timeout_s,
                                        self.device)
        except Exception as e:
            # a listener that is not the server's (it failed to bind): its verdict follows its own
            # retry of a busy port (TransferGroup._make_store: up to 10 s), within its timeout_s
            end = time.monotonic() + self.timeout_s
            while time.monotonic() < end:
                err = self._raise_if_port_taken(e)
                if err is not None:
                    break  # it failed for another reason
                time.sleep(_POLL_S)
            raise

    def _server_error(self) -> str | None:
        """The server's recorded TRL failure (``/weight_info``'s ``trl.error``); ``None`` also when
        it cannot be read (the join's own bounds apply, as without this look)."""
        try:
            return self.http.weight_info().get("trl", {}).get("error")
        except Exception:  # noqa: BLE001
            return None

    def _raise_if_port_taken(self, cause: BaseException | None = None) -> str | None:
        """:class:`PortTakenError` if the server's TRL error is ``EADDRINUSE``; else that error (or ``None``)."""
        err = self._server_error()
        if err and address_in_use(err):
            raise PortTakenError(f"the server could not bind the group's port {self.group_port}: {err}") from cause
        return err

    def update_named_param(self, name: str, weights: torch.Tensor) -> None:
        """Announce one tensor, then broadcast its bytes from this (the last) rank."""
        if self.group is None:
            raise RuntimeError("call init_communicator() first")
        t = weights.detach().contiguous()
        self.http.update_named_param(name, str(t.dtype), list(t.shape))
        u8 = as_bytes(t)
        if u8.device != self.device:
            u8 = u8.to(self.device)
        if u8.numel():
            self.group.wait(self.group.broadcast(u8, self.rank), what=f"broadcast of {name}")

    def update_model_params(self, model: torch.nn.Module) -> float:
        """``update_named_param`` for every parameter (HF names, tied head skipped); seconds."""
        t0 = time.perf_counter()
        for name, t in ModuleSource(model).named_tensors():
            self.update_named_param(name, t)
        return time.perf_counter() - t0

    def reset_prefix_cache(self) -> dict:
        """The server commits the updates received so far (in order), resets its prefix cache."""
        return self.http.reset_prefix_cache()

    def close_communicator(self) -> None:
        try:
            self.http.close_communicator()
        finally:
            if self.group is not None:
                self.group.destroy(wait_s=5.0)
            self.group = None
