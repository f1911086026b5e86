"""Trainer SDK, CUDA IPC engine: :class:`IPCTrainerEngine` (trainer and server share a GPU; no
process group; packed buckets or per-tensor handles, one ``/sync_weights`` call when it can)."""

from __future__ import annotations

import base64
import concurrent.futures as cf
import logging
import time
import uuid
from typing import Callable

import torch

from rlserve.transfer.host_ops import wrap64
from rlserve.transfer.multi_tensor import tensor_checksums
from rlserve.transfer.wire.pack_device import DevicePacker
from rlserve.transfer.wire.packing import checksum, max_bucket_bytes, plan_buckets
from rlserve.transfer.wire.protocol import UpdateInfo, dtype_to_name
from rlserve.transfer.sdk.client import WeightSyncHTTPError
from rlserve.transfer.sdk.engine import TrainerWeightTransferEngine, _liveness_store

logger = logging.getLogger(__name__)


class IPCTrainerEngine(TrainerWeightTransferEngine):
    """CUDA IPC: trainer and server share a GPU; no process group.

    The update is cut by the bucket plan (calls are sequential: the server answers once it has
    read the memory):

    - packed (``IPCTrainerInitInfo(packed=True)``, not the default): one ``update_weights`` call
      per bucket; the bucket is packed into one of ``packed_num_buffers`` CUDA buffers and the
      call carries that buffer's IPC handle; packing bucket ``i+1`` overlaps the server's copy of
      bucket ``i``. Trainer memory: the buffers. GPU traffic: the trainer's pack copy plus the
      server's load copy.
    - unpacked (the default): one handle per tensor; the server reads the trainer's tensors in
      place: one copy in all (the server's). The module's own parameters (exported once per session) travel in
      a single call for the whole update, which the server loads by replaying a recorded copy
      plan (:mod:`rlserve.transfer.server.copy_plan`); tensors the source creates (dtype casts, FSDP
      gathers) go bucket by bucket and stay alive until their call returned
      (``packed_num_buffers`` calls in flight).

    Checksums (``checksums=True``) are computed on the GPU right before each call (per bucket
    or per tensor); they catch a trainer that modifies its weights while the server reads them.
    """

    def __init__(self, init_info, client, source):
        super().__init__(init_info, client, source)
        dev = getattr(init_info, "device", None)
        self.device = torch.device(dev) if dev else torch.device("cuda", torch.cuda.current_device())
        if self.is_sender:
            self._connect()

    def _connect(self) -> None:
        from rlserve.transfer.multi_tensor import warmup

        warmup(self.device)  # compile the one-launch checksum kernel now, not in the first sync
        server_init = self.init_info.to_server_init_info()
        if getattr(self, "_liveness_store", None) is None:
            self._liveness_store = _liveness_store(self.init_info.master_address, self.init_info.timeout_s)
        # the server watches this process through the store's connection (rlserve.transfer.server.liveness)
        server_init["master_port"] = self._liveness_store.port
        self.client.init_weight_transfer_engine(server_init, self.init_info.timeout_s)
        self._exported: dict[tuple, tuple[torch.Tensor, dict]] = {}
        self._batch_ref: tuple[tuple, str] | None = None  # (batch key, ipc_handles_ref the server holds)
        self._fast: dict | None = None  # the one-call path's registration (see _send_one_call)
        self._packer = DevicePacker()  # packed: one-launch packs of the parameters' buckets

    def _teardown(self) -> None:
        self._packer = DevicePacker()
        self._exported = {}
        self._batch_ref = None
        self._fast = None

    def shutdown(self) -> None:
        super().shutdown()
        self._liveness_store = None  # (after the server left: it then sees the store close)

    @staticmethod
    def _batch_key(names, tensors) -> tuple:
        """What the server's copy of a handle list depends on: names and the tensors' memory."""
        return tuple((n, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride())) for n, t in zip(names, tensors))

    def _batch_call(self, make_info: Callable[[list | None, str], UpdateInfo], key: tuple,
                    handles: Callable[[], list[dict]]) -> dict:
        """The ``update_weights`` call carrying the persistent tensors (start / update / finish
        path): only a ref to the handle list when the server holds it from the previous sync,
        else the handles under a new ref (also when the server answers that it does not know
        the ref)."""
        def call(d, t=self.init_info.timeout_s):
            return self.client.update_weights(d, t)

        if self._batch_ref is not None and self._batch_ref[0] == key:
            try:
                return call(make_info(None, self._batch_ref[1]).to_dict())
            except WeightSyncHTTPError as e:
                if e.status_code != 400 or "ipc_handles_ref" not in e.message:
                    raise
                logger.info("server does not hold the ipc handle list any more: sending the handles")
        self._batch_ref = None
        ref = uuid.uuid4().hex
        ans = call(make_info(handles(), ref).to_dict())
        self._batch_ref = (key, ref)
        return ans

    def _send_one_call(self, partial: bool, weight_version: str | None) -> tuple[dict, dict] | None:
        """Per-tensor handles, every tensor one of the source's own (persistent) tensors: the
        whole update is one ``POST /sync_weights``, and the trainer never waits for its GPU.

        The first call registers the tensors under a ref: names / dtypes / shapes, the handles,
        the handle of an int64 ``[n]`` tensor that receives this trainer's checksums and an
        interprocess CUDA event. Every call then queues the one-launch checksum into that tensor,
        records the event and sends the ref alone (~100 bytes); the server's stream waits on the
        event, copies and checksums in one pass and compares on the GPU. A server that lost the
        ref answers 400 and gets the registration again; one without the route answers 404 once
        (the engine then keeps to start / update / finish)."""
        from rlserve.transfer.wire.ipc import export_handle

        ii = self.init_info
        if ii.packed or getattr(self, "_one_call", True) is False or not self._source_is_persistent():
            # (a casting or FSDP source would create -- gather -- every tensor here and again in
            # the three-call path that follows)
            return None
        t0 = time.perf_counter()
        named = list(self.source.named_tensors())
        if not named:
            return None
        names, tensors = [n for n, _ in named], [t for _, t in named]
        # Per sync only the names and addresses are compared with the registration's (~0.1 ms
        # for 399 tensors); the full check and key (device, storage, contiguity, dtype, shape,
        # strides: ~1 ms) run when an address changed -- a tensor in place keeps its address
        # and layout.
        ptrs = tuple(t.data_ptr() for t in tensors)
        flags = (bool(partial), bool(ii.checksums))
        fast = self._fast
        persistent = None
        if fast is None or fast["ptrs"] != ptrs or fast["flags"] != flags or fast["names"] != names:
            persistent = self._persistent_storages()
            for t in tensors:
                if not t.is_cuda or t.device != self.device or t.untyped_storage().data_ptr() not in persistent \
                        or not t.is_contiguous():
                    return None
            key = self._batch_key(names, tensors)
            if fast is None or fast["key"] != key or fast["flags"] != flags:
                from rlserve.transfer.multi_tensor import MultiTensorSum

                with torch.cuda.device(self.device):
                    event = torch.cuda.Event(interprocess=True)
                sums = torch.zeros(len(tensors), dtype=torch.int64, device=self.device) if ii.checksums else None
                op = MultiTensorSum.build(tensors) if ii.checksums else None
                fast = self._fast = {"key": key, "flags": flags, "ref": None, "event": event, "sums": sums, "op": op,
                                     "nbytes": sum(t.numel() * t.element_size() for t in tensors)}
            fast.update(ptrs=ptrs, names=names)
        stream = torch.cuda.current_stream(self.device)
        if fast["sums"] is not None:
            if fast["op"] is not None:
                fast["op"].run(out=fast["sums"])
            else:
                fast["sums"].copy_(torch.tensor(tensor_checksums(tensors), dtype=torch.int64))
        fast["event"].record(stream)  # after the writes and the checksums: the server waits on it
        t_ck = time.perf_counter()

        def call(update_info: UpdateInfo) -> dict:
            return self.client.sync_weights(update_info.to_dict(), weight_version, ii.timeout_s)

        fin = None
        try:
            if fast["ref"] is not None:
                try:
                    fin = call(UpdateInfo(packed=False, partial=partial, ipc_handles_ref=fast["ref"],
                                          device_checksums=fast["sums"] is not None,
                                          lora=getattr(self.source, "lora", None)))
                except WeightSyncHTTPError as e:
                    if e.status_code != 400 or "ipc_handles_ref" not in e.message:
                        raise
                    logger.info("server does not hold the ipc handle list any more: registering it again")
                    fast["ref"] = None
            if fin is None:
                info = self._metadata_info(partial)
                if info.names != names:
                    return None
                ref = uuid.uuid4().hex
                if persistent is None:
                    persistent = self._persistent_storages()
                reg = UpdateInfo(
                    names=info.names, dtype_names=info.dtype_names, shapes=info.shapes, packed=False,
                    partial=partial, ipc_handles=[self._handle(t, persistent) for t in tensors], ipc_handles_ref=ref,
                    ipc_checksums_handle=None if fast["sums"] is None else export_handle(fast["sums"]),
                    ipc_event_handle=base64.b64encode(fast["event"].ipc_handle()).decode("ascii"),
                    device_checksums=fast["sums"] is not None, lora=info.lora)
                fin = call(reg)
                fast["ref"] = ref
        except WeightSyncHTTPError as e:
            if e.status_code == 404:
                self._one_call = False
                logger.info("server has no /sync_weights: using start / update / finish")
                return None
            raise
        t_end = time.perf_counter()
        stats = {"bytes": fast["nbytes"], "buckets": 1, "seconds": t_end - t0, "server": fin.get("update", {}),
                 "one_call": True, "phases_s": {"prepare": t_ck - t0, "sync_call": t_end - t_ck}}
        return stats, fin

    def _persistent_storages(self) -> set[int]:
        """Storage pointers of tensors living across syncs (a :class:`ModuleSource`'s module
        parameters, a :class:`TensorListSource`'s tensors), whose IPC handle is exported once
        (re-exporting a storage each sync would grow torch's per-storage IPC bookkeeping without
        bound) and which travel in one call."""
        mod = getattr(self.source, "module", None)
        if mod is not None:
            tensors = list(mod.parameters())
        else:
            tensors = [t for _, t in getattr(self.source, "items", [])]
        return {t.untyped_storage().data_ptr() for t in tensors if t.is_cuda}

    def _handle(self, t: torch.Tensor, persistent: set[int]) -> dict:
        from rlserve.transfer.wire.ipc import export_handle

        ptr = t.untyped_storage().data_ptr()
        if ptr not in persistent:
            h = export_handle(t)
        else:
            key = (ptr, t.untyped_storage().nbytes(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
            hit = self._exported.get(key)
            if hit is None:
                hit = self._exported[key] = (t, export_handle(t))
            h = dict(hit[1])
        # the trainer synchronized before the call, or (one-call path) the server's stream waits
        # on the trainer's interprocess event
        h["event_sync_required"] = False
        return h

    def _send(self, info: UpdateInfo, declared: dict) -> dict:
        from rlserve.transfer.wire.ipc import export_handle
        from rlserve.transfer.wire.packing import pack
        from rlserve.transfer.sdk.sender import take_bucket_tensors

        t0 = time.perf_counter()
        ii = self.init_info
        dtypes = info.dtypes()
        plan = plan_buckets(info.names, dtypes, info.shapes, info.packed_buffer_size_bytes)
        nbuf = max(1, min(info.packed_num_buffers, len(plan)))
        bufs = []
        phases: dict[str, float] = {}
        if info.packed and plan:
            # fresh buffers per sync: torch's IPC bookkeeping on a shared block is freed with it
            size = max_bucket_bytes(plan)
            bufs = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(nbuf)]
            phases["alloc"] = time.perf_counter() - t0
        futs: dict[int, tuple[cf.Future, list]] = {}
        it = iter(self.source.named_tensors())
        total = 0
        persistent = self._persistent_storages() if not info.packed else set()
        batch: list[tuple] = []  # (slot, tensor) of persistent tensors: one call at the end

        def submit(key: int, slots, handles, checksums, keep) -> None:
            sub = UpdateInfo(
                names=[s.name for s in slots], dtype_names=[dtype_to_name(s.dtype) for s in slots],
                shapes=[list(s.shape) for s in slots], packed=info.packed,
                packed_buffer_size_bytes=info.packed_buffer_size_bytes, packed_num_buffers=nbuf,
                checksums=checksums, partial=True, ipc_handles=handles)
            futs[key] = (self._pool.submit(self.client.update_weights, sub.to_dict(), ii.timeout_s), keep)

        answers: dict[int, dict] = {}

        def wait(bi: int) -> None:
            t_a = time.perf_counter()
            fut, _keep = futs.pop(bi)
            answers[bi] = fut.result(timeout=ii.timeout_s + 30)
            phases["wait_answers"] = phases.get("wait_answers", 0.0) + time.perf_counter() - t_a

        try:
            for bi, b in enumerate(plan):
                if bi - nbuf in futs:
                    wait(bi - nbuf)  # the server has read buffer / tensors of bucket bi - nbuf
                for f, _ in futs.values():
                    if f.done() and f.exception() is not None:
                        raise f.exception()
                keep: list = []
                if info.packed:
                    buf = bufs[bi % nbuf]
                    tensors = take_bucket_tensors(it, b)
                    # one launch per bucket, the checksum in the same pass, cached per layout and
                    # source addresses (rlserve.transfer.wire.pack_device); else slot by slot
                    t_p = time.perf_counter()
                    summed = self._packer.pack(buf, b, tensors)
                    if summed is None:
                        pack(buf, b, tensors)
                        checksums = [checksum(buf[: b.nbytes])] if ii.checksums else None
                    else:
                        checksums = [wrap64(int(summed.item()))] if ii.checksums else None
                    del tensors
                    phases["pack"] = phases.get("pack", 0.0) + time.perf_counter() - t_p
                    submit(bi, b.slots, [export_handle(buf)], checksums, [buf])
                    total += b.nbytes
                    continue
                for t in take_bucket_tensors(it, b):
                    t = t.contiguous()
                    if t.device != self.device:
                        t = t.to(self.device)
                    keep.append(t)
                total += sum(s.nbytes for s in b.slots)
                if all(t.untyped_storage().data_ptr() in persistent for t in keep):
                    batch.extend(zip(b.slots, keep))  # the module's own parameters: sent together below
                    continue
                # tensors made for this sync (casts, FSDP gathers): their own call, so that at most
                # packed_num_buffers buckets of them are alive at once
                checksums = tensor_checksums(keep) if ii.checksums else None
                torch.cuda.current_stream(self.device).synchronize()  # written before the server reads
                submit(bi, b.slots, [self._handle(t, persistent) for t in keep], checksums, keep)
            if next(it, None) is not None:
                raise ValueError("source yielded more tensors than announced")
            if batch:
                tensors = [t for _, t in batch]
                slots = [s for s, _ in batch]
                key = self._batch_key([s.name for s in slots], tensors)
                t_b = time.perf_counter()
                checksums = tensor_checksums(tensors) if ii.checksums else None  # one launch on a GPU
                torch.cuda.current_stream(self.device).synchronize()
                t_ck = time.perf_counter()

                def make_info(handles, ref, slots=slots, checksums=checksums):
                    return UpdateInfo(
                        names=[s.name for s in slots], dtype_names=[dtype_to_name(s.dtype) for s in slots],
                        shapes=[list(s.shape) for s in slots], packed=False,
                        packed_buffer_size_bytes=info.packed_buffer_size_bytes, packed_num_buffers=nbuf,
                        checksums=checksums, partial=True, ipc_handles=handles, ipc_handles_ref=ref)

                fut = self._pool.submit(self._batch_call, make_info, key,
                                        lambda tensors=tensors: [self._handle(t, persistent) for t in tensors])
                futs[len(plan)] = (fut, tensors)
                phases.update(checksums=t_ck - t_b)
            t_w = time.perf_counter()
            for bi in sorted(futs):
                wait(bi)
            phases["wait_calls"] = time.perf_counter() - t_w
            if info.packed:  # where the calls' time went on the server, summed over the buckets
                phases.update(_server_sums(answers.values()))
        finally:
            for f, _keep in futs.values():  # never free memory the server may still read
                try:
                    f.result(timeout=ii.timeout_s + 30)
                except BaseException:
                    pass
        return {"bytes": total, "buckets": len(plan), "seconds": time.perf_counter() - t0, "ipc_phases_s": phases,
                "server": answers[max(answers)] if answers else {}}


def _server_sums(answers) -> dict[str, float]:
    """Seconds of ``update_weights`` answers summed: ``server_call`` (the manager's time in the
    workers), ``server_validate``, ``server_worker`` and each ``server_worker_<phase>`` of the
    first worker (:meth:`rlserve.transfer.server.manager_update` answers)."""
    out: dict[str, float] = {}
    for a in answers:
        for k, name in (("seconds", "server_call"), ("validate_seconds", "server_validate"),
                        ("worker_seconds", "server_worker")):
            out[name] = out.get(name, 0.0) + float(a.get(k) or 0.0)
        for k, v in (a.get("worker_phases_s") or {}).items():
            out[f"server_worker_{k}"] = out.get(f"server_worker_{k}", 0.0) + float(v)
    return out
