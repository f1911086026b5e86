"""CUDA IPC handles as JSON (never pickle).

``torch.multiprocessing.reductions.reduce_tensor(t)`` returns ``(rebuild_cuda_tensor, args)``
for a CUDA tensor. :func:`export_handle` serialises only ``args`` as JSON: classes become names
from a fixed whitelist, ``torch.dtype`` its name, ``bytes`` base64, sizes lists. The receiver
(:func:`import_handle`) rebuilds the arguments from that whitelist alone and calls torch's own
``rebuild_cuda_tensor``; nothing in the payload can name code to run.

Lifetime and ordering (what the trainer must do):

- call :func:`export_handle` once per use, after the kernels that filled the buffer were queued on
  the current stream: torch records an IPC event there, and the receiver's stream waits on it;
- keep the buffer alive and unmodified until the server answered the ``update_weights`` call that
  carried the handle (the server finishes reading before it answers).

Devices are matched by UUID (``device_uuid``) so that different ``CUDA_VISIBLE_DEVICES``
orderings in trainer and server processes still map the right GPU.
"""

from __future__ import annotations

import base64

import torch

from rlserve.errors import WeightUpdateError
from rlserve.transfer.wire.protocol import dtype_from_name, dtype_to_name

_TENSOR_CLASSES = {"Tensor": torch.Tensor, "Parameter": torch.nn.Parameter}
_STORAGE_CLASSES = {"TypedStorage": torch.storage.TypedStorage, "UntypedStorage": torch.UntypedStorage}

_FIELDS = ("tensor_cls", "size", "stride", "tensor_offset", "storage_cls", "dtype", "device", "handle",
           "storage_size_bytes", "storage_offset_bytes", "requires_grad", "ref_counter_handle",
           "ref_counter_offset", "event_handle", "event_sync_required")


def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(bytes(b)).decode("ascii")


def _unb64(s: str | None, what: str) -> bytes | None:
    if s is None:
        return None
    if not isinstance(s, str):
        raise WeightUpdateError(f"ipc handle: {what} must be a base64 string")
    try:
        return base64.b64decode(s.encode("ascii"), validate=True)
    except Exception as e:
        raise WeightUpdateError(f"ipc handle: {what} is not valid base64") from e


def device_uuid(index: int) -> str:
    """The UUID string of CUDA device ``index`` (as torch reports it)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def export_handle(t: torch.Tensor) -> dict:
    """JSON-able description of CUDA tensor ``t`` that another process can map.

    Returns:
        ``{"tensor_cls", "size", "stride", "tensor_offset", "storage_cls", "dtype", "device",
        "device_uuid", "handle" (base64), "storage_size_bytes", "storage_offset_bytes",
        "requires_grad", "ref_counter_handle" (base64), "ref_counter_offset", "event_handle"
        (base64), "event_sync_required"}``.
    Raises:
        ValueError: ``t`` is not a CUDA tensor.
    """
    from torch.multiprocessing.reductions import reduce_tensor

    if not t.is_cuda:
        raise ValueError("export_handle needs a CUDA tensor")
    _rebuild, args = reduce_tensor(t.detach())
    d = dict(zip(_FIELDS, args))
    cls_name = {v: k for k, v in _TENSOR_CLASSES.items()}.get(d["tensor_cls"], "Tensor")
    st_name = {v: k for k, v in _STORAGE_CLASSES.items()}.get(d["storage_cls"])
    if st_name is None:
        raise ValueError(f"unexpected storage class {d['storage_cls']}")
    dev = int(d["device"])
    return {
        "tensor_cls": cls_name,
        "size": [int(x) for x in d["size"]],
        "stride": [int(x) for x in d["stride"]],
        "tensor_offset": int(d["tensor_offset"]),
        "storage_cls": st_name,
        "dtype": dtype_to_name(d["dtype"]),
        "device": dev,
        "device_uuid": device_uuid(dev),
        "handle": _b64(d["handle"]),
        "storage_size_bytes": int(d["storage_size_bytes"]),
        "storage_offset_bytes": int(d["storage_offset_bytes"]),
        "requires_grad": bool(d["requires_grad"]),
        "ref_counter_handle": _b64(d["ref_counter_handle"]),
        "ref_counter_offset": int(d["ref_counter_offset"]),
        "event_handle": _b64(d["event_handle"]),
        "event_sync_required": bool(d["event_sync_required"]),
    }


def _local_index(h: dict) -> int:
    uuid = h.get("device_uuid")
    if uuid:
        for i in range(torch.cuda.device_count()):
            if device_uuid(i) == uuid:
                return i
        raise WeightUpdateError(f"ipc handle: GPU {uuid} is not visible to this server worker "
                                "(the ipc backend needs trainer and server on the same GPU)")
    idx = h.get("device")
    if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < torch.cuda.device_count():
        raise WeightUpdateError(f"ipc handle: bad device {idx!r}")
    return idx


def import_handle(h: dict) -> torch.Tensor:
    """Map the tensor described by :func:`export_handle`'s dict (no copy).

    Raises:
        WeightUpdateError: a malformed handle or a GPU this process cannot see.
        RuntimeError: CUDA refused to open the handle (e.g. the trainer freed the buffer).
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if not isinstance(h, dict):
        raise WeightUpdateError("ipc handle must be a JSON object")
    missing = [k for k in _FIELDS if k not in h and k != "device"]
    if missing:
        raise WeightUpdateError(f"ipc handle: missing field(s) {missing}")
    if h["tensor_cls"] not in _TENSOR_CLASSES or h["storage_cls"] not in _STORAGE_CLASSES:
        raise WeightUpdateError("ipc handle: unknown tensor or storage class")
    ints = ("tensor_offset", "storage_size_bytes", "storage_offset_bytes", "ref_counter_offset")
    for k in ints:
        if isinstance(h[k], bool) or not isinstance(h[k], int) or h[k] < 0:
            raise WeightUpdateError(f"ipc handle: {k} must be a non-negative int")
    for k in ("size", "stride"):
        if not isinstance(h[k], list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in h[k]):
            raise WeightUpdateError(f"ipc handle: {k} must be a list of ints")
    dev = _local_index(h)
    return rebuild_cuda_tensor(
        _TENSOR_CLASSES[h["tensor_cls"]],
        torch.Size(h["size"]),
        tuple(h["stride"]),
        h["tensor_offset"],
        _STORAGE_CLASSES[h["storage_cls"]],
        dtype_from_name(h["dtype"]),
        dev,
        _unb64(h["handle"], "handle"),
        h["storage_size_bytes"],
        h["storage_offset_bytes"],
        bool(h["requires_grad"]),
        _unb64(h["ref_counter_handle"], "ref_counter_handle"),
        h["ref_counter_offset"],
        _unb64(h["event_handle"], "event_handle"),
        bool(h["event_sync_required"]),
    )
