"""Replayable weight loads: record the copies one ``load_weights`` call makes, replay them batched.

A weight update over CUDA IPC hands the server the *same* trainer tensors every sync (mapped
once, cached by the receiver), and ``load_weights`` always moves them to the same places (fused
``qkv_proj`` / ``gate_up_proj`` rows, the TP rank's shard). The Python walk through the loaders
(name mapping, shard arithmetic, one ``copy_`` each: ~30-60 us per tensor, ~20 ms for an 8B
model's 399 tensors) then costs more than the copies themselves (16 GB at ~4 TB/s: ~8 ms).

:func:`record_load` runs a load once under a ``TorchDispatchMode`` that sees every ATen op and
keeps each ``copy_(dst, src)`` whose ``src`` is a view of one of the given source tensors' memory.
The load is *replayable* only when every write it made was such a copy, or a constant fill
(``zero_`` / ``fill_``, e.g. vocabulary padding rows) of memory no copy writes: a copy from a
temporary (a dtype cast or ``contiguous()`` done in Python, fp8 quantization) or any other
in-place write would be lost on replay, so such a load gives no plan and the caller keeps
calling ``load_weights``. :meth:`CopyPlan.replay` then issues the recorded same-dtype contiguous
copies as one launch (:mod:`rlserve.transfer.multi_tensor` on CUDA, else ``torch._foreach_copy_``).

The plan holds the destination views (into the model's parameters, updated in place, never
reallocated) and the source views (into the mapped trainer memory): it is valid while both
live, i.e. for one receiver session with unchanged handles; the caller keys it on the sources'
addresses, shapes, strides and dtypes (:func:`plan_key`; computed once per :class:`FixedPairs`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlserve.transfer.finite import Scan
from rlserve.transfer.host_ops import host_copy_many, host_copy_scan, host_copyable

_COPY = torch.ops.aten.copy_.default
_UNSET = object()
_CONSTANT_FILLS = (torch.ops.aten.zero_.default, torch.ops.aten.fill_.Scalar)


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last)`` byte addresses ``t`` can touch (a superset for strided views)."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    extent = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


class CopyPlan:
    """Recorded ``(dst, src)`` copies (``dst.copy_(src)``: any dtypes, any strides) and constant
    fills of one load. ``len(plan)``: the number of copies."""

    def __init__(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], fills: Sequence[tuple] = ()):
        self._fills = list(fills)
        fast_d, fast_s, slow = [], [], []
        for d, s in pairs:
            if d.dtype == s.dtype and d.numel() == s.numel() and d.is_contiguous() and s.is_contiguous() \
                    and d.device == s.device:
                fast_d.append(d)
                fast_s.append(s)
            else:
                slow.append((d, s))
        self._fast = (fast_d, fast_s)
        self._slow = slow
        self._fused: dict[tuple, object] = {}  # sources' addresses -> MultiTensorSum (None: cannot)
        self._copy_op = _UNSET  # MultiTensorSum over the fast pairs (None: use _foreach_copy_)

    def replay(self, sum_sources: Sequence[torch.Tensor] | None = None, check_finite: bool = False) -> Scan | None:
        """Issue every constant fill, then every copy, on the current stream (asynchronous on CUDA).

        The same-dtype contiguous copies go in one launch: the Triton chunk-table copy where it
        can run (Qwen3-8B's 399 tensors on an H200: ~8 ms, the speed of one flat ``copy_``), on
        the CPU numpy byte copies on a few threads of ours (:mod:`rlserve.transfer.host_ops`), else
        ``_foreach_copy_`` (~12 ms there). With ``sum_sources`` (the load's source tensors, in
        order) and when :meth:`_fused_op` allows, that launch (on the CPU: those numpy copies)
        also takes their ``s64sum`` checksums (each byte read once) and -- ``check_finite`` --
        tests them for NaN / inf (:mod:`rlserve.transfer.finite`), returned as a
        :class:`~rlserve.transfer.finite.Scan` (int64 / flags ``[len(sum_sources)]`` on the
        sources' device; on CUDA queued on the current stream); otherwise ``None`` (the caller
        checksums the sources itself)."""
        fused = self._fused_op(sum_sources, check_finite) if sum_sources is not None else None
        for func, args, kwargs in self._fills:
            func(*args, **kwargs)
        sums = None
        d, s = self._fast
        if isinstance(fused, list):  # CPU: numpy copies, each piece summed (and tested) right after its copy
            got, bad = host_copy_scan(fused, s64sums=True, finite=check_finite)
            sums = Scan(torch.tensor(got, dtype=torch.int64), None if bad is None else torch.tensor(bad))
        elif fused is not None:
            sums = Scan(fused.run(), fused.bad)
        elif d:
            if self._copy_op is _UNSET:
                from rlserve.transfer.multi_tensor import MultiTensorSum

                self._copy_op = MultiTensorSum.build(s, d) if d[0].is_cuda else None
            if self._copy_op is not None:
                self._copy_op.run()
            elif d[0].device.type == "cpu" and s[0].device.type == "cpu":
                host_copy_many(list(zip(d, s)))  # numpy on our threads: see rlserve.transfer.host_ops
            else:
                torch._foreach_copy_(d, s)
        for dst, src in self._slow:
            dst.copy_(src)
        return sums

    def _fused_op(self, sources: Sequence[torch.Tensor], check_finite: bool = False):
        """How to do every fast copy and sum each of ``sources`` in the same pass: on CUDA a
        :class:`~rlserve.transfer.multi_tensor.MultiTensorSum`, on the CPU the ``(dst, src)``
        pairs ordered like ``sources`` (for :func:`host_copy_many`); ``None``: not possible.
        Only when each source is copied whole by exactly one same-dtype contiguous copy and no
        other fast copy exists (TP=1, dtypes match; a TP shard reads slices of its sources; a
        tied ``lm_head`` that is not loaded leaves a source unread)."""
        key = sources.sum_key if isinstance(sources, FixedSources) else _sum_key(sources)
        if (key, check_finite) in self._fused:
            return self._fused[key, check_finite]
        from rlserve.transfer.multi_tensor import MultiTensorSum

        op = None
        pairs = _pairs_by_source(self._fast, key)
        if pairs is not None:
            if all(host_copyable(d, s) for d, s in pairs):
                op = pairs
            else:
                op = MultiTensorSum.build([s for _, s in pairs], [d for d, _ in pairs], check_finite=check_finite)
        self._fused[key, check_finite] = op
        return op

    def copies(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Every recorded ``(dst, src)`` copy, or ``None`` when the plan also fills constants (the
        load is then more than copies out of its sources)."""
        if self._fills:
            return None
        return list(zip(*self._fast)) + list(self._slow)

    def __len__(self) -> int:
        return len(self._fast[0]) + len(self._slow)


def _pairs_by_source(fast: tuple[list, list], key: tuple) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The fast ``(dst, src)`` copies ordered like the sources whose :func:`_sum_key` is ``key``:
    the ``k``-th source with a given (address, numel, dtype) takes the ``k``-th copy that reads
    exactly those bytes. Sources may alias (a trainer that gathers every layer into one reused
    set of buffers hands the same memory under every layer's names, each copied to its own
    parameter): the aliases hold the same bytes, so whichever copy a source is matched with, its
    sum and non-finite test are its own. ``None`` unless every fast copy is matched to exactly
    one source and every source to one copy."""
    fast_d, fast_s = fast
    if len(fast_d) != len(key):
        return None
    by_src: dict[tuple, list] = {}
    for d, s in zip(fast_d, fast_s):
        by_src.setdefault((s.data_ptr(), s.numel(), s.dtype), []).append((d, s))
    pairs = []
    taken: dict[tuple, int] = {}
    for k in key:
        i = taken.get(k, 0)
        got = by_src.get(k)
        if got is None or i >= len(got):
            return None
        taken[k] = i + 1
        pairs.append(got[i])
    return pairs


class _Recorder(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: torch wraps a mode's ``__torch_dispatch__`` in ``torch._disable_dynamo`` unless
        this says otherwise, and that wrapper imports ``torch._dynamo`` at its first call: the
        first weight sync's first recorded load paid 1.9-2.3 s of CPU for it on the 2-core
        machine (4-8 s of wall time under load). Nothing is ever compiled inside this mode."""
        return False

    def __init__(self, src_ptrs: set[int]):
        super().__init__()
        self.src_ptrs = src_ptrs
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.fills: list[tuple] = []
        self.reason: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is _COPY:
            dst, src = args[0], args[1]
            if dst.numel() == 0:
                return out
            if isinstance(src, torch.Tensor) and src.untyped_storage().data_ptr() in self.src_ptrs:
                self.pairs.append((dst, src))
            elif self.reason is None:
                self.reason = "a copy from a temporary tensor (cast, contiguous or computed values)"
        elif self.reason is None and func._schema.is_mutable:
            target = args[0] if args else None
            if isinstance(target, torch.Tensor) and target.numel() == 0:
                return out  # an empty write changes nothing
            if func in _CONSTANT_FILLS and isinstance(target, torch.Tensor):
                self.fills.append((func, args, kwargs or {}))  # e.g. zeroed vocabulary padding rows
            else:
                self.reason = f"an in-place write other than a copy ({func})"
        return out


def record_load(load: Callable[[list[tuple[str, torch.Tensor]]], object],
                pairs: list[tuple[str, torch.Tensor]]) -> tuple[CopyPlan | None, str | None]:
    """Run ``load(pairs)`` once (it takes effect) and record it.

    Args:
        load: e.g. ``worker.load_weights``; called exactly once with ``pairs``.
        pairs: ``[(hf_name, tensor)]``; the tensors' storages are the allowed copy sources.
    Returns:
        ``(plan, None)`` when every write of the load was a copy out of ``pairs``' memory, else
        ``(None, reason)``.
    Raises:
        whatever ``load`` raises (nothing is recorded then).
    """
    ptrs = {t.untyped_storage().data_ptr() for _, t in pairs if t.numel()}
    rec = _Recorder(ptrs)
    with rec:
        load(pairs)
    if rec.reason is not None:
        return None, rec.reason
    # fills are replayed before the copies: only sound when no copy writes where a fill did
    spans = sorted(_byte_span(d) for d, _ in rec.pairs)
    for _f, args, _k in rec.fills:
        a, b = _byte_span(args[0])
        if any(a < e and s < b for s, e in spans):
            return None, "a constant fill overlapping a copied region"
    return CopyPlan(rec.pairs, rec.fills), None


def plan_key(pairs: Sequence[tuple[str, torch.Tensor]]) -> tuple:
    """What a recorded plan depends on: names and the sources' memory, dtypes, shapes, strides
    (remembered by a :class:`FixedPairs`)."""
    if isinstance(pairs, FixedPairs):
        return pairs.key
    return _plan_key(pairs)


def source_tensors(pairs: Sequence[tuple[str, torch.Tensor]]) -> Sequence[torch.Tensor]:
    """The tensors of ``pairs``, in order (for :meth:`CopyPlan.replay`'s ``sum_sources``)."""
    return pairs.sources if isinstance(pairs, FixedPairs) else [t for _, t in pairs]


def _plan_key(pairs) -> tuple:
    return tuple((n, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()), str(t.device)) for n, t in pairs)


def _sum_key(sources) -> tuple:
    return tuple((t.data_ptr(), t.numel(), t.dtype) for t in sources)


class FixedSources(tuple):
    """A tuple of tensors that keep their memory and layout while it lives; its
    :meth:`CopyPlan._fused_op` key is computed once."""

    @functools.cached_property
    def sum_key(self) -> tuple:
        return _sum_key(self)


class FixedPairs(tuple):
    """``(name, tensor)`` pairs whose tensors keep their memory and layout while the object lives
    (the receiver's mapped ipc tensors of one handle set, reused across updates): :func:`plan_key`
    and :func:`source_tensors` are computed once per object, not per update (Qwen3-8B's 399
    tensors: ~1 ms of Python per update on an H200's host). Build a new one when a tensor
    changes."""

    @functools.cached_property
    def key(self) -> tuple:
        return _plan_key(self)

    @functools.cached_property
    def sources(self) -> FixedSources:
        return FixedSources(t for _, t in self)
