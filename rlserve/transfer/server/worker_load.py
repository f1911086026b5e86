"""How a worker puts received tensors into its model: ``load_weights`` (replayed from a recorded
copy plan when the sources sit at fixed addresses), the direct-receive layout of a CPU model,
staging copies, and the post-load hook (fp8 scales). Called by
:mod:`rlserve.transfer.server.worker_ext`'s receive thread and ``commit``."""

from __future__ import annotations

import logging
import math

import torch

from rlserve.transfer.server.bucket_plan import BucketPairs, BucketPlan
from rlserve.transfer.server.copy_plan import CopyPlan, FixedPairs, plan_key, record_load, source_tensors
from rlserve.transfer.server.direct import DirectLayout, build_direct_layout, update_key
from rlserve.transfer.errors import ChecksumMismatchError, DeviceOutOfMemoryError, NonFiniteWeightsError
from rlserve.transfer.finite import Scan
from rlserve.transfer.host_ops import host_copy_many, host_copy_scan, host_copyable
from rlserve.transfer.wire.protocol import UpdateInfo
from rlserve.transfer.server.receiver import WeightReceiver
from rlserve.transfer.wire.header import LayoutMismatchError
from rlserve.transfer.server.worker_state import StageCall, WorkerTransferState, _Op

logger = logging.getLogger(__name__)


def _load(worker, pairs) -> set:
    if hasattr(worker, "load_weights"):
        return worker.load_weights(pairs)
    return worker.model.load_weights(pairs)


def _param_list(worker) -> list:
    """The model's parameters, listed once per model and kept on it: the ``Parameter`` objects
    are never replaced (docs/INTERFACES.md; only their ``.data`` moves, once, for a direct
    receive)."""
    model = worker.model
    params = getattr(model, "_rlserve_param_list", None)
    if params is None:
        params = model._rlserve_param_list = list(model.parameters())
    return params


def _params_signature(worker) -> tuple:
    """The parameters' addresses (a recorded copy plan writes there): only ``data_ptr()`` is read
    per update, without walking the module tree (:func:`_param_list`; CPU, SmolLM2-135M's 272
    parameters: 0.39 -> 0.31 ms per call)."""
    return tuple(p.data_ptr() for p in _param_list(worker))


def _load_replayable(worker, st: WorkerTransferState, pairs, params_sig: tuple, want_sums: bool = False,
                     check_finite: bool = False) -> tuple[bool, Scan | None, CopyPlan | None]:
    """``_load(worker, pairs)`` for sources that sit at the same addresses on every update: the
    first load is recorded, later ones replay its copies (see :mod:`rlserve.transfer.server.copy_plan`).
    ``params_sig``: :func:`_params_signature` (taken once per update, not per bucket).
    ``want_sums``: a replay copies and checksums the sources in one pass where it can (and
    with ``check_finite`` tests them for NaN / inf in it). Returns ``(replayed, its Scan or
    None, the plan or None)``."""
    if isinstance(pairs, BucketPairs) and not want_sums:
        return _load_bucket(worker, st, pairs, params_sig)
    key = (plan_key(pairs), params_sig)
    st.plans_used.add(key)
    if key in st.plans:
        plan = st.plans[key]
        if plan is not None:
            return True, plan.replay(source_tensors(pairs) if want_sums else None, check_finite), plan
        _load(worker, pairs)
        return False, None, None
    plan, why = record_load(lambda p: _load(worker, p), pairs)
    if plan is None:
        logger.info("weight load not replayable (%s): load_weights runs on every update", why)
    st.plans[key] = plan
    return False, None, plan


def _load_bucket(worker, st: WorkerTransferState, pairs: BucketPairs, params_sig: tuple
                 ) -> tuple[bool, None, CopyPlan | None]:
    """:func:`_load_replayable` for a packed bucket at an address of its own (CUDA IPC packed):
    the plan is keyed on the bucket's layout and replayed at the bucket's address
    (:mod:`rlserve.transfer.server.bucket_plan`); the first bucket of a layout is recorded."""
    plan = st.bucket_plan(pairs.layout_key, params_sig)
    if plan is not None:
        plan.replay(pairs.buf)
        if not plan.verified:  # a plan's first replay is checked (bucket_plan's module docstring)
            why = plan.mismatch(pairs.buf)
            if why is not None:
                logger.error("a packed bucket's replayed load differs from its bytes (%s): this layout is loaded "
                             "with load_weights from now on", why)
                st.set_bucket_plan(pairs.layout_key, params_sig, None)
                _load(worker, list(pairs))
                return False, None, None
            plan.verified = True
        return True, None, None
    if st.bucket_plan_known(pairs.layout_key, params_sig):  # recorded before: not replayable
        _load(worker, list(pairs))
        return False, None, None
    recorded, why = record_load(lambda p: _load(worker, p), list(pairs))
    bplan = BucketPlan.from_plan(recorded, pairs.buf) if recorded is not None else None
    if bplan is None:
        logger.info("packed bucket load not replayable at another address (%s): load_weights runs on every "
                    "update", why or "a source outside the bucket")
    st.set_bucket_plan(pairs.layout_key, params_sig, bplan)
    return False, None, recorded


def _direct_key(worker, info: UpdateInfo, staging: str, allowed: bool) -> tuple | None:
    """The :func:`~rlserve.transfer.server.direct.update_key` of ``info`` when it may be received
    directly into the parameters (:mod:`rlserve.transfer.server.direct`): in place, packed gloo into a
    CPU model, checksums after the data or none; else ``None``."""
    if not allowed or staging != "none" or not info.packed or worker.device.type != "cpu" or \
            (info.checksums is not None and not info.checksums_after_data):
        return None
    return update_key(info.names, info.dtype_names, info.shapes, info.packed_buffer_size_bytes)


def direct_receive_buffer(worker, st: WorkerTransferState, info: UpdateInfo, key: tuple | None,
                          params_sig: tuple) -> torch.Tensor | None:
    """The update :func:`_build_direct` will try to lay the parameters out for (``key`` set, no
    layout yet, not tried for these parameters): a fresh ``uint8 [stream bytes]`` host buffer to
    receive it into, bucket after bucket (the receiver's ``targets``), which then becomes the
    layout with no copy. ``None`` otherwise (the round-robin receive buffers)."""
    if key is None or st.direct is not None or st.direct_tried == (key, params_sig) or \
            (st.init is not None and st.init.wire == "vllm"):  # (vLLM's wire: its own bucket plan)
        return None
    from rlserve.transfer.wire.packing import plan_buckets

    buckets = plan_buckets(info.names, info.dtypes(), info.shapes, info.packed_buffer_size_bytes)
    if not buckets:
        return None
    if st.receiver is not None:
        st.receiver.release_buffers()  # not used by this update; a failed layout allocates them again
    return torch.empty(sum(b.nbytes for b in buckets), dtype=torch.uint8)


def bucket_views(flat: torch.Tensor, info: UpdateInfo):
    """``targets(i)`` for the receiver: bucket ``i``'s bytes of ``flat`` (buckets back to back)."""
    from rlserve.transfer.wire.packing import plan_buckets

    sizes = [b.nbytes for b in plan_buckets(info.names, info.dtypes(), info.shapes, info.packed_buffer_size_bytes)]
    bases = [sum(sizes[:i]) for i in range(len(sizes))]
    return lambda i: flat[bases[i]: bases[i] + sizes[i]]


def _build_direct(worker, st: WorkerTransferState, info: UpdateInfo, key: tuple, loads: list,
                  flat: torch.Tensor | None = None) -> None:
    """After an in-place update that recorded a copy plan for every bucket: move the parameters
    into the bucket layout (:func:`~rlserve.transfer.server.direct.build_direct_layout`) so that the
    next identical update is received into them; ``flat``: the buffer this update was received
    into (:func:`direct_receive_buffer`), adopted as the layout without a copy. The old plans
    wrote to the old storages: they are dropped (the memory goes with them).

    A layout that still holds the parameters is not given up for an update of fewer bytes (a
    partial update between full ones): that update keeps the buffered path, and the full
    updates stay direct instead of moving the parameters at every switch."""
    from rlserve.transfer.wire.packing import plan_buckets

    sig = _params_signature(worker)
    tried = (key, sig)
    if st.direct_tried == tried:
        return  # refused for this update and these parameters already
    st.direct_tried = tried
    buckets = plan_buckets(info.names, info.dtypes(), info.shapes, info.packed_buffer_size_bytes)
    cur = st.direct
    if cur is not None and cur.params_sig == sig and sum(b.nbytes for b in buckets) < cur.flat.numel():
        logger.info("an update of %d buckets keeps the receive buffers: the parameters stay laid out for "
                    "the larger update they were laid out for", len(buckets))
        return
    layout, why = build_direct_layout(_param_list(worker), buckets, loads, key, flat=flat)
    if layout is None:
        logger.info("packed updates keep the receive buffers and the load copy: %s", why)
        st.direct = None
        return
    st.plans, st.plans_used = {}, set()
    if st.receiver is not None:
        st.receiver.release_buffers()
    layout.params_sig = _params_signature(worker)
    st.direct = layout
    logger.info("parameters laid out like the update's %d buckets (%d bytes): the next packed updates are "
                "received straight into them", len(buckets), layout.flat.numel())


def _abandon_direct(worker, st: WorkerTransferState, layout: DirectLayout) -> None:
    """A direct receive failed. Its broadcasts were posted into the parameters' memory, and gloo
    cannot cancel a posted operation: one still pending could land later (a trainer that was
    alive and sending when the server gave up), even after the next update. So the parameters
    move out of the layout's buffer into fresh memory (a copy of what they hold now; the model
    is unavailable until a full update anyway) and the layout is forgotten. Late bytes then land
    in the abandoned buffer, which the pending operations keep alive until they end; the next
    successful update lays the parameters out again."""
    layout.move_out(_param_list(worker))
    st.direct = None
    st.direct_tried = None
    logger.warning("direct receive failed: the parameters were moved out of the receive layout (late bytes "
                   "from the abandoned transfer cannot reach them)")


def _receive_direct(worker, st: WorkerTransferState, receiver: WeightReceiver, info: UpdateInfo,
                    layout: DirectLayout, op: _Op) -> dict:
    """``receiver.receive`` straight into ``layout`` (every bucket counts as applied in place). A
    failure other than a checksum mismatch (compared once every broadcast has completed, so
    nothing is left pending) or a layout header mismatch (refused before any receive was posted)
    abandons the layout (:func:`_abandon_direct`) and re-raises."""
    def applied(_i):
        op.applied += 1

    def before_write() -> None:
        op.touched = True  # a bucket partly received is a changed model

    try:
        return receiver.receive(info, lambda _pairs: None, on_bucket=applied, direct=layout.target,
                                before_write=before_write)
    except (ChecksumMismatchError, NonFiniteWeightsError, LayoutMismatchError):
        raise  # every broadcast completed / none was posted into the parameters
    except BaseException:
        _abandon_direct(worker, st, layout)
        raise


def device_room_bytes(dev: torch.device) -> int | None:
    """Bytes a new allocation on ``dev`` can take: the driver's free memory plus what torch's caching
    allocator holds unallocated there, less the engine's activation headroom
    (``rlserve.engine.worker.worker._GPU_HEADROOM_BYTES``: generation goes on beside a staged
    receive). ``None`` off CUDA (no check)."""
    if dev.type != "cuda":
        return None
    from rlserve.engine.worker.worker import _GPU_HEADROOM_BYTES

    free, _total = torch.cuda.mem_get_info(dev)
    return free + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev) - _GPU_HEADROOM_BYTES


def _staging_dtype(wire: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """A staged tensor's dtype: ``dtype`` (:func:`_stage_dtype`) for float tensors when given, else the wire's."""
    return dtype if (dtype is not None and wire.is_floating_point) else wire


def _reusable_staging(st: WorkerTransferState, name: str, shape, dt: torch.dtype,
                      dev: torch.device) -> torch.Tensor | None:
    """``name``'s staging buffer of an earlier update when it has this shape, dtype and device (reused), else None."""
    buf = st.staging_bufs.get(name)
    if buf is None or list(buf.shape) != list(shape) or buf.dtype != dt or buf.device != dev:
        return None
    return buf


def check_staging_room(st: WorkerTransferState, info: UpdateInfo, dtype: torch.dtype | None,
                       dev: torch.device) -> None:
    """Refuse an update call whose staging tensors would not fit on ``dev``, before a byte moves.

    Needed: ``numel x itemsize`` (in :func:`_stage`'s dtype: ``dtype`` for float tensors when given,
    else the wire's) of each tensor of ``info`` that holds no staging buffer of that shape, dtype
    and device yet (buffers are reused across syncs); room: :func:`device_room_bytes`.

    Raises:
        DeviceOutOfMemoryError: needed > room (HTTP 507 ``weight_update_out_of_memory``; nothing
            was staged, the served weights are unchanged).
    """
    room = device_room_bytes(dev)
    if room is None or not info.names:
        return
    need = 0
    for name, wire, shape in zip(info.names, info.dtypes(), info.shapes):
        dt = _staging_dtype(wire, dtype)
        if _reusable_staging(st, name, shape, dt, dev) is None:
            need += math.prod(int(x) for x in shape) * dt.itemsize
    if need > room:
        raise DeviceOutOfMemoryError(
            f"staging this update on {dev} needs {need / 2**30:.2f} GiB, {max(room, 0) / 2**30:.2f} GiB is free "
            "beside the served weights, the KV cache and the activation headroom; nothing was received and the "
            "served weights are unchanged (use --weight-staging host or none, or a lower --gpu-memory-utilization)")


def _stage(st: WorkerTransferState, pairs, dtype: torch.dtype | None, dev: torch.device, pin: bool,
           want_sums: bool, check_finite: bool = False) -> Scan | None:
    """Copy ``pairs`` into the (reused) staging tensors. With ``want_sums`` and sources of the
    staging dtypes, one fused copy + checksum pass (with ``check_finite`` also the NaN / inf
    test): a Triton launch on CUDA, numpy pieces on the host; its
    :class:`~rlserve.transfer.finite.Scan` is returned. Else one ``copy_`` per tensor (``None``)."""
    c = st.stage_fixed
    if isinstance(pairs, FixedPairs) and c is not None and c.matches(pairs, dtype, dev, pin, st.staging_bufs):
        # the same mapped tensors into the same staging buffers as last time: no per-tensor Python
        dsts, key = c.dsts, c.fused_key
        st.staging.update(zip(c.names, dsts))
    else:
        dsts = []
        for name, t in pairs:
            dt = _staging_dtype(t.dtype, dtype)
            dst = _reusable_staging(st, name, t.shape, dt, dev)
            if dst is None:
                dst = st.staging_bufs[name] = torch.empty(t.shape, dtype=dt, device=dev, pin_memory=pin)
            st.staging[name] = dst
            dsts.append(dst)
        key = None
        if all(d.dtype == t.dtype and d.is_cuda for d, (_, t) in zip(dsts, pairs)):
            key = tuple((t.data_ptr(), d.data_ptr(), t.numel(), t.dtype) for d, (_, t) in zip(dsts, pairs))
        st.stage_fixed = StageCall(pairs, dtype, dev, pin, [n for n, _ in pairs], dsts, key) \
            if isinstance(pairs, FixedPairs) else None
    if want_sums and key is not None:
        from rlserve.transfer.multi_tensor import MultiTensorSum

        if st.stage_op is None or st.stage_op[0] != (key, check_finite):
            st.stage_op = ((key, check_finite),
                           MultiTensorSum.build([t for _, t in pairs], dsts, check_finite=check_finite))
        op = st.stage_op[1]
        if op is not None:
            return Scan(op.run(), op.bad)
    host = []
    for d, (_, t) in zip(dsts, pairs):
        if host_copyable(d, t):
            host.append((d, t))  # numpy on our threads (rlserve.transfer.host_ops)
        else:
            d.copy_(t, non_blocking=pin)
    if host and want_sums and len(host) == len(pairs):  # every byte copied (and summed) on the host
        got, bad = host_copy_scan(host, s64sums=True, finite=check_finite)
        return Scan(torch.tensor(got, dtype=torch.int64), None if bad is None else torch.tensor(bad))
    if host:
        host_copy_many(host)
    return None


def _post_load(worker) -> None:
    try:
        from rlserve.loader import process_weights_after_loading
    except ImportError:  # pragma: no cover
        return
    ctx = worker.tp() if hasattr(worker, "tp") else None
    if ctx is None:
        process_weights_after_loading(worker.model)
    else:
        with ctx:
            process_weights_after_loading(worker.model)


def _stage_dtype(worker) -> torch.dtype | None:
    """The model's dtype when every float parameter has it (casting then is what
    ``load_weights`` would do anyway), else ``None`` (keep the received dtype: exact)."""
    dt = getattr(worker, "dtype", None)
    if dt is None:
        return None
    for p in worker.model.parameters():
        if p.is_floating_point() and p.dtype != dt:
            return None
    return dt

