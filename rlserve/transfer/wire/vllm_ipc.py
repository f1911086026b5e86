"""vLLM's CUDA IPC wire (``ipc_handles_pickled``), read without ``pickle.loads``.

vLLM's ``IPCTrainerWeightTransferEngine`` (0.32; ``HTTPVLLMWeightSyncClient``) sends per update::

    {"names": [...], "dtype_names": [...], "shapes": [...],
     "ipc_handles_pickled": base64(pickle(handles)), "tensor_sizes": null | [bytes, ...]}

``handles`` is, unpacked, a list with one ``{gpu_uuid: args}`` per tensor, or, packed, one
``{gpu_uuid: args}`` for a uint8 buffer holding the tensors back to back (``tensor_sizes`` gives
their bytes); ``args`` is what ``torch.multiprocessing.reductions.reduce_tensor`` returns after
the rebuild function (a pickle of the whole ``(rebuild_cuda_tensor, args)`` pair is read too).
vLLM itself only reads it with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``.

:func:`translate_update_info` reads the pickle with :func:`~rlserve.transfer.wire.safe_pickle.restricted_loads`
admitting only ``torch.Size``, the tensor classes ``torch.Tensor`` / ``torch.nn.Parameter``, the
storage classes ``torch.UntypedStorage`` / ``torch.TypedStorage``, the float and integer
``torch`` dtypes and ``torch.multiprocessing.reductions.rebuild_cuda_tensor`` -- each replaced by
an inert marker that cannot be called -- then type-checks every argument by position and turns
each handle into rlserve's JSON handle (:mod:`rlserve.transfer.wire.ipc`), whose import calls torch's
``rebuild_cuda_tensor`` with those checked values only. A packed buffer becomes one handle per
tensor (a view at the tensor's offset), so the server's per-tensor ipc path (mapping cache,
fused copy + checksum, replayed loads) serves vLLM's trainer as it serves rlserve's SDK.
Anything else in the pickle is a 400 with code ``unsafe_pickle``, before any CUDA call.

A multi-GPU colocated trainer sends one ``{uuid: args}`` entry per GPU: the handle then carries
``"per_gpu"`` and each server worker maps its own GPU's (a worker whose GPU has none gets a 400).
Not supported (400 naming it): packed offsets that are not a multiple of the tensor's element
size.

IPC reference counts: vLLM's trainer exports every tensor again at each sync (a new ref-counter
slot each time); each handle carries ``"export"`` so the receiver maps every export once and
torch's ``rebuild_cuda_tensor`` releases its counter (on its storage-cache hit). A packed
buffer's views are several rebuilds of one export: torch releases that export's counter once
per view after the first, as with any consumer that rebuilds one export twice (vLLM warns about
it in ``PackedBufferImporter``); vLLM's producer keeps the buffer for the whole transfer and the
server has read it before it answers.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from rlserve.errors import WeightUpdateError
from rlserve.transfer.wire.protocol import WIRE_DTYPES, dtype_from_name, dtype_to_name
from rlserve.transfer.wire.safe_pickle import refuse, restricted_loads

_WHAT = "update_info.ipc_handles_pickled"
#: vLLM's fields that this module consumes (``first_chunk`` / ``last_chunk``: older vLLM's packed
#: IPC sends, booleans, not needed: every call names its tensors).
VLLM_IPC_FIELDS = ("ipc_handles_pickled", "tensor_sizes", "first_chunk", "last_chunk")


class _Marker:
    """What an admitted global becomes: a name of a kind, never callable."""

    __slots__ = ("kind", "name")

    def __init__(self, kind: str, name: str):
        self.kind = kind
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.kind} {self.name}>"


def _size(dims=()):
    """``torch.Size(dims)`` as the pickle calls it: a tuple of non-negative ints only."""
    if not isinstance(dims, (tuple, list)) or not all(type(d) is int and d >= 0 for d in dims) or len(dims) > 16:
        raise refuse(_WHAT, "torch.Size takes a tuple of non-negative ints")
    return tuple(dims)


_REBUILD = _Marker("rebuild", "rebuild_cuda_tensor")
_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch", "Size"): _size,
    ("torch", "Tensor"): _Marker("tensor_cls", "Tensor"),
    ("torch._tensor", "Tensor"): _Marker("tensor_cls", "Tensor"),
    ("torch.nn.parameter", "Parameter"): _Marker("tensor_cls", "Parameter"),
    ("torch.storage", "UntypedStorage"): _Marker("storage_cls", "UntypedStorage"),
    ("torch", "UntypedStorage"): _Marker("storage_cls", "UntypedStorage"),
    ("torch.storage", "TypedStorage"): _Marker("storage_cls", "TypedStorage"),
    ("torch", "TypedStorage"): _Marker("storage_cls", "TypedStorage"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _REBUILD,
    **{("torch", name): _Marker("dtype", name) for name in WIRE_DTYPES},
}


def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(b).decode("ascii")


def _check_args(args: Any, where: str) -> dict:
    """``reduce_tensor``'s 15 rebuild arguments -> rlserve's JSON handle (without the UUID),
    every one checked by position. Raises UnsafePickleError."""
    if isinstance(args, tuple) and len(args) == 2 and args[0] is _REBUILD:
        args = args[1]
    if not isinstance(args, tuple) or len(args) != 15:
        raise refuse(_WHAT, f"{where}: expected the 15 arguments of rebuild_cuda_tensor")
    (tcls, size, stride, toff, scls, dtype, dev, handle, ssize, soff, rgrad, rc_handle, rc_off, ev_handle,
     ev_sync) = args

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise refuse(_WHAT, f"{where}: {what}")

    def nonneg(v) -> bool:
        return type(v) is int and v >= 0

    need(isinstance(tcls, _Marker) and tcls.kind == "tensor_cls", "argument 0 must be torch.Tensor or Parameter")
    need(isinstance(size, tuple) and all(nonneg(d) for d in size), "argument 1 (size) must be a torch.Size")
    need(isinstance(stride, tuple) and len(stride) == len(size) and all(type(s) is int for s in stride),
         "argument 2 (stride) must be a tuple of ints as long as the size")
    need(nonneg(toff), "argument 3 (tensor offset) must be a non-negative int")
    need(isinstance(scls, _Marker) and scls.kind == "storage_cls", "argument 4 must be a torch storage class")
    need(isinstance(dtype, _Marker) and dtype.kind == "dtype", "argument 5 must be a torch dtype")
    need(nonneg(dev), "argument 6 (device) must be a non-negative int")
    need(isinstance(handle, bytes) and 0 < len(handle) <= 1024, "argument 7 (memory handle) must be bytes")
    need(nonneg(ssize) and nonneg(soff), "arguments 8, 9 (storage bytes, offset) must be non-negative ints")
    need(type(rgrad) is bool, "argument 10 (requires_grad) must be a bool")
    need(isinstance(rc_handle, bytes) and len(rc_handle) <= 1024, "argument 11 (ref counter handle) must be bytes")
    need(nonneg(rc_off), "argument 12 (ref counter offset) must be a non-negative int")
    need(ev_handle is None or (isinstance(ev_handle, bytes) and len(ev_handle) <= 1024),
         "argument 13 (event handle) must be bytes or None")
    need(type(ev_sync) is bool, "argument 14 (event sync) must be a bool")
    return {"tensor_cls": tcls.name, "size": list(size), "stride": list(stride), "tensor_offset": toff,
            "storage_cls": scls.name, "dtype": dtype.name, "device": dev, "handle": _b64(handle),
            "storage_size_bytes": ssize, "storage_offset_bytes": soff, "requires_grad": rgrad,
            "ref_counter_handle": _b64(rc_handle), "ref_counter_offset": rc_off, "event_handle": _b64(ev_handle),
            "event_sync_required": ev_sync}


def _per_gpu(entry: Any, where: str) -> dict[str, dict]:
    """``{gpu_uuid: args}`` -> ``{gpu_uuid: rlserve handle}`` (a multi-GPU colocated trainer
    gives one entry per GPU; each server worker maps its own GPU's)."""
    if not isinstance(entry, dict) or not 0 < len(entry) <= 64:
        raise refuse(_WHAT, f"{where}: expected {{gpu_uuid: rebuild arguments}}")
    out = {}
    for uuid, args in entry.items():
        if not isinstance(uuid, str) or not 0 < len(uuid) <= 128:
            raise refuse(_WHAT, f"{where}: the GPU UUID must be a string")
        h = _check_args(args, where)
        h["device_uuid"] = uuid
        # names this export (a fresh ref-counter slot per reduce_tensor call): the receiver maps
        # each export once, so torch releases every export's counter (receiver._map_cached)
        h["export"] = f"{h['ref_counter_handle']}:{h['ref_counter_offset']}"
        out[uuid] = h
    return out


def _merged(by_gpu: dict[str, dict]) -> dict:
    """One rlserve handle: the only GPU's, or the first one's with ``"per_gpu"`` holding every
    GPU's (the receiver picks the one of its worker's GPU: ``receiver._own_gpu_handle``)."""
    first = next(iter(by_gpu.values()))
    return first if len(by_gpu) == 1 else {**first, "per_gpu": by_gpu}


def _contiguous_stride(shape: list[int]) -> list[int]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= max(int(d), 1)
    return out[::-1]


def _packed_views(buf: dict, names: list, dtype_names: list, shapes: list, sizes: Any) -> list[dict]:
    """One handle per tensor of a packed uint8 buffer (``tensor_sizes`` bytes, back to back)."""
    if not isinstance(sizes, list) or len(sizes) != len(names) or not all(type(s) is int and s >= 0 for s in sizes):
        raise WeightUpdateError("update_info.tensor_sizes must list one non-negative byte count per name")
    if buf["dtype"] != "uint8" or len(buf["size"]) != 1:
        raise WeightUpdateError(f"{_WHAT}: a packed buffer must be a 1-D uint8 tensor, got {buf['dtype']} "
                                f"{buf['size']}")
    out, off = [], buf["tensor_offset"]
    for name, dn, shape, nb in zip(names, dtype_names, shapes, sizes):
        dt = dtype_from_name(dn)
        numel = 1
        for d in shape:
            numel *= d
        if numel * dt.itemsize != nb:
            raise WeightUpdateError(f"update_info.tensor_sizes: {name!r} is {nb} bytes, its dtype and shape "
                                    f"give {numel * dt.itemsize}")
        if off % dt.itemsize or buf["storage_offset_bytes"] % dt.itemsize:
            raise WeightUpdateError(f"{_WHAT}: {name!r} starts at byte {off} of the packed buffer, not a multiple "
                                    f"of its element size {dt.itemsize} (not supported)")
        out.append({**buf, "size": list(shape), "stride": _contiguous_stride(list(shape)),
                    "tensor_offset": off // dt.itemsize, "dtype": dtype_to_name(dt)})
        off += nb
    if off > buf["tensor_offset"] + buf["size"][0]:
        raise WeightUpdateError(f"update_info.tensor_sizes add up to {off - buf['tensor_offset']} bytes, more than "
                                f"the packed buffer's {buf['size'][0]}")
    return out


def is_vllm_ipc(update_info: Any) -> bool:
    """Whether ``update_info`` uses vLLM's IPC fields."""
    return isinstance(update_info, dict) and any(k in update_info for k in VLLM_IPC_FIELDS)


def translate_update_info(update_info: Any) -> Any:
    """vLLM's IPC ``update_info`` -> rlserve's (``ipc_handles`` as JSON handles, ``packed``
    false); anything else is returned unchanged.

    Raises:
        UnsafePickleError: (400, ``unsafe_pickle``) the pickle names anything outside the
            allow-list or its arguments have the wrong types; nothing it named ran.
        WeightUpdateError: (400) malformed fields (base64, ``tensor_sizes``), several GPUs.
    """
    if not is_vllm_ipc(update_info):
        return update_info
    d = dict(update_info)
    for k in ("first_chunk", "last_chunk"):
        if not isinstance(d.pop(k, True), bool):
            raise WeightUpdateError(f"update_info.{k} must be true or false")
    raw_b64 = d.pop("ipc_handles_pickled", None)
    sizes = d.pop("tensor_sizes", None)
    if raw_b64 is None:
        if sizes is not None:
            raise WeightUpdateError("update_info.tensor_sizes comes with vLLM's ipc_handles_pickled")
        return d
    if d.get("ipc_handles") is not None:
        raise WeightUpdateError("update_info: give ipc_handles or ipc_handles_pickled, not both")
    if not isinstance(raw_b64, str):
        raise WeightUpdateError(f"{_WHAT} must be a base64 string")
    try:
        raw = base64.b64decode(raw_b64.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise WeightUpdateError(f"{_WHAT} is not valid base64") from None
    handles = restricted_loads(raw, _ALLOWED, _WHAT)
    names, dtype_names, shapes = d.get("names"), d.get("dtype_names"), d.get("shapes")
    if not (isinstance(names, list) and isinstance(dtype_names, list) and isinstance(shapes, list)
            and len(names) == len(dtype_names) == len(shapes)):
        raise WeightUpdateError("update_info: names, dtype_names and shapes must be lists of one length")
    if sizes is not None:  # packed: one buffer for the whole call
        if not isinstance(handles, dict):
            raise refuse(_WHAT, "a packed update (tensor_sizes) carries one {gpu_uuid: args} handle")
        views = {u: _packed_views(h, names, dtype_names, [list(s) for s in shapes], sizes)
                 for u, h in _per_gpu(handles, "the packed buffer").items()}
        d["ipc_handles"] = [_merged({u: v[i] for u, v in views.items()}) for i in range(len(names))]
        # vLLM's packed IPC sends one call per buffer-full: each call is a part of the update
        # (names, shapes and dtypes still checked per call; finish reports whether it was full)
        d.setdefault("partial", True)
    else:
        if not isinstance(handles, list) or len(handles) != len(names):
            raise refuse(_WHAT, f"expected a list of {len(names)} {{gpu_uuid: args}} handles, one per name")
        d["ipc_handles"] = [_merged(_per_gpu(h, f"handle {i} ({names[i]!r})")) for i, h in enumerate(handles)]
    d["packed"] = False  # (vLLM's own "packed" names its buffer; rlserve now holds per-tensor handles)
    return d

