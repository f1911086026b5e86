"""Native paged decode attention for CPU (float32): the C kernel in ``csrc/paged_decode.c``.

Decode steps on CPU are bound by reading the KV cache: every step reads each running
sequence's whole context once per layer. PyTorch alone cannot read a paged cache in place
(blocks are not a strided view), so the portable path first gathers every context into a
padded batch (a copy of the whole cache in use, per layer per step) and then runs SDPA,
whose CPU kernel is tuned for long queries, not one query token. The C kernel walks each
sequence's block table and reads every K/V row once, in place, with an online softmax
(see the C file for layouts). Measured on the 2-core AMD EPYC CI machine (SmolLM2-135M
shapes: 9 heads, 3 KV heads, head_dim 64; 64 sequences of 128-512 tokens; one thread; CPU
time per layer, so that the machine's other load does not count; 2026-12-01): gather +
SDPA 35-40 ms, index_select + SDPA (the fallback now) 20-27 ms, this kernel 6-8 ms. A whole
SmolLM2 decode step at batch 64 then takes ~0.7 s of CPU instead of ~2.5 s.

The kernel is compiled at first use with the system C compiler (``$CC``, else ``cc``,
``gcc`` or ``clang``: the same requirement ``torch.compile`` has on CPU), with
``-O3 -march=native -fopenmp``, and cached under ``<rlserve cache>/kernels/`` (see
:func:`rlserve.download.default_cache_root`) by a hash of the source, the flags, the
compiler and the CPU's flags; later starts load it in milliseconds. A build takes ~1 s.
Without a compiler, or if the build fails, :func:`paged_decode` returns ``None`` and the
caller keeps PyTorch (one warning is logged). ``RLSERVE_CPU_ATTENTION=torch`` turns the
kernel off.

With ``-fopenmp`` the library links ``libgomp.so.1``; torch's own ``libgomp.so.1`` is
already loaded under that name, so the dynamic loader binds the kernel to torch's OpenMP
runtime (one thread pool, sized by ``torch.set_num_threads``), not a second one.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SRC = Path(__file__).with_name("csrc") / "paged_decode.c"
_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-std=c11"]
_ENV = "RLSERVE_CPU_ATTENTION"

_lock = threading.Lock()
_state: dict = {}  # "fn": the ctypes function, or None once loading failed


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU model and flags (``/proc/cpuinfo``)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build(cc: str, src: bytes, out: Path) -> None:
    """Compile ``src`` into ``out`` (atomically: a temp file renamed into place), with
    OpenMP when the compiler has it. Raises ``RuntimeError`` with the compiler's output."""
    out.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for extra in (["-fopenmp"], []):
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        cmd = [cc, *_FLAGS, *extra, str(_SRC), "-o", tmp, "-lm"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if r.returncode == 0:
            os.replace(tmp, out)
            return
        os.unlink(tmp)
        errors.append(f"{' '.join(cmd)}: {r.stderr.strip()[-500:]}")
    raise RuntimeError("; ".join(errors))


def _load():
    """The kernel's ctypes function, building it on first use; ``None`` when unavailable."""
    if "fn" in _state:
        return _state["fn"]
    with _lock:
        if "fn" in _state:
            return _state["fn"]
        fn = None
        try:
            cc = _compiler()
            if cc is None:
                raise RuntimeError("no C compiler found ($CC, cc, gcc, clang)")
            src = _SRC.read_bytes()
            key = hashlib.sha256(b"\0".join([src, " ".join(_FLAGS).encode(), cc.encode(),
                                             _cpu_signature().encode()])).hexdigest()[:20]
            from rlserve.download import default_cache_root

            lib_path = default_cache_root() / "kernels" / f"paged_decode-{key}.so"
            if not lib_path.exists():
                _build(cc, src, lib_path)
                logger.info("built the CPU paged-attention kernel: %s", lib_path)
            lib = ctypes.CDLL(str(lib_path))
            fn = lib.rlserve_paged_decode_f32
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]
        except Exception as e:  # noqa: BLE001 - any failure means "use PyTorch"
            logger.warning("CPU paged-attention kernel unavailable, using PyTorch attention: %s", e)
            fn = None
        _state["fn"] = fn
        return fn


def available() -> bool:
    """True when the kernel is enabled (``RLSERVE_CPU_ATTENTION`` is not ``torch``) and loads."""
    return os.environ.get(_ENV, "").lower() != "torch" and _load() is not None


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Decode attention (one query token per sequence) read in place from the paged cache.

    Args:
        q: ``[B, H, D]`` float32 on CPU (copied if not contiguous).
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` float32, contiguous, on CPU,
            already holding this step's K/V.
        block_tables: ``[B, max_blocks]`` int32 on CPU.
        seq_lens: ``[B]`` int32 on CPU, context length of each sequence including this token.
        scale: softmax scale.

    Returns:
        ``[B, H, D]`` float32, or ``None`` when the kernel cannot take these inputs (not
        float32/CPU/contiguous, ``H`` not a multiple of ``Hkv`` or more than 32 query heads
        per KV head, ``D`` not a multiple of 8 or above 256, blocks above 128 tokens, kernel
        off or not built): the caller then uses PyTorch.
    """
    if q.device.type != "cpu" or q.dtype != torch.float32 or k_cache.dtype != torch.float32:
        return None
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape):
        return None
    if not available():
        return None
    fn = _state["fn"]
    B, H, D = q.shape
    _, block_size, Hkv, Dk = k_cache.shape
    if Dk != D or B == 0:
        return None
    q = q.contiguous()
    bt = block_tables.to(torch.int32).contiguous()
    sl = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    rc = fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), bt.data_ptr(), sl.data_ptr(), out.data_ptr(),
            B, H, Hkv, D, block_size, bt.shape[1], float(scale), torch.get_num_threads())
    return out if rc == 0 else None
