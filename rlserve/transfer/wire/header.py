"""Checks of an update against the wire: the received layout header against the expected one
(:func:`check_layout_header`, :class:`LayoutMismatchError`) and an ``update_info``'s transport
fields against the backend (:func:`check_transport_fields`, :func:`expected_checksum_count`).
The header itself is built by :func:`rlserve.transfer.wire.packing.layout_header`."""

from __future__ import annotations

from typing import Sequence


from rlserve.errors import WeightUpdateError
from rlserve.transfer.wire.packing import (
    HEADER_MAGIC,
    HEADER_VERSION,
    describe_layout,
    plan_buckets,
)
from rlserve.transfer.wire.protocol import UpdateInfo

class LayoutMismatchError(WeightUpdateError):
    """The trainer's layout header (the first message of a gloo / NCCL update) differs from the
    one this server computed from ``update_info``, or is not a layout header at all: the data the
    trainer broadcasts does not match the metadata. Raised before any bucket / tensor receive
    was posted: nothing was received or loaded. The trainer's broadcasts stay pending, so the
    transfer group has to be torn down and re-initialised (the manager's failure path does it).
    A ``WeightUpdateError``: the client's fault, HTTP 400 (the manager re-raises a worker's error
    by class name from ``manager._ERRORS``, which lists this class)."""


_HEADER_FIELDS = ("flags (packed / checksums after the data)", "bucket or tensor count", "message count",
                  "data bytes", "bucket size", "message sizes digest", "names / dtypes / shapes digest")


def check_layout_header(got: Sequence[int], expected: Sequence[int]) -> None:
    """Compare a received layout header with the expected one (both ``HEADER_WORDS`` ints).

    Raises:
        LayoutMismatchError: not a layout header (wrong magic), another layout version, or any
            field differs; the message names both layouts and the fields that differ.
    """
    got = [int(w) for w in got]
    expected = [int(w) for w in expected]
    if (got[0] & ~0xFFFF) != HEADER_MAGIC:
        raise LayoutMismatchError(
            f"the trainer's data does not match update_info: its first message of this update is not an "
            f"rlserve layout header (word 0 is {got[0] & 0xFFFFFFFFFFFFFFFF:#018x}): a trainer that sends none (an "
            f"older rlserve SDK, or code broadcasting on the transfer group itself) where update_info gives "
            f"{describe_layout(expected)}; nothing was received or loaded")
    if got[0] != expected[0]:
        raise LayoutMismatchError(f"the trainer's layout header has version {got[0] & 0xFFFF}, this server speaks "
                                  f"version {HEADER_VERSION}; nothing was received or loaded")
    diff = [name for name, g, e in zip(_HEADER_FIELDS, got[1:], expected[1:]) if g != e]
    if diff:
        raise LayoutMismatchError(
            f"the trainer's data does not match update_info: it announces {describe_layout(got)} where update_info "
            f"gives {describe_layout(expected)} (differs: {', '.join(diff)}); nothing was received or loaded")


def expected_checksum_count(info: UpdateInfo) -> int:
    """How many checksums a resolved ``info`` must carry: buckets when packed, else tensors."""
    if info.packed:
        return len(plan_buckets(info.names, info.dtypes(), info.shapes, info.packed_buffer_size_bytes))
    return len(info.names)


def check_transport_fields(info: UpdateInfo, backend: str, known_ipc_refs=frozenset()) -> None:
    """Checks that need the plan (checksum count, ipc handle count) or the server's state
    (``known_ipc_refs``: the ``ipc_handles_ref`` names the workers hold). Raises WeightUpdateError."""
    if info.checksums is not None and len(info.checksums) != expected_checksum_count(info):
        raise WeightUpdateError(
            f"update_info.checksums has {len(info.checksums)} entries, expected {expected_checksum_count(info)} "
            f"({'one per bucket' if info.packed else 'one per tensor'})")
    ref = info.ipc_handles_ref
    if backend == "ipc":
        n = expected_checksum_count(info)
        if ref is not None and info.packed:
            raise WeightUpdateError("update_info.ipc_handles_ref is for per-tensor handles (packed=false) only")
        if info.ipc_handles is None and ref is not None:
            if ref not in known_ipc_refs:
                raise WeightUpdateError(f"update_info.ipc_handles_ref {ref!r} is unknown to this server (a new "
                                        "transfer engine, or not used by the last update): send ipc_handles with it")
        elif info.ipc_handles is None or len(info.ipc_handles) != n:
            raise WeightUpdateError(f"the ipc backend needs update_info.ipc_handles with one handle per "
                                    f"{'bucket' if info.packed else 'tensor'} ({n})")
    elif info.ipc_handles is not None or ref is not None:
        raise WeightUpdateError(f"update_info.ipc_handles given but the backend is {backend!r}")
    if info.checksums_after_data and (backend == "ipc" or not info.packed):
        raise WeightUpdateError("update_info.checksums_after_data needs a packed gloo / NCCL update")
