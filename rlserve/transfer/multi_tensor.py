"""One-launch ``s64sum`` checksums (and copies) of many CUDA tensors, and :func:`tensor_checksums`
(each tensor's checksum, through that launch where it can).

A weight update of an 8B model is ~400 tensors. Checksumming them one ``Tensor.sum()`` at a
time costs ~400 reductions, each with its launch and a partial wave of blocks: 12.7 ms on an
H200 for Qwen3-8B's 16.4 GB, where one flat sum of the same bytes takes 3.9 ms. And the server
read every byte twice: once to checksum the trainer's tensors, once to copy them into its
parameters (``_foreach_copy_``: 11.7 ms; one flat ``copy_``: 7.7 ms).

:class:`MultiTensorSum` cuts every tensor into chunks of at most :data:`CHUNK_WORDS` int64 words
and runs one Triton kernel over the chunk table (``chunk -> source address, destination address,
words``): each program sums its chunk's words as wrapping int64 (and, when destinations are
given, stores them there: a copy), and writes one partial sum; partial sums are added per tensor
with ``index_add_`` (integer addition mod 2^64 is associative, so the result is exactly
:func:`rlserve.transfer.wire.packing.checksum_tensor` of each source's bytes, whatever the chunking).
The copy and the checksum are then one pass over the sources.

Requirements (else :meth:`MultiTensorSum.build` returns ``None`` and callers keep the
per-tensor path): Triton importable, every tensor contiguous on one CUDA device, every address
8-byte aligned, each destination the same number of bytes as its source. Bytes past the last
whole int64 word of a tensor (sizes not a multiple of 8) are added on the host side with
``checksum_tensor`` of that tail.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import Iterable, Sequence

import torch

from rlserve.transfer.finite import checked, lane_masks, torch_nonfinite
from rlserve.transfer.host_ops import host_s64sums
from rlserve.transfer.wire.packing import as_bytes, checksum_tensor, checksum_values

#: Words (8 bytes) per chunk: 8 MiB, so a 16 GB update is ~2,000 programs (many waves on 132 SMs).
CHUNK_WORDS = 1 << 20
#: Words each program moves per loop iteration.
BLOCK_WORDS = 2048
#: Warps per program (with BLOCK_WORDS: 8 int64 words, four 16-byte loads, per thread per iteration).
NUM_WARPS = 8


@functools.lru_cache(maxsize=1)
def _kernel():
    """The Triton kernel (:func:`rlserve.transfer.multi_tensor_kernel.copy_sum`), imported on first use
    (``None`` when Triton is missing)."""
    try:
        from rlserve.transfer.multi_tensor_kernel import copy_sum
    except ImportError:
        return None
    return copy_sum


def available() -> bool:
    """Whether the kernel can run here (Triton importable and CUDA present)."""
    return torch.cuda.is_available() and _kernel() is not None


def warmup(device: torch.device, _allow_cpu: bool = False) -> int:
    """Launch the kernel in each of its variants (checksum only, copy + checksum, each with and without
    the NaN / inf test) on ``device``, so that none compiles inside a weight update (a cold compile
    takes ~1 s), which must not land inside a staged commit's pause or in an update
    that serving waits for. Every :meth:`MultiTensorSum.run` launches one of these four variants
    whatever its tensors (the kernel's arguments are int64 tables of fresh, aligned allocations; its
    constexprs are ``COPY``, ``CHECK`` and the fixed ``BLOCK``). Called by the engine's start-up warm-up
    (:func:`rlserve.engine.worker.jit_warmup.warm_weight_sync`, compiled in parallel with the model's
    kernels) and again when a receiver connects (by then a lookup). ``_allow_cpu``: CPU tensors (tests
    only: Triton's interpreter). Returns the launches (0 without CUDA or Triton: a no-op)."""
    device = torch.device(device)
    if not (_allow_cpu or (device.type == "cuda" and available())) or _kernel() is None:
        return 0
    n = 0
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        src = torch.zeros(64, dtype=torch.int64, device=device)
        for check in (False, True):
            for dsts in (None, [torch.empty_like(src)]):
                MultiTensorSum.build([src], dsts, check_finite=check, _allow_cpu=_allow_cpu).run()
                n += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return n


class MultiTensorSum:
    """A prepared one-launch checksum (optionally copy) over fixed tensors.

    Build once with :meth:`build` for tensors that stay where they are (mapped ipc tensors,
    parameters), then :meth:`run` every update. Holds references to every tensor given.

    Attributes:
        n: number of sources.
    """

    def __init__(self, srcs, dsts, table: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                 tails: list[tuple[int, torch.Tensor, torch.Tensor | None]], masks: torch.Tensor | None = None,
                 check_dtypes: list | None = None):
        self._srcs, self._dsts = list(srcs), None if dsts is None else list(dsts)
        self._src_ptrs, self._dst_ptrs, self._words, self._owner = table
        self._tails = tails
        self._masks = masks  # int64 [chunks, 3]: the finite test's lane masks (None: no test)
        self._check_dtypes = check_dtypes
        #: after :meth:`run` with the test on: int64 ``[n]``, non-zero where a source holds NaN / inf
        self.bad: torch.Tensor | None = None
        self.n = len(self._srcs)
        self.device = self._srcs[0].device if self._srcs else None

    @classmethod
    def build(cls, srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor] | None = None,
              chunk_words: int = CHUNK_WORDS, _allow_cpu: bool = False, check_finite: bool = False,
              check_dtypes: Sequence[torch.dtype | None] | None = None) -> "MultiTensorSum | None":
        """Prepare the chunk table for ``srcs`` (and ``dsts``: copy ``srcs[i]`` into ``dsts[i]``).

        Args:
            srcs: contiguous CUDA tensors, any dtypes, one device.
            dsts: ``None`` (checksums only) or contiguous tensors of the same byte sizes on the
                same device (dtypes may differ: bytes are copied as they are).
            chunk_words: int64 words per program.
            _allow_cpu: accept CPU tensors (tests only: Triton's interpreter, ``TRITON_INTERPRET=1``).
            check_finite: the same pass also tests every element for NaN / inf
                (:mod:`rlserve.transfer.finite`; :attr:`bad` after :meth:`run`).
            check_dtypes: with ``check_finite``, the dtype each source's bytes hold (default:
                the sources' own; e.g. uint8 views of a packed bucket's slots).
        Returns:
            The prepared op, or ``None`` when the requirements of the module docstring are not met.
        """
        if not srcs or _kernel() is None or not (_allow_cpu or available()):
            return None
        dev = srcs[0].device
        pairs = list(zip(srcs, dsts)) if dsts is not None else [(s, None) for s in srcs]
        if dsts is not None and len(dsts) != len(srcs):
            return None
        src_ptrs: list[int] = []
        dst_ptrs: list[int] = []
        words: list[int] = []
        owner: list[int] = []
        tails = []
        dts = list(check_dtypes) if check_dtypes is not None else [s.dtype for s in srcs]
        lanes: list[tuple[int, int, int]] = []
        for i, (s, d) in enumerate(pairs):
            nb = s.numel() * s.element_size()
            if s.device != dev or not (s.is_cuda or _allow_cpu) or not s.is_contiguous() or s.data_ptr() % 8:
                return None
            if d is not None and (d.device != dev or not d.is_contiguous() or d.data_ptr() % 8
                                  or d.numel() * d.element_size() != nb):
                return None
            full = nb // 8
            if nb % 8:
                su8 = s.reshape(-1).view(torch.uint8)[full * 8:]
                du8 = None if d is None else d.reshape(-1).view(torch.uint8)[full * 8:]
                tails.append((i, su8, du8))
            for w0 in range(0, full, chunk_words):
                src_ptrs.append(s.data_ptr() + 8 * w0)
                dst_ptrs.append(0 if d is None else d.data_ptr() + 8 * w0)
                words.append(min(chunk_words, full - w0))
                owner.append(i)
                if check_finite:
                    lanes.append(lane_masks(dts[i]))
        mk = functools.partial(torch.tensor, dtype=torch.int64, device=dev)
        table = (mk(src_ptrs), mk(dst_ptrs), mk(words), mk(owner))
        masks = (mk(lanes) if lanes else mk([[0, 0, 0]])) if check_finite else None
        return cls(srcs, dsts, table, tails, masks, dts if check_finite else None)

    def relocated(self, delta: int, keep: torch.Tensor | None = None, dst_delta: int = 0) -> "MultiTensorSum | None":
        """The same op reading every source ``delta`` bytes away (and, with ``dst_delta``, writing
        every destination that far away): the same bytes at another address (a packed bucket the
        server maps anew at each update, :mod:`rlserve.transfer.server.bucket_plan`; a trainer's
        fresh pack buffer, :mod:`rlserve.transfer.wire.pack_device`); one int64 add on the device
        per table, no per-tensor work. The returned op holds ``keep`` (the memory it uses now),
        not the old sources / destinations. ``None`` when the op has tails (a source of a size
        that is not a multiple of 8 bytes: its tail is a view of the old memory)."""
        if self._tails:
            return None
        new = copy.copy(self)
        new._src_ptrs = self._src_ptrs + delta if delta else self._src_ptrs
        if dst_delta and self._dsts is not None:
            new._dst_ptrs = self._dst_ptrs + dst_delta
            new._dsts = []
        new._srcs = [] if keep is None else [keep]
        new.bad = None
        return new

    def run(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Queue the kernel on the current stream (asynchronous); returns the per-source ``s64sum``
        checksums as an int64 tensor of shape ``[n]`` on the device (read it with ``.tolist()``);
        built with ``check_finite``, :attr:`bad` then holds the non-finite test (queued too).
        ``out``: an int64 ``[n]`` tensor on the device to write them into (e.g. one shared with
        the server over CUDA IPC)."""
        if out is None:
            out = torch.zeros(self.n, dtype=torch.int64, device=self.device)
        else:
            out.zero_()
        check = self._masks is not None
        if check:
            self.bad = torch.zeros(self.n, dtype=torch.int64, device=self.device)
        nchunks = self._words.numel()
        if nchunks:
            partial = torch.empty(nchunks, dtype=torch.int64, device=self.device)
            pbad = torch.empty(nchunks if check else 1, dtype=torch.int64, device=self.device)
            _kernel()[(nchunks,)](self._src_ptrs, self._dst_ptrs, self._words, partial,
                                  self._masks if check else partial, pbad, COPY=self._dsts is not None,
                                  CHECK=check, BLOCK=BLOCK_WORDS, num_warps=NUM_WARPS)
            out.index_add_(0, self._owner, partial)
            if check:
                self.bad.index_add_(0, self._owner, pbad)
        for i, su8, du8 in self._tails:
            if du8 is not None:
                du8.copy_(su8)
            out[i] += checksum_tensor(su8)
            dt = self._check_dtypes[i] if check else None
            if checked(dt):  # (the whole elements of a byte view's tail)
                self.bad[i] += torch_nonfinite(su8[: su8.numel() - su8.numel() % dt.itemsize].view(dt))
        return out


def tensor_checksums(tensors: Iterable[torch.Tensor]) -> list[int]:
    """``s64sum`` of each tensor, with one host sync per device at the end (not per tensor).

    A list or tuple of contiguous CUDA tensors on one device is summed in one Triton launch
    (:class:`MultiTensorSum`; ~400 tensors of an 8B model: one
    pass at HBM speed instead of ~400 reductions). Any other iterable is consumed one tensor at
    a time and only the sums are kept: a tensor it creates (an FSDP gather, a cast) is freed as
    soon as its sum is queued."""
    if isinstance(tensors, (list, tuple)) and len(tensors) > 1 and all(t.is_cuda for t in tensors):
        op = MultiTensorSum.build([t.detach() for t in tensors])
        if op is not None:
            return op.run().tolist()
    if isinstance(tensors, (list, tuple)) and all(t.device.type == "cpu" for t in tensors):
        return host_s64sums([as_bytes(t) for t in tensors])  # multi-threaded numpy, no torch pool
    return checksum_values([checksum_tensor(as_bytes(t)) for t in tensors])
