"""The Triton kernel of :mod:`rlserve.transfer.multi_tensor` (imported only where Triton is; that
module's ``_kernel()`` returns ``None`` without it).

At module level, not defined inside a function, so that the start-up warm-up's parallel precompile
(:mod:`rlserve.engine.worker.triton_precompile`) can find it again in a child process by
``import rlserve.transfer.multi_tensor_kernel; .copy_sum`` and compile its variants there.

``copy_sum`` arguments (one program per chunk ``c``; every table int64 ``[chunks]``):
    src_ptrs, dst_ptrs: byte addresses of the chunk's first int64 word in the source / destination
        (``dst_ptrs`` read only with ``COPY``).
    words: int64 words in the chunk.
    partial: out, int64 ``[chunks]``: the chunk's wrapping int64 sum.
    masks: int64 ``[chunks, 3]``: :func:`rlserve.transfer.finite.lane_masks` of the chunk's dtype
        (read only with ``CHECK``).
    partial_bad: out, int64 ``[chunks]``: lanes of the chunk that hold NaN / inf (written only with ``CHECK``).
    COPY, CHECK: constexpr booleans (copy the words; test them for NaN / inf); BLOCK: words per loop step.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def copy_sum(src_ptrs, dst_ptrs, words, partial, masks, partial_bad, COPY: tl.constexpr, CHECK: tl.constexpr,
             BLOCK: tl.constexpr):
    c = tl.program_id(0)
    src = tl.load(src_ptrs + c).to(tl.pointer_type(tl.int64))
    n = tl.load(words + c)
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    if COPY:
        dst = tl.load(dst_ptrs + c).to(tl.pointer_type(tl.int64))
    if CHECK:  # rlserve.transfer.finite.lane_masks of the chunk's dtype (H = 0: not tested)
        mm = tl.load(masks + 3 * c)
        ll = tl.load(masks + 3 * c + 1)
        hh = tl.load(masks + 3 * c + 2)
        bad = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(src + offs, mask=m, other=0)
        if COPY:
            tl.store(dst + offs, x, mask=m)
        acc += x
        if CHECK:
            v = (x & mm) ^ mm  # a lane is zero where its element's exponent bits are all set
            bad |= (v - ll) & (v ^ -1) & hh
    tl.store(partial + c, tl.sum(acc, axis=0))
    if CHECK:
        tl.store(partial_bad + c, tl.sum((bad != 0).to(tl.int64), axis=0))
