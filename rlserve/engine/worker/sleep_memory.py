"""Worker side of sleep mode: the weights and the KV cache as two releasable memory regions.

On CUDA each region is a :class:`~rlserve.engine.worker.cuda_vmm.VMMArena`: at start-up the loaded
parameters are copied into one flat weights arena and re-pointed there (``param.data`` becomes a
view; the same ``Parameter`` objects), and the KV cache is cut out of a KV arena. Sleeping
releases the physical pages (they go back to the driver: another process can allocate them);
waking maps new pages at the same virtual addresses, so CUDA graphs, weight-sync copy plans and
cached pointers stay valid.

On the CPU there is no VMM and nothing to offload to: the weights already are in host memory.
A level-1 sleep there sets the parameters' tensors aside, unchanged, and points every
``Parameter`` at one ``0xFF`` element broadcast to its shape (stride 0: NaN in every float
dtype, no memory); the wake points them back at the very same tensors (same bytes, same
addresses). No byte is copied (the copy of every weight to fresh pages on one thread took
0.24-9.56 s for SmolLM2's 538 MB on the loaded 2-core machine, session 18). Discarding (the
KV cache, level 2) overwrites the bytes with ``0xFF`` in place (memory is not returned to the
OS), so anything that would read a discarded region sees garbage; CPU tests prove with it that
a level-2 sleep really loses the weights.

Operations (all on the worker's thread, between engine steps):

* ``offload`` (level 1, weights): copy the region to host memory (pinned on CUDA, kept for the
  next sleep), then release it; on the CPU: set the tensors aside (no copy);
* ``discard`` (level 1 KV, level 2 both): release without a copy (contents lost);
* ``restore``: memory back; weights from the host copy when there is one (else contents are
  undefined until a weight sync or a reload fills them), the KV cache zeroed (attention reads
  zeros, never NaNs, in the unused slots of a block).
"""

from __future__ import annotations

import gc
import logging
import time

import torch
from torch import nn

logger = logging.getLogger(__name__)

ALIGN = 256  # bytes: every tensor cut out of an arena starts on this boundary (Triton / vector loads)
WEIGHTS, KV_CACHE = "weights", "kv_cache"
TAGS = (WEIGHTS, KV_CACHE)


def _aligned(n: int) -> int:
    return -(-int(n) // ALIGN) * ALIGN


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def pack_parameters(model: nn.Module, arena_factory) -> tuple[object, int]:
    """Move every parameter of ``model`` into one arena: ``arena_factory(nbytes)`` makes it
    (mapped), each parameter is copied to its ``ALIGN``-aligned slot and ``param.data``
    re-pointed to the slot's view (same shape, dtype and contiguous strides). Tied parameters
    are one ``Parameter`` and get one slot. The old storage is freed (caching allocator emptied).

    Returns:
        ``(arena, used_bytes)``.
    """
    params = list(model.parameters())  # unique objects
    slots: dict = {}  # distinct Parameters over the same memory (a tie by .data) keep sharing it
    offsets, total = [], 0
    for p in params:
        key = (p.data_ptr(), p.dtype, tuple(p.shape))
        if key not in slots:
            slots[key] = total
            total += _aligned(p.numel() * p.element_size())
        offsets.append(slots[key])
    arena = arena_factory(max(total, ALIGN))
    views: dict = {}
    with torch.no_grad():
        for p, off in zip(params, offsets):
            if not p.is_contiguous():
                raise ValueError("sleep mode needs contiguous parameters")
            if off not in views:
                views[off] = arena.view(off, p.numel() * p.element_size()).view(p.dtype).view(p.shape)
                views[off].copy_(p.data)
            p.data = views[off]
    if arena.device.type == "cuda":
        torch.cuda.synchronize(arena.device)
        gc.collect()
        torch.cuda.empty_cache()
    return arena, total


class BumpAllocator:
    """Cuts zeroed tensors out of an arena in order (the KV cache's per-layer K and V)."""

    def __init__(self, arena):
        self.arena = arena
        self.used = 0

    def __call__(self, shape, dtype: torch.dtype) -> torch.Tensor:
        n = int(torch.Size(shape).numel()) * torch.tensor([], dtype=dtype).element_size()
        t = self.arena.view(self.used, n).view(dtype).view(shape)
        t.zero_()
        self.used += _aligned(n)
        return t


def _host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """``uint8 [nbytes]`` host memory, page-locked when ``pinned`` (``cudaHostRegister`` of an
    ordinary allocation: torch's pinned allocator would round 4 GiB of weights up to 8), so the
    copies to and from the device run at full speed. Falls back to ``pin_memory=True``."""
    buf = torch.empty(int(nbytes), dtype=torch.uint8)
    if pinned:
        try:
            rc = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
            if int(getattr(rc, "value", rc)) != 0:
                raise RuntimeError(f"cudaHostRegister: error {rc}")
            _registered.add(buf.data_ptr())
        except Exception as e:  # noqa: BLE001 - pinned some other way, or pageable
            logger.info("cudaHostRegister unavailable (%s); pinned memory from torch's allocator", e)
            buf = torch.empty(int(nbytes), dtype=torch.uint8, pin_memory=True)
    return buf


_registered: set[int] = set()


def _unregister(buf: torch.Tensor) -> None:
    if buf.data_ptr() in _registered:
        _registered.discard(buf.data_ptr())
        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())


class _ArenaRegion:
    """A region backed by a VMM arena (CUDA): releasing unmaps the physical pages."""

    releases = True  # asleep, its pages are back with the driver

    def __init__(self, arena, used_bytes: int):
        self.arena = arena
        self.used = int(used_bytes)
        self.backup: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Physical bytes the region holds while awake (the arena's granularity-rounded size)."""
        return self.arena.size

    def _sync(self) -> None:
        if self.arena.device.type == "cuda":
            torch.cuda.synchronize(self.arena.device)

    def offload(self) -> int:
        """Copy the used bytes to the host backup, then unmap; returns the bytes copied."""
        t0 = time.perf_counter()
        fresh = self.backup is None or self.backup.numel() < self.used
        if fresh:  # the first sleep: a host buffer, page-locked (its every page touched once)
            self.drop_backup()
            self.backup = _host_buffer(self.used, pinned=self.arena.device.type == "cuda")
        t1 = time.perf_counter()
        self.backup[: self.used].copy_(self.arena.view(0, self.used), non_blocking=True)
        self._sync()
        t2 = time.perf_counter()
        self.arena.unmap()
        logger.info("sleep: %.1f MiB offloaded: host buffer %.3f s%s, copy %.3f s, unmap %.3f s", self.used / 2**20,
                    t1 - t0, " (new)" if fresh else "", t2 - t1, time.perf_counter() - t2)
        return self.used

    def discard(self) -> None:
        self._sync()  # nothing still reads or writes the pages
        self.arena.unmap()

    def drop_backup(self) -> None:
        if self.backup is not None:
            _unregister(self.backup)
            self.backup = None

    def restore(self, from_backup: bool, zero: bool) -> None:
        self.arena.map()
        if from_backup and self.backup is not None:
            self.arena.view(0, self.used).copy_(self.backup[: self.used], non_blocking=True)
        elif zero:
            self.arena.view(0, self.used).zero_()
        self._sync()


class _InPlaceRegion:
    """A region of ordinary tensors (CPU): discarding overwrites them with ``0xFF`` bytes.

    ``tensors()`` is called at each operation: the weight sync's CPU direct layout may move
    the parameters between sleeps."""

    releases = False  # asleep, its memory stays allocated (only the contents are gone)

    def __init__(self, tensors):
        self.tensors = tensors

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def discard(self) -> None:
        with torch.no_grad():
            for t in self.tensors():
                _as_bytes(t).fill_(0xFF)

    def drop_backup(self) -> None:
        pass

    def restore(self, from_backup: bool, zero: bool) -> None:
        if zero:
            with torch.no_grad():
                for t in self.tensors():
                    t.zero_()


def _nan_broadcast(p: torch.Tensor) -> torch.Tensor:
    """One element of ``0xFF`` bytes in ``p``'s dtype (NaN for floats) broadcast to ``p``'s shape
    (stride 0, ``element_size`` bytes of memory)."""
    one = torch.full((p.element_size(),), 0xFF, dtype=torch.uint8, device=p.device).view(p.dtype)
    return one.reshape([1] * p.dim()).expand(p.shape)


class _SetAsideRegion(_InPlaceRegion):
    """The CPU's weights: :meth:`offload` (level 1) keeps each parameter's tensor as it is and
    points the ``Parameter`` at :func:`_nan_broadcast` (no copy: the weights already are in host
    memory); :meth:`restore` points it back at the same tensor. Discarding (level 2) overwrites
    the bytes with ``0xFF`` as :class:`_InPlaceRegion` does.

    ``params()``: the model's ``Parameter`` objects (their ``.data`` is what moves)."""

    def __init__(self, params):
        super().__init__(lambda: [p.data for p in params()])
        self.params = params
        self.aside: list[torch.Tensor] | None = None

    def offload(self) -> int:
        """Set the tensors aside; returns 0 (bytes copied)."""
        ps = list(self.params())
        self.aside = [p.data for p in ps]
        for p in ps:
            p.data = _nan_broadcast(p.data)
        return 0

    def discard(self) -> None:
        self.restore(True, False)  # (a region set aside is awake again first: its bytes are overwritten)
        super().discard()

    def drop_backup(self) -> None:
        self.aside = None

    def restore(self, from_backup: bool, zero: bool) -> None:
        if self.aside is not None:
            for p, t in zip(self.params(), self.aside):
                p.data = t
            self.aside = None
        elif zero:
            super().restore(False, True)


class WorkerSleep:
    """One worker's two regions and what each holds now.

    Built by the :class:`~rlserve.engine.worker.worker.Worker` right after the model is loaded (with
    ``enable_sleep_mode``): on CUDA it packs the parameters into the weights arena then.
    ``arena_factory(nbytes)`` replaces :class:`~rlserve.engine.worker.cuda_vmm.VMMArena` (tests run
    the arena path on the CPU with a stand-in).

    Attributes:
        state: ``{tag: None | "offloaded" | "discarded"}`` (None: awake).
    """

    def __init__(self, worker, arena_factory=None):
        self.worker = worker
        self.device = worker.device
        self.vmm = self.device.type == "cuda" or arena_factory is not None
        self.state: dict[str, str | None] = {WEIGHTS: None, KV_CACHE: None}
        if self.vmm:
            from rlserve.engine.worker.cuda_vmm import VMMArena

            self._arena = arena_factory or (lambda n: VMMArena(self.device, n))
            arena, used = pack_parameters(worker.model, self._arena)
            self.regions = {WEIGHTS: _ArenaRegion(arena, used)}
            logger.info("sleep mode: %.1f MiB of parameters in a VMM arena at 0x%x", used / 2**20, arena.ptr)
        else:
            self.regions = {WEIGHTS: _SetAsideRegion(lambda: list(worker.model.parameters()))}
        self.last_copied = 0  # bytes the last sleep copied (level-1 offloads: 0 on the CPU)

    def kv_allocator(self, nbytes: int):
        """The ``alloc(shape, dtype)`` the model runner allocates the KV cache with: cut out
        of a KV arena of ``nbytes`` (plus alignment slack) on CUDA, plain zeros elsewhere (the
        CPU region then tracks the runner's tensors)."""
        if not self.vmm:
            self.regions[KV_CACHE] = _InPlaceRegion(
                lambda: [t for kv in self.worker.runner.kv_caches for t in kv])
            return None
        old = self.regions.get(KV_CACHE)
        if old is not None:
            old.arena.close()
        n_tensors = 2 * max(1, len(self.worker.runner.attn_layers))
        alloc = BumpAllocator(self._arena(int(nbytes) + n_tensors * ALIGN))
        self.regions[KV_CACHE] = _ArenaRegion(alloc.arena, alloc.arena.size)
        return alloc

    def bytes_of(self, tag: str) -> int:
        region = self.regions.get(tag)
        return region.nbytes if region is not None else 0

    def sleep(self, level: int, tags=TAGS) -> int:
        """Level 1: weights offloaded to host memory, KV cache discarded; level 2: both
        discarded (only ``tags``; regions already asleep are left as they are). Returns the
        bytes released: given back to the driver (VMM arenas); 0 for the CPU's in-place
        regions, whose memory stays allocated."""
        released = 0
        self.last_copied = 0
        for tag in TAGS:
            region = self.regions.get(tag)
            if tag not in tags or region is None or self.state[tag] is not None:
                continue
            if tag == WEIGHTS and level == 1:
                self.last_copied += region.offload()
                self.state[tag] = "offloaded"
            else:
                region.discard()
                region.drop_backup()
                self.state[tag] = "discarded"
            if region.releases:
                released += region.nbytes
        return released

    def wake_up(self, tags) -> int:
        """Memory back for ``tags`` (asleep ones; others are left alone): offloaded weights are
        copied back, discarded weights are undefined until filled, the KV cache is zeroed.
        Returns the bytes re-acquired.

        Raises:
            CUDADriverError: the memory is not available (``out_of_memory``); the region stays
                asleep.
        """
        got = 0
        for tag in TAGS:
            region = self.regions.get(tag)
            if tag not in tags or region is None or self.state[tag] is None:
                continue
            region.restore(from_backup=self.state[tag] == "offloaded", zero=tag == KV_CACHE)
            self.state[tag] = None
            got += region.nbytes
        return got


# ---- functions run on every TP worker through engine.collective_rpc -----------------------
def _get(worker) -> WorkerSleep:
    ws = getattr(worker, "sleep", None)
    if ws is None:
        raise RuntimeError("sleep mode is not enabled on this worker (enable_sleep_mode)")
    return ws


def worker_sleep(worker, level: int, tags: list | None = None) -> dict:
    """collective_rpc target: :meth:`WorkerSleep.sleep` (``tags`` default: both). Returns
    ``{"released": bytes given back to the driver, "copied": bytes copied to a host backup}``."""
    ws = _get(worker)
    released = ws.sleep(int(level), set(tags) if tags else TAGS)
    return {"released": int(released), "copied": int(ws.last_copied)}


def worker_wake_up(worker, tags: list) -> int:
    """collective_rpc target: :meth:`WorkerSleep.wake_up`."""
    return _get(worker).wake_up(set(tags))


def worker_reload_weights(worker) -> None:
    """collective_rpc target: fill the weights again from the checkpoint the engine started
    with (or the seeded dummy weights), in place (after a level-2 sleep nobody refilled)."""
    from rlserve.loader.model_loader import fill_weights

    fill_weights(worker.model, worker.config)
    if worker.device.type == "cuda":
        torch.cuda.synchronize(worker.device)


def worker_region_bytes(worker) -> dict:
    """collective_rpc target: ``{tag: bytes}`` each region holds while awake."""
    ws = _get(worker)
    return {tag: ws.bytes_of(tag) for tag in TAGS}


def worker_releases_memory(worker) -> bool:
    """collective_rpc target: whether a sleeping region's memory goes back to the driver (VMM
    arenas: CUDA) or stays allocated with its contents overwritten (the CPU's in-place regions)."""
    return bool(_get(worker).vmm)
