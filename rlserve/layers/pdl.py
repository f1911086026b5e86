"""Programmatic dependent launch (PDL) for the batch-1 decode kernels: what it needs, the switch.

With PDL (CUDA, sm_90+) a kernel launched with the programmatic-serialization attribute may
start while the kernel before it in the stream still runs, as soon as every program of that one
has called ``griddepcontrol.launch_dependents`` (Triton: ``tl.extra.cuda.gdc_launch_dependents``);
it must then call ``griddepcontrol.wait`` (``gdc_wait``: the kernel before it has completed and
its writes are visible) before it reads anything a kernel before it wrote, and write nothing
before that. In a batch-1 decode step the kernels are small (1-5 us) and back to back, so the
launch gap between two of them is a large share of each; PDL hides it.

Who uses it: the batch-1 GEMVs (:mod:`rlserve.layers.gemv`: each loads its first weights, which
nothing writes during a step, then triggers its dependents, then waits) and, switched on with
:func:`set_neighbours` (off by default: written in session 15 and not yet run on a GPU), at one
decode row the kernels between them (:func:`neighbours`: the q/k-norm + rotary + KV-write kernel,
decode attention and its split reduce: each waits first, then triggers; nothing is read before
the wait, so their order is the plain one -- transitively too: a kernel completes only after its
own wait returned, so everything before it in the stream has completed).

What it needs (:func:`unavailable`): an NVIDIA GPU of compute capability 9.0 or later, a CUDA
driver of 12.3 or later (12030: a CUDA graph that captures such launches keeps their
programmatic edges), a Triton whose CUDA backend takes ``launch_pdl`` and has the GDC ops; not a
ROCm build. Where one is missing, or the first PDL launch raises (:func:`failed`), the kernels
launch plainly -- the same arithmetic -- and the reason is logged once.

The switch: ``RLSERVE_DECODE_GEMV`` ``auto`` (the default) or ``pdl`` (``1`` and ``0`` leave PDL off),
read at import; :func:`set_requested` (tests, A/B runs). CUDA graphs keep what they captured.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from rlserve import envs

_REQUESTED = [envs.RLSERVE_DECODE_GEMV in ("pdl", "auto")]
_NEIGHBOURS = [False]  # the attention / q-k-norm-rope kernels too (set_neighbours: off until measured)
_WHY: dict[tuple, str | None] = {}  # (device type, index) -> why PDL cannot run there (None: it can)
_DRIVER: list = []  # the CUDA driver's version (cuDriverGetVersion), once read
MIN_DRIVER = 12030  # CUDA 12.3: stream capture keeps a launch's programmatic dependency
logger = logging.getLogger(__name__)


def set_requested(on: bool) -> bool:
    """Ask for PDL (where :func:`unavailable` allows it) or not; returns the previous setting."""
    prev = _REQUESTED[0]
    _REQUESTED[0] = bool(on)
    return prev


def requested() -> bool:
    return _REQUESTED[0]


def set_neighbours(on: bool) -> bool:
    """Whether the kernels between the GEMVs (:func:`neighbours`) launch with PDL as well when it
    is requested (default False: not yet run on a GPU; ``decode_step.py --decode-gemv pdla`` and
    ``tests/gpu/test_gemv_gpu.py`` switch it on); returns the previous setting."""
    prev = _NEIGHBOURS[0]
    _NEIGHBOURS[0] = bool(on)
    return prev


def _key(device: torch.device) -> tuple:
    if device.type == "cuda" and device.index is None:
        return ("cuda", torch.cuda.current_device())
    return (device.type, device.index)


def cuda_driver_version() -> int | None:
    """The CUDA driver's version as ``cuDriverGetVersion`` gives it (``1000 * major + 10 * minor``:
    12030 is 12.3), or None where ``libcuda`` cannot be asked (no NVIDIA driver, ROCm)."""
    if not _DRIVER:
        v = None
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            out = ctypes.c_int(0)
            if lib.cuDriverGetVersion(ctypes.byref(out)) == 0:
                v = out.value
        except (OSError, AttributeError):
            pass
        _DRIVER.append(v)
    return _DRIVER[0]


def _triton_pdl() -> bool:
    """Triton's CUDA backend takes ``launch_pdl`` and has the GDC ops."""
    try:
        import triton.language as tl
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    return ("launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})
            and hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents"))


def unavailable(device: torch.device) -> str | None:
    """Why the kernels cannot use programmatic dependent launch on ``device`` (module docstring:
    card, driver, Triton; or the error of a first launch that failed), or None when they can.
    Checked once per device; independent of :func:`set_requested`."""
    key = _key(device)
    if key not in _WHY:
        why = None
        if device.type != "cuda":
            why = f"not a CUDA device ({device.type})"
        elif torch.version.hip is not None:
            why = "ROCm build (PDL is CUDA's)"
        else:
            cc = torch.cuda.get_device_capability(key[1])
            drv = cuda_driver_version()
            if cc[0] < 9:
                why = f"compute capability {cc[0]}.{cc[1]} < 9.0"
            elif drv is not None and drv < MIN_DRIVER:
                why = f"CUDA driver {drv // 1000}.{drv % 1000 // 10} < 12.3"
            elif not _triton_pdl():
                why = "this Triton has no launch_pdl / gdc ops"
            if why is not None and _REQUESTED[0]:
                logger.info("programmatic dependent launch unavailable (%s): the batch-1 decode kernels launch plainly", why)
        _WHY[key] = why
    return _WHY[key]


def failed(device: torch.device, e: Exception) -> None:
    """A PDL launch raised: no PDL on ``device`` from now on (logged once)."""
    why = f"the first PDL launch failed: {type(e).__name__}: {e}"
    _WHY[_key(device)] = why
    logger.warning("%s: the batch-1 decode kernels launch plainly from now on", why)


def on(device: torch.device) -> bool:
    """PDL requested and available on ``device``."""
    return _REQUESTED[0] and unavailable(device) is None


def neighbours(x: torch.Tensor, rows: int) -> bool:
    """Whether the decode kernels between the GEMVs launch with PDL for a step of ``rows`` rows
    on ``x``'s device: one row (where the GEMVs run), PDL on there, :func:`set_neighbours` on."""
    return rows == 1 and _NEIGHBOURS[0] and x.is_cuda and on(x.device)


def launch(kernel, grid, args: tuple, meta: dict, device: torch.device, use: bool) -> None:
    """``kernel[grid](*args, **meta, PDL=use)``, with ``launch_pdl`` when ``use``; a PDL launch that
    raises outside a CUDA-graph capture marks the device (:func:`failed`) and launches plainly."""
    if use:
        try:
            kernel[grid](*args, **meta, PDL=True, launch_pdl=True)
            return
        except Exception as e:  # noqa: BLE001 -- any compile / launch failure: the plain kernel instead
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise  # a failed launch inside a capture leaves it invalid: the caller's error
            failed(device, e)
    kernel[grid](*args, **meta, PDL=False)
