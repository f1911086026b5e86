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

The kernel is built at first use and cached (:mod:`rlserve.layers.cpu_build`: the system C
compiler, ``-O3 -march=native -fopenmp``, torch's OpenMP runtime). Without a compiler, or if
the build fails, :func:`paged_decode` returns ``None`` and the caller keeps PyTorch (one
warning is logged). ``RLSERVE_CPU_ATTENTION=torch`` turns the kernel off.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from rlserve import envs
from rlserve.layers.cpu_build import load_library


_lock = threading.Lock()
_state: dict = {}  # "fn": the ctypes function, or None once loading failed


def _load():
    """The kernel's ctypes function, building it on first use; ``None`` when unavailable."""
    if "fn" in _state:
        return _state["fn"]
    with _lock:
        if "fn" not in _state:
            lib = load_library("paged_decode.c")
            _state["fn"] = None if lib is None else bind(lib)
        return _state["fn"]


def bind(lib: ctypes.CDLL):
    """The kernel's entry point ``rlserve_paged_decode_f32`` in a library built from
    ``csrc/paged_decode.c`` (any flags), with its argument types set."""
    fn = lib.rlserve_paged_decode_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]
    return fn


def available() -> bool:
    """True when the kernel is enabled (``RLSERVE_CPU_ATTENTION`` is not ``torch``) and loads."""
    return envs.RLSERVE_CPU_ATTENTION.lower() != "torch" and _load() is not None


def call(fn, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
         seq_lens: torch.Tensor, out: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
         nthreads: int) -> int:
    """The one call of the kernel ``fn`` (:func:`bind`'s; its argument order lives here only).

    ``q``, ``out``: ``B`` rows of ``num_heads * head_dim`` contiguous float32 (``[B, H, D]``
    or ``[B, H * D]``); caches ``[num_blocks, block_size, Hkv, D]`` contiguous float32;
    ``block_tables`` ``[B, max_blocks]`` and ``seq_lens`` ``[B]`` contiguous int32. Nothing is
    checked here (see :func:`paged_decode`). Returns the kernel's code: 0, or non-zero when it
    refuses the shapes (``out`` then unwritten)."""
    return fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
              out.data_ptr(), q.shape[0], num_heads, num_kv_heads, head_dim, k_cache.shape[1], block_tables.shape[1],
              float(scale), nthreads)


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
    _, _, Hkv, Dk = k_cache.shape
    if Dk != D or B == 0:
        return None
    q = q.contiguous()
    bt = block_tables.to(torch.int32).contiguous()
    sl = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    from rlserve.layers import cpu_gemm

    if cpu_gemm.active() and torch.get_num_threads() == 1:  # sequences over the CPU team (same kernel)
        rc = cpu_gemm.paged_decode_call(q, k_cache, v_cache, bt, sl, out, H, Hkv, D, scale)
    else:
        rc = call(fn, q, k_cache, v_cache, bt, sl, out, H, Hkv, D, scale, torch.get_num_threads())
    return out if rc == 0 else None
