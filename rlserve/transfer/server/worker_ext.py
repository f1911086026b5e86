"""Worker-side weight-sync functions, run through ``engine.collective_rpc``.

Each is a plain ``fn(worker, *args)`` (see docs/INTERFACES.md, "Workers"): the manager calls
``engine.collective_rpc("rlserve.transfer.server.worker_ext:<fn>", *args)`` from the engine thread,
between steps, on every TP worker of a replica at once. Arguments and results are JSON-like.

Blocking work (rendezvous, receiving) runs on one background thread per worker so that the
engine keeps stepping (staged mode) and the manager can poll: ``start_*`` functions return at
once, :func:`poll` reports progress. Loading into the model happens

- in place (``staging="none"``): on the receive thread, bucket by bucket, through
  ``worker.load_weights`` (the engine is paused by the manager);
- staged (``"device"`` / ``"host"``): the receive thread only copies received tensors into a
  staging dict (HF name → tensor on the worker's device / in pinned host memory, in the model's
  dtype when every float parameter has that dtype, else as received); :func:`commit`, called on
  the engine thread while it is paused, loads the staging dict with one ``load_weights`` call.
  The staging tensors are kept for the next update (same names, shapes, dtypes: reused), so a
  device-staged server holds a second copy of the weights from its first staged update on.

Loads whose sources sit at the same addresses every time -- mapped CUDA IPC tensors, the packed
receive buffers on the worker's device, the reused staging tensors -- are recorded once
(:mod:`rlserve.transfer.server.copy_plan`) and replayed as batched ``_foreach_copy_`` calls afterwards,
skipping the per-tensor Python of ``load_weights``. Plans not used by an update are dropped at
its end; a changed parameter set (addresses) invalidates them.

In place on a CPU model, packed gloo updates whose loads are plain byte copies are received
straight into the parameters from the second identical update on: the first one moves the
parameters into one buffer laid out like the buckets (:mod:`rlserve.transfer.server.direct`).

After a load, ``rlserve.loader.process_weights_after_loading`` runs (fp8 scales and friends).
State lives in ``worker.extension_state["rlserve.transfer"]``.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import operator
import threading
import time
import traceback

import torch

from rlserve.transfer.errors import TransferAbortedError
from rlserve.transfer.wire.protocol import InitInfo, UpdateInfo
from rlserve.transfer.server.receiver import WeightReceiver
from rlserve.transfer.server.copy_plan import FixedPairs
from rlserve.transfer.server.worker_state import CommitPairs, WorkerTransferState, _Op
from rlserve.transfer.server.worker_load import (
    _build_direct,
    _direct_key,
    _load,
    _load_replayable,
    _params_signature,
    _post_load,
    _receive_direct,
    _stage,
    _stage_dtype,
    bucket_views,
    check_staging_room,
    direct_receive_buffer,
)

logger = logging.getLogger(__name__)

STATE_KEY = "rlserve.transfer"


def _state(worker) -> WorkerTransferState:
    st = worker.extension_state.get(STATE_KEY)
    if st is None:
        st = worker.extension_state[STATE_KEY] = WorkerTransferState()
    return st


def _rank(worker, init: InitInfo) -> int:
    return init.worker_rank(int(getattr(worker, "dp_index", 0)), int(getattr(worker, "tp_rank", 0)),
                            int(getattr(worker, "tp_size", 1)))


def _own_future_op(st: WorkerTransferState, op_id: str, kind: str) -> _Op:
    """A registered op whose future (running) the caller completes itself."""
    op = st.ops[op_id] = _Op(kind)
    op.future = cf.Future()
    op.future.set_running_or_notify_cancel()
    return op


def _submit(st: WorkerTransferState, op_id: str, kind: str, fn, inline: bool = False) -> str:
    """Run ``fn(op)`` on the worker's transfer thread, or -- ``inline`` -- right here on the
    calling (engine) thread, its result or error stored in the op's future all the same."""
    if not inline:
        op = st.ops[op_id] = _Op(kind)
        op.future = st.pool.submit(fn, op)
        return op_id
    op = _own_future_op(st, op_id, kind)
    try:
        op.future.set_result(fn(op))
    except BaseException as e:  # noqa: BLE001 - reported by poll like a pool op's
        op.future.set_exception(e)
    return op_id


# ---------------------------------------------------------------- rpc functions
def init_transfer(worker, op_id: str, init_info: dict) -> str:
    """Replace any current receiver and start joining the group on a daemon thread of its own
    (a rendezvous blocked in the store or the backend's constructor cannot be interrupted, so it
    must not hold the transfer thread). Poll ``op_id``; :func:`abort_init` cancels it."""
    st = _state(worker)
    st.close()
    init = InitInfo.from_dict(init_info)
    rank = _rank(worker, init)
    receiver = WeightReceiver(init, rank, worker.device)
    st.receiver, st.init = receiver, init
    fut = _own_future_op(st, op_id, "init").future

    def run() -> None:
        try:
            receiver.connect()
        except BaseException as e:  # noqa: BLE001 - reported by poll
            with contextlib.suppress(cf.InvalidStateError):
                fut.set_exception(e)
            return
        try:
            fut.set_result({"rank": rank})
        except cf.InvalidStateError:  # cancelled meanwhile (abort_init): the group goes
            receiver.close()

    threading.Thread(target=run, name="rlserve-transfer-rendezvous", daemon=True).start()
    return op_id


def abort_init(worker) -> None:
    """Cancel a pending :func:`init_transfer`: its op fails at once (``TransferAbortedError``)
    and its receiver is closed; a rendezvous that completes later tears its group down."""
    st = _state(worker)
    for op in list(st.ops.values()):
        if op.kind == "init" and op.future is not None:
            with contextlib.suppress(cf.InvalidStateError):
                op.future.set_exception(TransferAbortedError("the pending rendezvous was cancelled"))
    if st.receiver is not None and st.receiver.group is None:
        st.close()


def start_receive(worker, op_id: str, update_info: dict, staging: str, direct: bool = True,
                  check_finite: bool = True, inline: bool = False) -> str:
    """Start receiving one update (background). ``update_info`` is resolved (``packed*`` set)
    and validated by the manager. ``staging``: "none" (load in place), "device" or "host", or
    "lora" (an adapter-only update's factors: staged on the device as received, committed by
    :func:`rlserve.lora.sync.commit_worker`).
    ``inline``: receive on the calling (engine) thread instead (see :func:`start_wait`).
    ``direct``: allow receiving straight into the parameters (:mod:`rlserve.transfer.server.direct`).
    ``check_finite``: refuse tensors holding NaN / inf (:mod:`rlserve.transfer.finite`), tested
    in the checksum pass (the server's ``--weight-check-finite``)."""
    st = _state(worker)
    if st.receiver is None:
        raise TransferAbortedError("no transfer engine on this worker: call init_weight_transfer_engine first")
    receiver = st.receiver
    info = receiver.with_ref_metadata(UpdateInfo.from_dict(update_info))
    receiver.check_finite = bool(check_finite)

    def run(op: _Op):
        t_op = time.perf_counter()
        if worker.device.type == "cuda":
            torch.cuda.set_device(worker.device)
        t_dev = time.perf_counter()
        # sources at fixed addresses: mapped ipc tensors, packed buffers on the worker's device
        stable = receiver.init.backend == "ipc" or (info.packed and receiver.wire_device() == worker.device)
        params_sig = _params_signature(worker) if stable and staging == "none" else ()
        t_sig = time.perf_counter()
        # ipc per-tensor (the receiver compares checksums / tests NaN after the copy) and packed
        # buckets whose checksums come after the data: a fused copy + checksum (+ the NaN / inf
        # test) reads each byte once
        want_sums = (receiver.init.backend == "ipc" and not info.packed and
                     (info.checksums is not None or info.device_checksums or check_finite)) or \
            (bool(info.packed) and info.checksums_after_data)
        dkey = _direct_key(worker, info, staging, direct and stable)
        layout = st.direct if dkey is not None else None
        if layout is not None and (layout.key != dkey or layout.params_sig != params_sig):
            layout = None
        loads: list = []  # (pairs, the plan's copies) per bucket: the makings of a direct layout
        if staging == "none":
            def sink(pairs):
                sums = None
                op.touched = True  # before the load's first byte: a load that raises may have written some
                if stable:
                    replayed, sums, plan = _load_replayable(worker, st, pairs, params_sig, want_sums, check_finite)
                    op.replayed += replayed
                    if dkey is not None:
                        loads.append((pairs, plan.copies() if plan is not None else None))
                else:
                    _load(worker, pairs)
                op.applied += 1
                return sums
        else:  # "lora": an adapter's factors (rlserve.lora.sync), on the device in the wire dtype
            dtype = _stage_dtype(worker) if staging != "lora" else None
            pin = staging == "host" and torch.cuda.is_available()
            dev = worker.device if staging in ("device", "lora") else torch.device("cpu")
            check_staging_room(st, info, dtype, dev)  # 507 before a byte moves when the copy cannot fit

            def sink(pairs):
                sums = _stage(st, pairs, dtype, dev, pin, want_sums, check_finite)
                op.staged += 1
                return sums
        # the update a direct layout is built from: received into the layout's future buffer
        flat = direct_receive_buffer(worker, st, info, dkey, params_sig) if layout is None else None
        t_rx = time.perf_counter()
        if layout is not None:
            stats = _receive_direct(worker, st, receiver, info, layout, op)
        else:
            try:
                stats = receiver.receive(info, sink, targets=None if flat is None else bucket_views(flat, info))
            finally:
                if staging == "none":
                    st.drop_unused_plans()
        t_post = time.perf_counter()
        if dkey is not None and layout is None and loads:
            _build_direct(worker, st, info, dkey, loads, flat)
        flat = None  # (a layout that was not built frees it)
        t_built = time.perf_counter()
        if staging == "none" and info.names:
            _post_load(worker)
        stats["replayed_loads"] = op.replayed
        t_end = time.perf_counter()
        stats["op_seconds"] = t_end - t_op
        stats.setdefault("phases_s", {}).update(op_prepare=t_rx - t_op, op_set_device=t_dev - t_op,
                                               op_params_signature=t_sig - t_dev, op_direct_layout=t_built - t_post,
                                               op_post_load=t_end - t_built)
        return stats

    return _submit(st, op_id, "receive", run, inline=inline)


def start_wait(worker, start_fn: str, op_id: str, wait_s: float, *args) -> dict:
    """``start_fn(worker, op_id, *args)`` (``"init_transfer"`` / ``"start_receive"``), then
    :func:`poll` with ``wait_s``: one engine-thread call starts a short op and sees it end
    (the manager uses it while the engine is paused)."""
    if start_fn not in ("init_transfer", "start_receive"):
        raise ValueError(f"start_wait: unknown op {start_fn!r}")
    st = _state(worker)
    if start_fn == "start_receive" and st.receiver is not None and st.receiver.init.backend == "ipc":
        # an ipc receive waits for no peer (only this GPU's copy): run it on this thread, no
        # hand-off to the transfer thread and back
        start_receive(worker, op_id, *args, inline=True)
    else:
        globals()[start_fn](worker, op_id, *args)
    return poll(worker, op_id, wait_s)


def forget(worker, op_id: str) -> None:
    """Drop op ``op_id`` (finished or not) from this worker's table; unknown ids are ignored."""
    _state(worker).ops.pop(op_id, None)


def poll(worker, op_id: str, wait_s: float = 0.0) -> dict:
    """``{"done": bool, "ok": bool, "result": ..., "error": str, "error_type": str, "applied": int,
    "touched": bool, "staged": int, "seconds": float}`` of op ``op_id``. ``touched``: the op has
    begun writing into the live parameters (in place), whether or not any bucket completed; a
    done op that failed with ``touched`` false left the model as it was. A finished op keeps
    answering the same result (with data parallelism the manager polls every replica until all
    are done) until :func:`forget` drops it."""
    st = _state(worker)
    op = st.ops.get(op_id)
    if op is None:
        return {"done": True, "ok": False, "error": f"unknown transfer op {op_id} on this worker "
                "(it was torn down)", "error_type": "TransferAbortedError", "applied": 0, "staged": 0}
    fut = op.future
    try:
        fut.result(timeout=wait_s) if wait_s else None
    except BaseException:  # noqa: BLE001 - reported below
        pass
    out = {"done": fut.done(), "applied": op.applied, "touched": op.touched, "staged": op.staged,
           "seconds": time.monotonic() - op.started}
    if fut.done():
        exc = fut.exception() if not fut.cancelled() else TransferAbortedError("cancelled")
        if exc is None:
            out.update(ok=True, result=fut.result())
        else:
            out.update(ok=False, error=str(exc), error_type=type(exc).__name__)
            if not isinstance(exc, (TransferAbortedError,)):
                logger.debug("transfer op %s failed: %s", op_id,
                             "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    return out


def abort(worker, reason: str | None = None) -> None:
    """Make a receive in progress fail fast (the manager then shuts the engine down); its error
    names ``reason`` when given (e.g. the trainer is gone)."""
    st = _state(worker)
    if st.receiver is not None:
        st.receiver.abort(reason)


def commit(worker) -> dict:
    """Load the staging dict into the model in place (engine thread, engine paused); clear it.
    Returns ``{"names", "seconds", "replayed", "phases_s": {"load", "post_load", "device_sync"}}``
    (``{"names": 0}`` when nothing is staged). Raises what ``load_weights`` raises (staging is
    kept then)."""
    st = _state(worker)
    staged = st.staging
    if not staged:
        return {"names": 0}
    t0 = time.perf_counter()
    pairs = _commit_pairs(st, staged)
    replayed = False
    if all(map(operator.is_, map(st.staging_bufs.get, staged), staged.values())):
        replayed, _, _ = _load_replayable(worker, st, pairs, _params_signature(worker))  # reused staging: a plan
        st.drop_unused_plans()
    else:
        _load(worker, pairs)
    t_load = time.perf_counter()
    _post_load(worker)
    t_post = time.perf_counter()
    n = len(staged)
    st.staging = {}
    if worker.device.type == "cuda":
        torch.cuda.synchronize(worker.device)
    t_end = time.perf_counter()
    return {"names": n, "seconds": t_end - t0, "replayed": replayed,
            "phases_s": {"load": t_load - t0, "post_load": t_post - t_load, "device_sync": t_end - t_post}}


def _commit_pairs(st: WorkerTransferState, staged: dict) -> list:
    """``staged``'s ``(name, tensor)`` pairs; the :class:`FixedPairs` of the previous commit when
    they are the same names and tensor objects (the reused staging buffers): its plan key is not
    computed again (18,867 per-expert names: ~0.3 s of Python on a loaded 2-core host)."""
    c = st.commit_pairs
    if c is not None and c.matches(staged):
        return c.pairs
    pairs = FixedPairs(staged.items())
    st.commit_pairs = CommitPairs(list(staged), list(map(id, staged.values())), pairs)
    return pairs


def end_session(worker) -> None:
    """End of an update session: the receiver drops IPC mappings the session did not use."""
    st = _state(worker)
    if st.receiver is not None:
        st.receiver.end_session()


def discard(worker) -> None:
    """Drop staged tensors (a failed or abandoned staged update), buffers included."""
    st = _state(worker)
    st.staging = {}
    st.staging_bufs = {}
    st.stage_op = st.stage_fixed = st.commit_pairs = None


def shutdown_transfer(worker) -> None:
    """Leave the group (never blocks), drop staging, forget ops."""
    st = _state(worker)
    st.close()
    st.ops.clear()


def status(worker) -> dict:
    st = _state(worker)
    return {
        "initialized": st.receiver is not None,
        "connected": st.receiver is not None and (st.receiver.group is not None or
                                                  (st.init is not None and st.init.backend == "ipc")),
        "rank": None if st.init is None else _rank(worker, st.init),
        "staged_tensors": len(st.staging),
        "ops": list(st.ops),
        "dtype": str(getattr(worker, "dtype", "")).removeprefix("torch."),
        "device": str(worker.device),
    }


def store_endpoints(worker, port: int) -> list:
    """The local ``[ip, port]`` of this worker process's connections to the store on ``port``
    (so that the manager can tell the trainer's connections from the workers':
    :mod:`rlserve.transfer.server.tcp_peer`)."""
    from rlserve.transfer.server.tcp_peer import own_endpoints

    return own_endpoints(port)


def model_checksums(worker, dtype_name: str | None = None) -> dict | None:
    """sha256 per Hugging Face tensor of this replica's model (TP shards gathered over the TP
    group: every TP worker must run this together). Returns the dict on TP rank 0, ``None`` on
    the others. See :mod:`rlserve.transfer.server.checksums`."""
    from rlserve.transfer.server.checksums import export_hf_tensors, hf_state_checksums

    if worker.device.type == "cuda":
        torch.cuda.set_device(worker.device)
    dtype = None
    if dtype_name:
        from rlserve.transfer.wire.protocol import dtype_from_name

        dtype = dtype_from_name(dtype_name)
    named, skipped = export_hf_tensors(worker.model)
    if int(getattr(worker, "tp_rank", 0)) != 0:
        for _ in named:  # take part in the TP gathers, hash nothing
            pass
        return None
    sums = hf_state_checksums(named, dtype)
    return {"checksums": sums, "skipped": skipped,
            "dtype": str(getattr(worker, "dtype", "")).removeprefix("torch.")}
