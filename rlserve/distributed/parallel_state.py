"""Tensor-parallel state of this process: TP rank, TP size and the TP process group.

A single-process engine has TP size 1 and no group; the TP worker processes call
:func:`init_tensor_parallel` once before building the model. Layers read
:func:`get_tp_rank` / :func:`get_tp_size` at construction time to size their shards.
"""

from __future__ import annotations

import torch

_TP = {"rank": 0, "size": 1, "group": None}


def init_tensor_parallel(rank: int, size: int, group=None) -> None:
    """Record this process's TP rank and size and the group used for TP collectives
    (a :class:`rlserve.distributed.group.StandaloneGroup`).

    Raises:
        ValueError: if ``rank`` is not in ``[0, size)`` or ``size > 1`` without a group.
    """
    if not 0 <= rank < size:
        raise ValueError(f"TP rank {rank} out of range for TP size {size}")
    if size > 1 and group is None:
        raise ValueError("TP size > 1 needs a process group")
    _TP.update(rank=rank, size=size, group=group)


def get_tp_rank() -> int:
    return _TP["rank"]


def get_tp_size() -> int:
    return _TP["size"]


def get_tp_group():
    return _TP["group"]


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP group in place (identity at TP size 1). Returns ``x``."""
    if _TP["size"] > 1:
        _TP["group"].all_reduce(x)
    return x


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's ``x`` along the last dim, in rank order (identity at size 1).

    Args:
        x: ``[..., n]`` the same shape on every rank.
    Returns:
        ``[..., n * tp_size]``.
    """
    if _TP["size"] == 1:
        return x
    return torch.cat(_TP["group"].all_gather(x), dim=-1)
