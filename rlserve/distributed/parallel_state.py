"""Tensor-parallel state: TP rank, TP size and the TP process group.

The state is per thread, so several engine replicas can live in one process (one engine
thread each). A :class:`~rlserve.engine.worker.worker.Worker` enters :func:`tp_context` while it
builds the model and around every forward and weight load; layers read
:func:`get_tp_rank` / :func:`get_tp_size` at construction time to size their shards and
call :func:`tp_all_reduce` / :func:`tp_all_gather_last_dim` in forward. Outside any
context the state is TP size 1, rank 0, no group.
"""

from __future__ import annotations

import contextlib
import threading

import torch

_local = threading.local()


def _state() -> tuple[int, int, object]:
    return getattr(_local, "tp", (0, 1, None))


def init_tensor_parallel(rank: int, size: int, group=None) -> None:
    """Set this thread's TP rank and size and the group used for TP collectives
    (a :class:`rlserve.distributed.group.StandaloneGroup`).

    Raises:
        ValueError: if ``rank`` is not in ``[0, size)`` or ``size > 1`` without a group.
    """
    if not 0 <= rank < size:
        raise ValueError(f"TP rank {rank} out of range for TP size {size}")
    if size > 1 and group is None:
        raise ValueError("TP size > 1 needs a process group")
    _local.tp = (rank, size, group)


@contextlib.contextmanager
def tp_context(rank: int, size: int, group=None):
    """Run a block with this thread's TP state set to ``(rank, size, group)``; restores
    the previous state afterwards."""
    prev = _state()
    init_tensor_parallel(rank, size, group)
    try:
        yield
    finally:
        _local.tp = prev


def get_tp_rank() -> int:
    return _state()[0]


def get_tp_size() -> int:
    return _state()[1]


def get_tp_group():
    return _state()[2]


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP group in place (identity at TP size 1). Returns ``x``."""
    rank, size, group = _state()
    if size > 1:
        group.all_reduce(x)
    return x


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's ``x`` along the last dim, in rank order (identity at size 1).

    Args:
        x: ``[..., n]`` the same shape on every rank.
    Returns:
        ``[..., n * tp_size]``.
    """
    rank, size, group = _state()
    if size == 1:
        return x
    return torch.cat(group.all_gather(x), dim=-1)
