"""CUDA virtual memory management (driver API through ctypes): GPU memory whose virtual
addresses never move while its physical pages come and go.

Sleep mode (:mod:`rlserve.engine.core.sleep_mode`) keeps the weights and the KV cache in
:class:`VMMArena` s: a virtual range is reserved once (``cuMemAddressReserve``); waking maps
physical memory into it (``cuMemCreate`` + ``cuMemMap`` + ``cuMemSetAccess``), sleeping gives
the physical memory back to the driver (``cuMemUnmap`` + ``cuMemRelease``), where any other
process can allocate it. Tensors viewing the range (:meth:`VMMArena.view`) keep their
``data_ptr`` across sleep/wake, so CUDA graphs captured on them, recorded weight-sync copy plans
and every cached pointer stay valid. Touching the range while it is unmapped is an illegal
memory access (a fatal CUDA error): the engine steps nothing while asleep.

Why not torch's own allocators: ``CUDAPluggableAllocator`` / ``MemPool`` need a compiled
``.so`` with the malloc/free symbols (vLLM builds ``cumem_allocator.so`` for this), and the
caching allocator's expandable segments return pages on ``empty_cache`` but only for freed
blocks, so live tensors cannot be released. The arena needs no allocator at all: it is one
reservation per region, cut into views.

vLLM's note that a ctypes driver wrapper "failed because of cuda context mismatch" is about
allocator callbacks running on threads without the runtime's context: every call here first
makes the device's primary context (the one the CUDA runtime and torch use) current on the
calling thread (:func:`_ensure_context`).
"""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

logger = logging.getLogger(__name__)

# driver enums (cuda.h)
_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1
_CUDA_ERROR_OUT_OF_MEMORY = 2

#: physical memory is created and mapped in chunks of this many bytes (a failed wake then
#: frees what it got; the driver's own limit per handle is far larger)
CHUNK_BYTES = 1 << 30


class CUDADriverError(RuntimeError):
    """A CUDA driver call failed. ``code`` is the ``CUresult``; ``out_of_memory`` is True for
    ``CUDA_ERROR_OUT_OF_MEMORY`` (another process holds the memory a wake needs)."""

    def __init__(self, call: str, code: int, text: str):
        super().__init__(f"{call} failed: CUDA driver error {code} ({text})")
        self.code = code
        self.out_of_memory = code == _CUDA_ERROR_OUT_OF_MEMORY


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_lib_lock = threading.Lock()
_lib: list = []


def _driver():
    """``libcuda.so.1`` with the signatures of the calls used here (loaded once)."""
    with _lib_lock:
        if _lib:
            return _lib[0]
        lib = ctypes.CDLL("libcuda.so.1")
        u64, sz, vp = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
        sigs = {
            "cuInit": [ctypes.c_uint],
            "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(vp), ctypes.c_int],
            "cuCtxGetCurrent": [ctypes.POINTER(vp)],
            "cuCtxSetCurrent": [vp],
            "cuMemGetAllocationGranularity": [ctypes.POINTER(sz), ctypes.POINTER(_AllocationProp), ctypes.c_int],
            "cuMemAddressReserve": [ctypes.POINTER(u64), sz, sz, u64, u64],
            "cuMemAddressFree": [u64, sz],
            "cuMemCreate": [ctypes.POINTER(u64), sz, ctypes.POINTER(_AllocationProp), u64],
            "cuMemRelease": [u64],
            "cuMemMap": [u64, sz, sz, u64, u64],
            "cuMemUnmap": [u64, sz],
            "cuMemSetAccess": [u64, sz, ctypes.POINTER(_AccessDesc), sz],
            "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
        }
        for name, args in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = ctypes.c_int
        _check(lib, "cuInit", lib.cuInit(0))
        _lib.append(lib)
        return lib


def _check(lib, call: str, rc: int) -> None:
    if rc != 0:
        msg = ctypes.c_char_p()
        lib.cuGetErrorString(rc, ctypes.byref(msg))
        raise CUDADriverError(call, rc, (msg.value or b"?").decode())


_primary: dict[int, ctypes.c_void_p] = {}


def _ensure_context(lib, ordinal: int) -> None:
    """Make device ``ordinal``'s primary context current on this thread (the runtime's)."""
    ctx = _primary.get(ordinal)
    if ctx is None:
        dev = ctypes.c_int()
        _check(lib, "cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), ordinal))
        ctx = ctypes.c_void_p()
        _check(lib, "cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
        _primary[ordinal] = ctx  # retained once for the process's life, as the runtime does
    cur = ctypes.c_void_p()
    _check(lib, "cuCtxGetCurrent", lib.cuCtxGetCurrent(ctypes.byref(cur)))
    if cur.value != ctx.value:
        _check(lib, "cuCtxSetCurrent", lib.cuCtxSetCurrent(ctx))


class _CudaArrayView:
    """``__cuda_array_interface__`` (v3) of ``nbytes`` bytes at ``ptr``: how a raw device range
    becomes a torch tensor (``torch.as_tensor``) without an allocator."""

    def __init__(self, ptr: int, nbytes: int, owner):
        self.owner = owner  # the arena lives as long as any view
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3}


class VMMArena:
    """A reserved virtual range of device memory whose physical backing can be released and
    re-created at the same addresses.

    Args:
        device: a CUDA device (``torch.device("cuda", i)``).
        nbytes: bytes wanted; the range is rounded up to the allocation granularity
            (2 MiB on current GPUs; ``self.size``).
        mapped: create and map the physical memory now.

    Raises:
        CUDADriverError: a driver call failed (``out_of_memory`` when the memory is taken).
        OSError: no ``libcuda.so.1``.
    """

    def __init__(self, device: torch.device, nbytes: int, mapped: bool = True):
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"VMMArena needs a CUDA device, got {self.device}")
        self.ordinal = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self._lib = _driver()
        _ensure_context(self._lib, self.ordinal)
        self._prop = _AllocationProp()
        self._prop.type = _CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = _CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = self.ordinal
        gran = ctypes.c_size_t()
        _check(self._lib, "cuMemGetAllocationGranularity", self._lib.cuMemGetAllocationGranularity(
            ctypes.byref(gran), ctypes.byref(self._prop), _CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        self.granularity = int(gran.value)
        self.size = max(self.granularity, -(-int(nbytes) // self.granularity) * self.granularity)
        ptr = ctypes.c_uint64()
        _check(self._lib, "cuMemAddressReserve", self._lib.cuMemAddressReserve(ctypes.byref(ptr), self.size, 0, 0, 0))
        self.ptr = int(ptr.value)
        self._handles: list[tuple[int, int, int]] = []  # (offset, size, handle) of mapped chunks
        if mapped:
            self.map()

    @property
    def mapped(self) -> bool:
        """Whether physical memory backs the range now."""
        return bool(self._handles)

    def _chunks(self):
        step = max(self.granularity, CHUNK_BYTES // self.granularity * self.granularity)
        for off in range(0, self.size, step):
            yield off, min(step, self.size - off)

    def map(self) -> None:
        """Create physical memory and map it at the reserved addresses, readable and writable
        from this device. Contents are undefined. On failure nothing stays mapped.

        Raises:
            CUDADriverError: e.g. ``out_of_memory`` while another process holds the memory.
        """
        if self._handles:
            return
        _ensure_context(self._lib, self.ordinal)
        lib = self._lib
        access = _AccessDesc()
        access.location.type = _CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.ordinal
        access.flags = _CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        try:
            for off, size in self._chunks():
                h = ctypes.c_uint64()
                _check(lib, "cuMemCreate", lib.cuMemCreate(ctypes.byref(h), size, ctypes.byref(self._prop), 0))
                try:
                    _check(lib, "cuMemMap", lib.cuMemMap(self.ptr + off, size, 0, h.value, 0))
                except BaseException:
                    lib.cuMemRelease(h.value)
                    raise
                self._handles.append((off, size, int(h.value)))
            _check(lib, "cuMemSetAccess", lib.cuMemSetAccess(self.ptr, self.size, ctypes.byref(access), 1))
        except BaseException:
            self.unmap()
            raise

    def unmap(self) -> None:
        """Give the physical memory back to the driver (the addresses stay reserved). Callers
        make sure nothing reads or writes the range until :meth:`map` (synchronize first)."""
        if not self._handles:
            return
        _ensure_context(self._lib, self.ordinal)
        handles, self._handles = self._handles, []
        for off, size, h in handles:
            _check(self._lib, "cuMemUnmap", self._lib.cuMemUnmap(self.ptr + off, size))
            _check(self._lib, "cuMemRelease", self._lib.cuMemRelease(h))

    def view(self, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
        """A ``uint8 [nbytes]`` tensor over ``[offset, offset + nbytes)`` of the range (mapped
        now, so torch can look the pointer up); ``.view(dtype).view(shape)`` it as needed.

        Raises:
            ValueError: outside the range. RuntimeError: not mapped.
        """
        nbytes = self.size - offset if nbytes is None else int(nbytes)
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"[{offset}, {offset + nbytes}) is outside the arena of {self.size} bytes")
        if not self._handles:
            raise RuntimeError("map the arena before taking views of it")
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8, device=self.device)
        return torch.as_tensor(_CudaArrayView(self.ptr + offset, nbytes, self), device=self.device)

    def close(self) -> None:
        """Unmap and free the address range (views must be gone)."""
        if self.ptr:
            self.unmap()
            self._lib.cuMemAddressFree(self.ptr, self.size)
            self.ptr = 0


def vmm_supported(device: torch.device) -> bool:
    """Whether VMM arenas can be made on ``device`` (a CUDA device with ``libcuda.so.1``)."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        _driver()
        return True
    except (OSError, AttributeError, CUDADriverError) as e:
        logger.warning("CUDA virtual memory management unavailable: %s", e)
        return False
