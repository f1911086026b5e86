"""Server-side data plane: receive one update's tensors and hand them to a sink.

:class:`WeightReceiver` is model-agnostic. ``receive(info, sink)`` pulls every tensor of an
:class:`~rlserve.transfer.wire.protocol.UpdateInfo` off the transport and calls
``sink(list_of_(name, tensor))`` once per bucket (packed) or per tensor (unpacked). The tensors
are views into a receive buffer that is reused afterwards: the sink must copy them (the model's
``load_weights`` copies in place; staging clones).

Transports:

- gloo / nccl: a :class:`~rlserve.transfer.backends.group.TransferGroup`; packed buckets travel as raw
  bytes with ``packed_num_buffers`` broadcasts posted ahead (round-robin), so bucket ``i+1`` is on
  the wire while bucket ``i`` is checked and loaded. CUDA: all work runs on a side stream; the
  backend orders its broadcasts after the stream's earlier copies out of the same buffer.
- ipc: no group; ``update_info.ipc_handles`` (one per bucket) are mapped
  (:func:`rlserve.transfer.wire.ipc.import_handle`) and read in place on the GPU.

Each bucket's ``s64sum`` checksum (:mod:`rlserve.transfer.wire.packing`) is verified before the update
can be committed; a mismatch raises :class:`ChecksumMismatchError`. Bytes in host memory (gloo)
are checked before the sink sees the bucket; bytes on a GPU (NCCL) are summed on the stream and
compared once at the end of the receive (one host sync per update, not per bucket): a corrupt
in-place update then fails like any broken one (the server answers 503 until a full update
lands), a staged one is never committed.

Layout header: every gloo / NCCL update whose trainer is rank 0 starts with the trainer's layout header,
received and compared before any bucket or tensor receive is posted; the checks of what arrives (that header,
the checksums, the finite scan) live in :mod:`rlserve.transfer.server.receiver_checks`.

Draining: when a bucket fails locally (checksum mismatch, the sink raising) the receiver keeps
receiving the remaining buckets without loading them and raises at the end. Both ends then hold
no pending collective, so the group can be torn down at once on both sides (a gloo operation
cannot be cancelled: one left pending keeps its group, thread and port alive until it times
out). Transport errors (peer gone, timeout) raise immediately.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable

import torch

from rlserve.errors import WeightUpdateError
from rlserve.transfer.errors import TransferAbortedError
from rlserve.transfer.backends.group import TransferGroup
from rlserve.transfer.server.phases import Phases
from rlserve.transfer.wire.packing import BucketBuffers, as_bytes, max_bucket_bytes, plan_buckets, unpack
from rlserve.transfer.wire.protocol import InitInfo, UpdateInfo
from rlserve.transfer.server.receiver_ipc import IpcReceive, Sink, _IpcSet
from rlserve.transfer.server.finite_scan import bucket_units, scan
from rlserve.transfer.server.receiver_checks import ReceiveChecks

logger = logging.getLogger(__name__)

def _host_views(plan: list, target: Callable[[int], torch.Tensor], what: str) -> list[torch.Tensor]:
    """``target(i)`` for every bucket ``i`` of ``plan``, each checked to be ``uint8 [nbytes]``
    contiguous host memory. Raises WeightUpdateError (nothing posted yet)."""
    views = [target(i) for i in range(len(plan))]
    for b, v in zip(plan, views):
        if v.dtype != torch.uint8 or v.device.type != "cpu" or v.numel() != b.nbytes or not v.is_contiguous():
            raise WeightUpdateError(f"{what}: bucket {b.index} needs {b.nbytes} contiguous host bytes")
    return views


class WeightReceiver(ReceiveChecks, IpcReceive):
    """One server worker's end of the transfer.

    Args:
        init: the validated ``init_info``.
        rank: this worker's rank in the transfer group.
        device: where received tensors land (the worker's device).

    Attributes:
        group: the :class:`TransferGroup` (``None`` for ipc).
        stats: counters of the last receive (``bytes``, ``seconds``, ``buckets``).
    """

    def __init__(self, init: InitInfo, rank: int, device: torch.device):
        self.init = init
        self.rank = rank
        self.device = torch.device(device)
        self.group: TransferGroup | None = None
        self._bufs = BucketBuffers()
        self._stream = None
        self.stats: dict = {}
        #: test every received float for NaN / inf in the checksum pass (rlserve.transfer.finite);
        #: set per update by the worker (the server's --weight-check-finite)
        self.check_finite = True
        self._closed = False
        # ipc, per-tensor handles: mapped trainer tensors kept across calls (a trainer exports each
        # parameter once); entries unused during a session are dropped at its end
        self._ipc_cache: dict[tuple, torch.Tensor] = {}
        self._ipc_used: set[tuple] = set()
        # ipc_handles_ref -> a whole handle list, mapped; dropped at the end of a session that did
        # not use it
        self._ipc_sets: dict[str, _IpcSet] = {}
        self._ipc_sets_used: set[str] = set()

    # ------------------------------------------------------------------ lifecycle
    def connect(self) -> None:
        """Join the group (blocks until every rank arrived, at most ``timeout_s``). ipc: no-op.

        Raises:
            TransferTimeoutError, WeightTransferFailedError.
        """
        if self.device.type == "cuda":
            from rlserve.transfer.multi_tensor import warmup

            warmup(self.device)  # compiled at the engine's start-up warm-up (jit_warmup.warm_weight_sync): a lookup
        if self.init.backend == "ipc":
            return
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dev = torch.device("cpu") if self.init.backend == "gloo" else self.device
        if self.init.wire == "vllm":  # an unmodified vLLM / TRL trainer (rlserve.transfer.backends.vllm_group)
            from rlserve.transfer.backends.vllm_group import VLLMWireGroup

            self.group = VLLMWireGroup.create("nccl", self.init.master_address, self.init.master_port, self.rank,
                                              self.init.world_size, self.init.timeout_s, dev,
                                              unique_id_b64=self.init.nccl_unique_id_b64,
                                              barrier_after_update=self.init.rank_offset == 0)
            return
        self.group = TransferGroup.create(self.init.backend, self.init.master_address, self.init.master_port,
                                          self.rank, self.init.world_size, self.init.timeout_s, dev,
                                          session=self.init.session)

    def abort(self, reason: str | None = None) -> None:
        """Make a receive in progress (on another thread) fail fast; ``reason`` is named by its
        error (e.g. the trainer is gone)."""
        if self.group is not None:
            self.group.abort(reason)

    def release_buffers(self) -> None:
        """Free the packed receive buffers (e.g. once updates are received directly; the next
        buffered receive allocates them again)."""
        self._bufs.release()

    def close(self) -> None:
        """Tear down the group (never blocks) and free buffers."""
        self._closed = True
        if self.group is not None:
            self.group.destroy()
        self.group = None
        self._bufs.release()
        self._ipc_cache.clear()
        self._ipc_used.clear()
        self._ipc_sets.clear()
        self._ipc_sets_used.clear()

    # ------------------------------------------------------------------ receive
    def wire_device(self) -> torch.device:
        """Where received bytes land: host memory for gloo, else the worker's device."""
        return torch.device("cpu") if self.init.backend == "gloo" else self.device

    def _stream_ctx(self):
        if self.device.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=self.device)
            return torch.cuda.stream(self._stream)
        return contextlib.nullcontext()

    def receive(self, info: UpdateInfo, sink: Sink, on_bucket: Callable[[int], None] | None = None,
                direct: Callable[[int], torch.Tensor] | None = None,
                before_write: Callable[[], None] | None = None,
                targets: Callable[[int], torch.Tensor] | None = None) -> dict:
        """Receive every tensor of ``info`` (resolved: ``packed*`` set) and feed ``sink``.

        Args:
            info: the update's metadata (validated against the model beforehand).
            sink: called with ``[(hf_name, tensor), ...]`` per bucket / tensor, after its checksum
                matched (host bytes with announced ``checksums``), else before the comparison at
                the end of the receive (device bytes, ``checksums_after_data``: a mismatch then
                fails the whole receive); tensors are only valid during the call.
            on_bucket: called with the bucket index after ``sink`` returned (progress).
            direct: packed gloo only (:mod:`rlserve.transfer.server.direct`): ``direct(i)`` is the
                ``uint8 [nbytes]`` memory bucket ``i`` is received into (the model's
                parameters); ``sink`` is then not called, and announced ``checksums`` are refused
                (they must be compared before anything is loaded).
            before_write: with ``direct``: called once, right before the first receive is posted
                into ``direct``'s memory (after the layout header matched); from then on a
                failure may leave any part of that memory overwritten.
            targets: packed gloo only: ``targets(i)``, the ``uint8 [nbytes]`` host memory bucket
                ``i`` is received into instead of the round-robin receive buffers (each bucket
                its own; ``sink`` is called as usual). The worker passes the views of a fresh
                flat buffer laid out like the stream at the update a direct layout is built
                from, which then becomes that layout without a copy
                (:func:`~rlserve.transfer.server.direct.build_direct_layout`'s ``flat``).
        Returns:
            ``{"bytes": int, "seconds": float, "buckets": int, "tensors": int, "direct": bool}``;
            packed gloo / NCCL also ``"phases_s"``: seconds summed over the buckets in
            ``receive_buffers`` (getting the receive buffers: allocated at the first update),
            ``receive_header``, ``receive_wait`` (for the data and the checksums after it),
            ``receive_load`` (``sink``: the load, recorded at the first update, replayed later)
            and ``receive_checksum``.
        Raises:
            LayoutMismatchError: gloo / NCCL: the trainer's layout header (its first message)
                differs from ``info``'s, or there is none; raised before any bucket / tensor
                receive was posted (``sink`` not called, nothing loaded).
            ChecksumMismatchError, TransferTimeoutError, WeightTransferFailedError,
            TransferAbortedError; anything ``sink`` raises (e.g. ``ValueError`` from load_weights).
        """
        if self._closed:
            raise TransferAbortedError("the receiver is closed")
        t0 = time.perf_counter()
        with self._stream_ctx():
            if direct is not None:
                out = self._receive_direct(info, direct, on_bucket, before_write)
            elif self.init.backend == "ipc":
                out = self._receive_ipc(info, sink, on_bucket)
            elif info.packed:
                out = self._receive_packed(info, sink, on_bucket, targets)
            else:
                out = self._receive_unpacked(info, sink, on_bucket)
            if self._stream is not None:
                self._stream.synchronize()  # loads done before anyone reads the params
        out["seconds"] = time.perf_counter() - t0
        self.stats = out
        return out

    def _group(self) -> TransferGroup:
        if self.group is None or not self.group.alive:
            raise TransferAbortedError("the transfer group is not connected (torn down or never initialised)")
        return self.group

    def _plan(self, info: UpdateInfo) -> list:
        """The update's bucket plan: rlserve's aligned one, or vLLM's raw one on its wire."""
        if self.init.wire == "vllm":
            from rlserve.transfer.backends.vllm_group import plan_vllm_buckets

            return plan_vllm_buckets(info.names, info.dtypes(), info.shapes, info.packed_buffer_size_bytes)
        return plan_buckets(info.names, info.dtypes(), info.shapes, info.packed_buffer_size_bytes)

    def _after_update(self, g) -> None:
        """The group's end-of-update step, if it has one (TRL's legacy store barrier)."""
        hook = getattr(g, "after_update", None)
        if hook is not None:
            hook()

    def _receive_packed(self, info: UpdateInfo, sink: Sink, on_bucket, targets=None) -> dict:
        g = self._group()
        src = self.init.src_rank
        plan = self._plan(info)
        nbuf = max(1, min(info.packed_num_buffers, len(plan)))
        t0 = time.perf_counter()
        if targets is not None:
            if self.wire_device().type != "cpu":
                raise WeightUpdateError("receive targets are host memory: packed gloo only")
            views = _host_views(plan, targets, "receive target")
        else:
            bufs = self._bufs.get(nbuf, max_bucket_bytes(plan), self.wire_device()) if plan else []
            views = [bufs[i % nbuf][: b.nbytes] for i, b in enumerate(plan)]
        ph = Phases(receive_buffers=time.perf_counter() - t0)  # new buffers at the first update
        # before any bucket receive is posted (a longer message than the buffer aborts gloo)
        with ph("receive_header"):  # (with targets: into scratch memory of its own, untouched but its head)
            self._receive_header(g, src, info, plan, None if targets is not None or not bufs else bufs[0])
        works: dict[int, object] = {}

        def post(i: int) -> None:
            b = plan[i]
            if b.nbytes:
                works[i] = g.broadcast(views[i], src)

        for i in range(min(nbuf, len(plan))):
            post(i)
        total = 0
        failure: BaseException | None = None
        deferred: list = []
        after = info.checksums_after_data
        for i, b in enumerate(plan):
            what = f"bucket {i + 1}/{len(plan)}"
            if i in works:
                # NCCL: stream-ordered, the host runs ahead (deadline applied at the end);
                # gloo: the host waits. A transport error: the group is broken, raise now.
                with ph("receive_wait"):
                    g.order(works.pop(i), what=what)
            buf = views[i] if b.nbytes else torch.empty(0, dtype=torch.uint8, device=self.wire_device())
            if failure is None:
                try:
                    if not after:
                        with ph("receive_checksum"):
                            self._verify(buf, info.checksums, i, what, deferred, bucket_units(b))
                    pairs = list(unpack(buf, b))
                    if buf.device != self.device:
                        pairs = [(n, t.to(self.device)) for n, t in pairs]
                    with ph("receive_load"):  # load_weights (recorded at the first update) or its replay
                        ret = sink(pairs)
                    if after:  # compared at the end, with the sums the trainer sends after the data
                        with ph("receive_checksum"):
                            got, bad = self._bucket_sum(buf, b, pairs, ret)
                        deferred.append((got, i, what, buf.numel(), bad))
                    if on_bucket is not None:
                        on_bucket(i)
                except Exception as e:  # noqa: BLE001 - drained below, raised at the end
                    failure = e
                    logger.error("%s: %s; draining the remaining buckets without loading them", what, e)
            total += b.nbytes
            if i + nbuf < len(plan):
                post(i + nbuf)  # after the sink copied out of this buffer (stream-ordered on CUDA)
        with ph("receive_wait"):
            expected = self._receive_checksums(g, src, len(plan)) if after else info.checksums
            self._finish_stream(g, "receiving the update")
            self._after_update(g)
        if failure is not None:
            raise failure
        self._check_deferred(deferred, expected, after)
        return {"bytes": total, "buckets": len(plan), "tensors": len(info.names), "phases_s": dict(ph)}

    def _receive_direct(self, info: UpdateInfo, target: Callable[[int], torch.Tensor], on_bucket,
                        before_write: Callable[[], None] | None = None) -> dict:
        """Packed gloo into ``target(i)`` per bucket: every broadcast is posted at once (each
        bucket has its own memory, nothing waits for a buffer to be copied out), and each bucket
        is summed once it is in (``checksums_after_data``), while the next ones arrive."""
        if self.init.backend != "gloo" or not info.packed or (info.checksums is not None and not info.checksums_after_data):
            raise WeightUpdateError("direct receive needs a packed gloo update without announced checksums")
        g = self._group()
        src = self.init.src_rank
        plan = plan_buckets(info.names, info.dtypes(), info.shapes, info.packed_buffer_size_bytes)
        views = _host_views(plan, target, "direct receive")
        ph = Phases()
        # into scratch memory, never the parameters; nothing is posted into them before it matched
        with ph("receive_header"):
            self._receive_header(g, src, info, plan)
        if before_write is not None:
            before_write()
        works = {i: g.broadcast(v, src) for i, v in enumerate(views) if v.numel()}
        after = info.checksums_after_data
        deferred: list = []
        for i, v in enumerate(views):
            what = f"bucket {i + 1}/{len(plan)}"
            if i in works:
                with ph("receive_wait"):
                    g.order(works.pop(i), what=what)
            if after or self.check_finite:
                with ph("receive_checksum"):
                    got, bad = scan(v, bucket_units(plan[i]), after, self.check_finite)
                deferred.append((got, i, what, v.numel(), bad))
            if on_bucket is not None:
                on_bucket(i)
        with ph("receive_wait"):
            expected = self._receive_checksums(g, src, len(plan)) if after else None
        self._check_deferred(deferred, expected, after)
        return {"bytes": sum(b.nbytes for b in plan), "buckets": len(plan), "tensors": len(info.names), "direct": True,
                "phases_s": dict(ph)}

    def _finish_stream(self, g: TransferGroup, what: str) -> None:
        """CUDA: wait (with the group's deadline) for everything queued on the receive stream."""
        if self._stream is not None and self.device.type == "cuda":
            g.wait_stream(self._stream, what=what)

    def _receive_unpacked(self, info: UpdateInfo, sink: Sink, on_bucket) -> dict:
        g = self._group()
        src = self.init.src_rank
        dev = self.wire_device()
        dtypes = info.dtypes()
        n = len(info.names)
        ahead = max(1, info.packed_num_buffers)
        pending: dict[int, tuple[torch.Tensor, object]] = {}
        self._receive_header(g, src, info)

        def post(i: int) -> None:
            t = torch.empty(info.shapes[i], dtype=dtypes[i], device=dev)
            # vLLM's wire sends each tensor in its own dtype; rlserve's as bytes
            w = g.broadcast(t if self.init.wire == "vllm" else as_bytes(t), src) if t.numel() else None
            pending[i] = (t, w)

        for i in range(min(ahead, n)):
            post(i)
        total = 0
        failure: BaseException | None = None
        deferred: list = []
        for i in range(n):
            t, w = pending.pop(i)
            what = f"tensor {info.names[i]!r} ({i + 1}/{n})"
            if w is not None:
                g.order(w, what=what)
            if failure is None:
                try:
                    self._verify(as_bytes(t), info.checksums, i, what, deferred,
                                 [(info.names[i], 0, t.numel() * t.element_size(), t.dtype)])
                    sink([(info.names[i], t if t.device == self.device else t.to(self.device))])
                    if on_bucket is not None:
                        on_bucket(i)
                except Exception as e:  # noqa: BLE001
                    failure = e
                    logger.error("%s: %s; draining the remaining tensors without loading them", what, e)
            total += t.numel() * t.element_size()
            if i + ahead < n:
                post(i + ahead)
        self._finish_stream(g, "receiving the update")
        self._after_update(g)
        if failure is not None:
            raise failure
        self._check_deferred(deferred, info.checksums)
        return {"bytes": total, "buckets": n, "tensors": n}
