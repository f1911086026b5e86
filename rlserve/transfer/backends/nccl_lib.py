"""A small ctypes binding of the NCCL library torch ships (``libnccl.so.2``).

vLLM's wire (:mod:`rlserve.transfer.backends.vllm_group`) builds its communicator from a unique id that
its own rank 0 minted, which torch's ``ProcessGroupNCCL`` cannot take; this module calls NCCL's C
API directly for the few functions that needs: ``ncclGetUniqueId``, ``ncclCommInitRank``,
``ncclAllReduce``, ``ncclBroadcast``, ``ncclCommGetAsyncError``, ``ncclCommAbort``,
``ncclCommDestroy``. Signatures and enum values are NCCL's public ``nccl.h`` (stable since 2.x).

The library is found, in order, at ``$RLSERVE_NCCL_SO_PATH``, ``$VLLM_NCCL_SO_PATH``, the copy
loaded by torch's CUDA build (``libnccl.so.2`` by soname), and the ``nvidia-nccl-cu12`` /
``nvidia-nccl-cu13`` wheels' ``lib`` folder.
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from rlserve import envs

#: Bytes of ``ncclUniqueId`` (``NCCL_UNIQUE_ID_BYTES`` in nccl.h).
UNIQUE_ID_BYTES = 128

_SUCCESS = 0
_IN_PROGRESS = 7

#: ``ncclDataType_t`` of the torch dtypes the wire sends.
DTYPES = {
    torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6,
    torch.float32: 7, torch.float64: 8, torch.bfloat16: 9,
}
#: ``ncclSum``.
SUM = 0


class NcclUniqueId(ctypes.Structure):
    """``ncclUniqueId``: 128 opaque bytes (passed by value to ``ncclCommInitRank``)."""

    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


class NcclError(RuntimeError):
    """An NCCL call returned an error (the message has NCCL's own text), or no library was found."""


_lock = threading.Lock()
_lib: "NcclLibrary | None" = None


def _candidates() -> list[str]:
    out = [p for p in (envs.RLSERVE_NCCL_SO_PATH, envs.VLLM_NCCL_SO_PATH) if p]
    out.append("libnccl.so.2")
    for mod in ("nvidia.nccl",):
        try:
            import importlib

            m = importlib.import_module(mod)
            for base in getattr(m, "__path__", []):
                out.append(os.path.join(base, "lib", "libnccl.so.2"))
        except ImportError:
            pass
    return out


class NcclLibrary:
    """The loaded library with typed entry points.

    Raises (constructor):
        NcclError: no ``libnccl.so.2`` could be loaded (a CPU-only torch ships none).
    """

    def __init__(self, path: str | None = None):
        errors = []
        self.lib = None
        for cand in ([path] if path else _candidates()):
            try:
                self.lib = ctypes.CDLL(cand)
                self.path = cand
                break
            except OSError as e:
                errors.append(f"{cand}: {e}")
        if self.lib is None:
            raise NcclError("no NCCL library could be loaded (vLLM's NCCL wire needs the libnccl.so.2 of a CUDA "
                            "torch build, or RLSERVE_NCCL_SO_PATH): " + "; ".join(errors))
        L, vp, i, sz = self.lib, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        L.ncclGetErrorString.restype = ctypes.c_char_p
        L.ncclGetErrorString.argtypes = [i]
        L.ncclGetVersion.argtypes = [ctypes.POINTER(i)]
        L.ncclGetUniqueId.argtypes = [ctypes.POINTER(NcclUniqueId)]
        L.ncclCommInitRank.argtypes = [ctypes.POINTER(vp), i, NcclUniqueId, i]
        L.ncclAllReduce.argtypes = [vp, vp, sz, i, i, vp, vp]
        L.ncclBroadcast.argtypes = [vp, vp, sz, i, i, vp, vp]
        L.ncclCommGetAsyncError.argtypes = [vp, ctypes.POINTER(i)]
        L.ncclCommAbort.argtypes = [vp]
        L.ncclCommDestroy.argtypes = [vp]
        for f in ("ncclGetVersion", "ncclGetUniqueId", "ncclCommInitRank", "ncclAllReduce", "ncclBroadcast",
                  "ncclCommGetAsyncError", "ncclCommAbort", "ncclCommDestroy"):
            getattr(L, f).restype = i

    def check(self, result: int, what: str) -> None:
        """Raise :class:`NcclError` naming ``what`` unless ``result`` is ``ncclSuccess``."""
        if result != _SUCCESS:
            raise NcclError(f"{what} failed: NCCL error {result} ({self.lib.ncclGetErrorString(result).decode()})")

    def version(self) -> int:
        """``NCCL_VERSION_CODE`` of the loaded library (e.g. 22703 for 2.27.3)."""
        v = ctypes.c_int()
        self.check(self.lib.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
        return v.value

    def unique_id(self) -> bytes:
        """A fresh ``ncclUniqueId`` (128 bytes; rank 0 mints it)."""
        u = NcclUniqueId()
        self.check(self.lib.ncclGetUniqueId(ctypes.byref(u)), "ncclGetUniqueId")
        return bytes(u)

    def comm_init_rank(self, world_size: int, unique_id: bytes, rank: int) -> int:
        """``ncclCommInitRank`` on the current CUDA device; blocks until every rank joined.
        Returns the communicator handle (an address)."""
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise NcclError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        u = NcclUniqueId()
        ctypes.memmove(ctypes.addressof(u), unique_id, UNIQUE_ID_BYTES)
        comm = ctypes.c_void_p()
        self.check(self.lib.ncclCommInitRank(ctypes.byref(comm), world_size, u, rank), "ncclCommInitRank")
        return comm.value

    def all_reduce(self, t: torch.Tensor, comm: int, stream: int) -> None:
        """In-place sum of contiguous CUDA ``t`` over the communicator, queued on ``stream``."""
        self.check(self.lib.ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(), DTYPES[t.dtype], SUM, comm, stream),
                   "ncclAllReduce")

    def broadcast(self, t: torch.Tensor, root: int, comm: int, stream: int) -> None:
        """Broadcast contiguous CUDA ``t`` (``t.numel()`` elements of its dtype) from ``root`` into
        ``t`` on every rank, queued on ``stream``."""
        self.check(self.lib.ncclBroadcast(t.data_ptr(), t.data_ptr(), t.numel(), DTYPES[t.dtype], root, comm, stream),
                   "ncclBroadcast")

    def async_error(self, comm: int) -> int:
        """``ncclCommGetAsyncError``: 0 (fine), 7 (in progress) or an error code."""
        r = ctypes.c_int()
        self.check(self.lib.ncclCommGetAsyncError(comm, ctypes.byref(r)), "ncclCommGetAsyncError")
        return r.value

    def error_string(self, code: int) -> str:
        return self.lib.ncclGetErrorString(code).decode()

    def abort(self, comm: int) -> None:
        """``ncclCommAbort``: ends pending operations and frees the communicator."""
        self.check(self.lib.ncclCommAbort(comm), "ncclCommAbort")

    def destroy(self, comm: int) -> None:
        """``ncclCommDestroy`` (after every operation finished)."""
        self.check(self.lib.ncclCommDestroy(comm), "ncclCommDestroy")


def nccl() -> NcclLibrary:
    """The process's :class:`NcclLibrary`, loaded on first use. Raises NcclError."""
    global _lib
    with _lock:
        if _lib is None:
            _lib = NcclLibrary()
        return _lib
