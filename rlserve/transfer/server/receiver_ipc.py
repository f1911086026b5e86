"""Server-side CUDA IPC receive: the trainer's handles mapped (per bucket, per tensor, or a
whole handle list kept under its ``ipc_handles_ref``) and read in place on the GPU."""

from __future__ import annotations

import base64
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from rlserve.errors import WeightUpdateError
from rlserve.transfer.finite import Scan, torch_nonfinite
from rlserve.transfer.server.copy_plan import FixedPairs
from rlserve.transfer.server.finite_scan import bucket_units, raise_if_bad, scan_result
from rlserve.transfer.errors import ChecksumMismatchError, WeightTransferFailedError
from rlserve.transfer.multi_tensor import tensor_checksums
from rlserve.transfer.server.bucket_plan import BucketPairs
from rlserve.transfer.wire.packing import plan_buckets
from rlserve.transfer.wire.header import expected_checksum_count
from rlserve.transfer.wire.protocol import UpdateInfo

logger = logging.getLogger(__name__)

#: ``sink(pairs)``: what every receive path of :class:`~rlserve.transfer.server.receiver.WeightReceiver`
#: hands its tensors to, to load / stage ``[(hf_name, tensor)]``. It may return a
#: :class:`~rlserve.transfer.finite.Scan` of the tensors it read (their ``s64sum`` checksums and
#: non-finite test, from a fused copy + checksum); the paths that check after the sink (ipc per
#: tensor, packed with checksums after the data) use it, the others ignore the return value.
Sink = Callable[[list[tuple[str, torch.Tensor]]], "Scan | None"]


@dataclass
class _IpcSet:
    """A per-tensor ipc handle list kept under its ``ipc_handles_ref``."""

    keys: list  # _ipc_cache keys of the mapped tensors
    tensors: list  # the mapped trainer tensors, in update order
    names: list
    dtype_names: list
    shapes: list
    sums: torch.Tensor | None = None  # the trainer's int64 [n] checksum tensor (mapped)
    event: object = None  # the trainer's interprocess torch.cuda.Event
    pairs: FixedPairs | None = None  # (name, tensor) of the load, once known to be on the worker's device
    nbytes: int = 0
    scan_op: tuple | None = None  # (check_finite, MultiTensorSum over the sources or None): _scan_sources


def _scan_sources(st: _IpcSet, pairs, check: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(int64 [n] s64sum checksums, non-finite flags [n] or None)`` of the sources of ``pairs``
    (on their device), read once: one :class:`~rlserve.transfer.multi_tensor.MultiTensorSum`
    launch where it runs (its chunk table kept on ``st`` for a set on the worker's device:
    18,867 per-expert tensors are not tabled again per update), else ``tensor_checksums`` and,
    with ``check``, one :func:`torch_nonfinite` per tensor."""
    from rlserve.transfer.multi_tensor import MultiTensorSum

    srcs = [t for _, t in pairs]
    op = None
    if st.pairs is not None and st.scan_op is not None and st.scan_op[0] == check:
        op = st.scan_op[1]
    elif srcs and srcs[0].is_cuda:
        op = MultiTensorSum.build(srcs, check_finite=check)
        if st.pairs is not None:
            st.scan_op = (check, op)
    if op is not None:
        return op.run(), (op.bad if check else None)
    sums = torch.tensor(tensor_checksums(srcs), dtype=torch.int64)
    return sums, (torch.stack([torch_nonfinite(t) for t in srcs]) if check else None)


class IpcReceive:
    """The ipc half of :class:`~rlserve.transfer.server.receiver.WeightReceiver` (mixed into it):
    map the trainer's CUDA IPC handles (cached across calls and sessions), read them in place."""

    def end_session(self) -> None:
        """Drop cached IPC mappings not used since the previous call (the trainer's memory they
        pin is released)."""
        for r in [r for r in self._ipc_sets if r not in self._ipc_sets_used]:
            del self._ipc_sets[r]
        self._ipc_sets_used.clear()
        for st in self._ipc_sets.values():
            self._ipc_used.update(st.keys)
        for k in [k for k in self._ipc_cache if k not in self._ipc_used]:
            del self._ipc_cache[k]
        self._ipc_used.clear()

    @property
    def ipc_refs(self) -> set[str]:
        """The ``ipc_handles_ref`` names this receiver can resolve."""
        return set(self._ipc_sets)

    def _own_gpu_handle(self, handle: dict) -> dict:
        """A handle with ``"per_gpu"`` (vLLM's multi-GPU colocated trainer,
        :mod:`rlserve.transfer.wire.vllm_ipc`): the entry of this worker's GPU. Raises WeightUpdateError."""
        per_gpu = handle.get("per_gpu")
        if not isinstance(per_gpu, dict):
            return handle
        from rlserve.transfer.wire.ipc import device_uuid

        own = device_uuid(self.device.index if self.device.index is not None else torch.cuda.current_device())
        if own not in per_gpu:
            raise WeightUpdateError(f"ipc handle: none for this worker's GPU {own} (the trainer sent handles for "
                                    f"{sorted(per_gpu)})")
        return per_gpu[own]

    def _map_cached(self, handle: dict, what: str) -> tuple[tuple, torch.Tensor]:
        handle = self._own_gpu_handle(handle)
        # "export" (vLLM's handles, rlserve.transfer.wire.vllm_ipc): its trainer exports every tensor
        # again at each sync, and each export's IPC ref counter must be released by one rebuild
        # (torch's rebuild_cuda_tensor does it on its own cache hit), so each export is mapped
        key = tuple(str(handle.get(k)) for k in ("handle", "device_uuid", "storage_offset_bytes",
                                                 "tensor_offset", "size", "stride", "dtype", "export"))
        t = self._ipc_cache.get(key)
        if t is None:
            t = self._ipc_cache[key] = self._map(handle, what)
        self._ipc_used.add(key)
        return key, t

    def with_ref_metadata(self, info: UpdateInfo) -> UpdateInfo:
        """``info`` itself, or -- a call :attr:`~UpdateInfo.by_ref` -- a copy with the names,
        dtypes and shapes recorded under its ref. Raises WeightUpdateError (unknown ref)."""
        if not info.by_ref:
            return info
        st = self._ipc_sets.get(info.ipc_handles_ref)
        if st is None:
            raise WeightUpdateError(f"ipc_handles_ref {info.ipc_handles_ref!r} is unknown to this worker: "
                                    "send ipc_handles with it")
        out = UpdateInfo(**{**info.__dict__, "names": st.names, "dtype_names": st.dtype_names, "shapes": st.shapes})
        return out

    def _ipc_set(self, info: UpdateInfo) -> _IpcSet:
        """The mapped tensors (and the trainer's checksum tensor / event) of a per-tensor ipc
        call: from ``ipc_handles`` (kept under ``ipc_handles_ref`` when one is given) or, without
        handles, the set kept under the ref. Raises WeightUpdateError (unknown ref, wrong count,
        a bad event handle) / WeightTransferFailedError (mapping)."""
        ref = info.ipc_handles_ref
        if info.ipc_handles is None:
            st = self._ipc_sets.get(ref)
            if st is None:
                raise WeightUpdateError(f"ipc_handles_ref {ref!r} is unknown to this worker: send ipc_handles with it")
            if st.names != info.names or st.dtype_names != info.dtype_names or st.shapes != info.shapes:
                raise WeightUpdateError(f"ipc_handles_ref {ref!r} was given for other tensors than this call's")
            self._ipc_used.update(st.keys)
        else:
            st = _IpcSet([], [], list(info.names), list(info.dtype_names), [list(x) for x in info.shapes])
            for i, (name, handle) in enumerate(zip(info.names, info.ipc_handles)):
                k, t = self._map_cached(handle, f"ipc tensor {name!r} ({i + 1}/{len(info.names)})")
                st.keys.append(k)
                st.tensors.append(t)
            if info.ipc_checksums_handle is not None:
                k, sums = self._map_cached(info.ipc_checksums_handle, "the trainer's checksum tensor")
                if sums.dtype != torch.int64 or list(sums.shape) != [len(info.names)]:
                    raise WeightUpdateError(f"ipc_checksums_handle maps {sums.dtype} {list(sums.shape)}, expected "
                                            f"int64 [{len(info.names)}]")
                st.keys.append(k)
                st.sums = sums
            if info.ipc_event_handle is not None:
                raw = base64.b64decode(info.ipc_event_handle.encode("ascii"), validate=True) \
                    if info.ipc_event_handle else b""
                try:
                    dev = self.device.index if self.device.index is not None else torch.cuda.current_device()
                    st.event = torch.cuda.Event.from_ipc_handle(dev, raw)
                except Exception as e:  # noqa: BLE001 - a bad handle from the trainer
                    raise WeightUpdateError(f"ipc_event_handle could not be opened: {e}") from e
            if ref is not None:
                self._ipc_sets[ref] = st
        if ref is not None:
            self._ipc_sets_used.add(ref)
        return st

    def _map(self, handle: dict, what: str) -> torch.Tensor:
        from rlserve.transfer.wire.ipc import import_handle

        try:
            return import_handle(handle)
        except WeightUpdateError:
            raise
        except Exception as e:
            raise WeightTransferFailedError(f"{what}: could not map the CUDA IPC handle: {e}") from e

    def _ipc_done_reading(self, dev: torch.device) -> None:
        # the trainer may reuse / free its memory as soon as we answer: finish reading first
        if self._stream is not None:
            self._stream.synchronize()
        if dev != self.device:
            torch.cuda.current_stream(dev).synchronize()

    def _receive_ipc(self, info: UpdateInfo, sink: Sink, on_bucket) -> dict:
        """Packed: one handle per bucket (a uint8 buffer laid out by the plan). Unpacked: one
        handle per tensor (the trainer's own tensors, read in place: no copy on its side)."""
        n = expected_checksum_count(info)
        if (info.ipc_handles is None and (info.packed or info.ipc_handles_ref is None)) or \
                (info.ipc_handles is not None and len(info.ipc_handles) != n):
            raise WeightUpdateError(f"ipc: expected {n} handles, got "
                                    f"{0 if info.ipc_handles is None else len(info.ipc_handles)}")
        total = 0
        if not info.packed:
            # map (cached across calls; a whole set under its ipc_handles_ref) and check every
            # tensor (once per set), then hand the whole call to the sink at once and verify
            # every checksum
            t0 = time.perf_counter()
            known = info.ipc_handles is None
            st = self._ipc_set(info)
            if not known:
                dtypes = info.dtypes()
                for i, (name, t) in enumerate(zip(info.names, st.tensors)):
                    if t.dtype != dtypes[i] or list(t.shape) != list(info.shapes[i]):
                        self._ipc_sets.pop(info.ipc_handles_ref, None)
                        raise WeightUpdateError(f"ipc tensor {name!r} ({i + 1}/{n}): handle maps {t.dtype} "
                                                f"{list(t.shape)}, update_info says {dtypes[i]} {info.shapes[i]}")
            if st.pairs is None:
                st.nbytes = sum(t.numel() * t.element_size() for t in st.tensors)
                if all(t.device == self.device for t in st.tensors):  # (else moved per update, below)
                    st.pairs = FixedPairs(zip(info.names, st.tensors))
            pairs = st.pairs if st.pairs is not None else list(zip(info.names, st.tensors))
            total = st.nbytes
            if st.event is not None:
                torch.cuda.current_stream(self.device).wait_event(st.event)  # the trainer's writes + sums
            if info.device_checksums and st.sums is None:
                raise WeightUpdateError("device_checksums: the trainer registered no checksum tensor for this ref")
            t_map = time.perf_counter()
            devs = {self.device} if st.pairs is not None else {t.device for _, t in pairs}
            t_load = t_ck = t_map
            fused = False
            if pairs:
                # The sink copies first; the checksums are compared after (the sources are the
                # trainer's own tensors: reading them twice would double the cost). A sink that
                # copied with MultiTensorSum returns the sums of what it read (one pass over the
                # bytes); otherwise they are taken here, from the same sources, after the copy.
                # A mismatch fails the update like a broken one: in place the server answers
                # 503 until a full update lands, staged it is never committed.
                ret = sink(pairs if st.pairs is not None else
                           [(name, t if t.device == self.device else t.to(self.device)) for name, t in pairs])
                t_load = time.perf_counter()
                sums, nonfinite = scan_result(ret, info.names)
                want_ck = info.checksums is not None or info.device_checksums
                # "checksums_fused": the checksums COMPARED came from the copy's own pass (the sums a
                # NaN / inf scan makes on the way are not checksums the update asked for)
                fused = want_ck and sums is not None
                if (want_ck and sums is None) or (self.check_finite and nonfinite is None):
                    # the sink's load read them without summing (a TP shard, a cast, a load that
                    # is not replayable): one more read of the sources, every sum and test in it
                    got, bad = _scan_sources(st, pairs, self.check_finite and nonfinite is None)
                    sums = sums if sums is not None else got
                    nonfinite = nonfinite if nonfinite is not None or bad is None else (bad, list(info.names))
                if want_ck:
                    # expected: the trainer's checksum tensor (read on the GPU after its event) or
                    # the announced list; compared as int64 tensors where the expected sums live, one sync
                    exp = st.sums if info.device_checksums else torch.tensor(info.checksums, dtype=torch.int64)
                    got = sums.to(exp.device)
                    bad = (got != exp).nonzero()
                    if bad.numel():
                        i = int(bad[0, 0])
                        got, exp = int(got[i]), int(exp[i])
                        raise ChecksumMismatchError(
                            f"ipc tensor {info.names[i]!r} ({i + 1}/{n}): checksum {got} != announced {exp} "
                            "(the trainer's memory changed while the server read it?); the update is refused")
                if self.check_finite:  # NaN / inf: from the fused pass, else from _scan_sources
                    raise_if_bad(nonfinite, "ipc update")
                t_ck = time.perf_counter()
                for d in devs:
                    self._ipc_done_reading(d)
            if on_bucket is not None:
                for i in range(n):
                    on_bucket(i)
            t_end = time.perf_counter()
            return {"bytes": total, "buckets": 1 if n else 0, "tensors": n, "checksums_fused": fused,
                    "phases_s": {"map": t_map - t0, "load_queued": t_load - t_map, "checksum": t_ck - t_load,
                                 "device_sync": t_end - t_ck}}
        t0 = time.perf_counter()
        plan = plan_buckets(info.names, info.dtypes(), info.shapes, info.packed_buffer_size_bytes)
        ph = dict.fromkeys(("plan", "map", "verify", "load_queued", "device_sync", "unmap"), 0.0)
        tm = time.perf_counter()
        ph["plan"] = tm - t0
        for i, (b, handle) in enumerate(zip(plan, info.ipc_handles)):
            what = f"ipc bucket {i + 1}/{len(plan)}"
            mapped = self._map(handle, what)
            if mapped.dtype != torch.uint8 or mapped.dim() != 1 or mapped.numel() < b.nbytes:
                raise WeightUpdateError(f"{what}: the handle maps {mapped.dtype} {list(mapped.shape)}, the plan "
                                        f"needs a 1-D uint8 buffer of {b.nbytes} bytes")
            buf = mapped[: b.nbytes]
            tm, t_prev = time.perf_counter(), tm
            ph["map"] += tm - t_prev
            self._verify(buf, info.checksums, i, what, units=bucket_units(b))
            tm, t_prev = time.perf_counter(), tm
            ph["verify"] += tm - t_prev
            # unpacked only when the worker records the bucket's load (bucket_plan: replayed at
            # this buffer's address otherwise)
            pairs = BucketPairs(buf, b)
            if buf.device != self.device:
                pairs = [(n_, t.to(self.device)) for n_, t in pairs]
            sink(pairs)
            tm, t_prev = time.perf_counter(), tm
            ph["load_queued"] += tm - t_prev
            self._ipc_done_reading(buf.device)
            tm, t_prev = time.perf_counter(), tm
            ph["device_sync"] += tm - t_prev
            del buf, mapped, pairs  # (the last reference: torch closes the IPC mapping here)
            tm, t_prev = time.perf_counter(), tm
            ph["unmap"] += tm - t_prev
            total += b.nbytes
            if on_bucket is not None:
                on_bucket(i)
        return {"bytes": total, "buckets": len(plan), "tensors": len(info.names), "phases_s": ph}
