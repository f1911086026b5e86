"""Trainer SDK: push a training model's weights into a running rlserve server.

Mirrors vLLM's trainer-side API, so a script written like vLLM's ``rlhf_http_nccl.py`` ports by
changing imports::

    from rlserve.transfer import (HTTPWeightSyncClient, ModuleSource, NCCLTrainerInitInfo,
                                  WeightTransferTrainerFactory)

    engine = WeightTransferTrainerFactory.trainer_init(
        init_info=NCCLTrainerInitInfo(master_address=ip, master_port=port,
                                      world_size=server_world_size + 1),
        client=HTTPWeightSyncClient("http://localhost:8000", admin_key=None),
        source=ModuleSource(train_model),
    )
    engine.send_weights()            # start_weight_update -> update_weights (+ broadcast) -> finish
    engine.shutdown()

``send_weights``:

1. collects the metadata (names, dtypes, shapes: no gather) and, unless ``checksums=False``, one
   ``s64sum`` checksum per bucket (a pass over the tensors: FSDP gathers every parameter once for
   it, then again to send);
2. ``POST /start_weight_update`` with the whole ``update_info``: the server validates it against
   its model and answers 400 before any byte moves;
3. ``POST /update_weights`` on a background thread while this thread broadcasts (the server only
   joins the broadcast while its handler runs); if the HTTP call fails, the broadcast gives up at
   once; ipc instead sends one ``update_weights`` per bucket carrying that bucket's CUDA IPC
   handle;
4. ``POST /finish_weight_update`` (``weight_version`` auto-increments on the server unless given).

After a failed transfer the group is torn down on both sides; the next ``send_weights`` first
re-runs the init handshake (``engine.reinit()`` does it explicitly).

FSDP2 trainers: every rank builds the engine with its own ``rank`` (0 talks to the server and
sends, the others only iterate the source so that ``full_tensor()`` gathers line up) and every
rank calls ``send_weights``.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterable, Iterator

import torch
from torch import nn

from rlserve.errors import WeightUpdateError, WeightUpdateStateError
from rlserve.transfer.errors import TransferAbortedError, TransferTimeoutError, WeightTransferFailedError
from rlserve.transfer.group import TransferGroup
from rlserve.transfer.packing import (
    BucketBuffers,
    bucket_checksums_from_tensors,
    checksum,
    max_bucket_bytes,
    plan_buckets,
    tensor_checksum,  # noqa: F401
    tensor_checksums,
    unpack,  # noqa: F401  (re-exported for tests)
)
from rlserve.transfer.protocol import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    DEFAULT_TIMEOUT_S,
    InitInfo,
    UpdateInfo,
    dtype_to_name,
)
from rlserve.transfer.sender import send_packed, send_unpacked

logger = logging.getLogger(__name__)


# ============================================================================ HTTP client
class WeightSyncHTTPError(WeightUpdateError):
    """The server answered an error. Attributes: ``status_code``, ``error_type``, ``message``,
    ``route``, ``code`` (the error's machine-readable code, e.g. ``"no_transfer_engine"``)."""

    def __init__(self, route: str, status_code: int, message: str, error_type: str | None = None,
                 code: str | None = None):
        super().__init__(f"{route} -> HTTP {status_code} ({error_type or 'error'}): {message}")
        self.route, self.status_code, self.message, self.error_type = route, status_code, message, error_type
        self.code = code


class WeightSyncConflictError(WeightSyncHTTPError, WeightUpdateStateError):
    """HTTP 409: the call arrived out of order."""


class HTTPWeightSyncClient:
    """Client of the server's weight-sync control routes (``requests``, JSON only).

    Args:
        base_url: e.g. ``"http://localhost:8000"``.
        admin_key: sent as ``Authorization: Bearer <key>`` (the server's ``--admin-key``).
        timeout_s: read timeout of each call in seconds (``update_weights`` gets the larger of
            this and the value the engine passes); connecting is limited to 10 s.

    Every method raises :class:`WeightSyncHTTPError` (409: :class:`WeightSyncConflictError`)
    with the server's JSON error message on 4xx/5xx, and :class:`WeightTransferFailedError`
    when the server cannot be reached.
    """

    connect_timeout_s = 10.0

    def __init__(self, base_url: str, admin_key: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.base_url = base_url.rstrip("/")
        self.admin_key = admin_key
        self.timeout_s = float(timeout_s)
        self._local = threading.local()  # one keep-alive requests.Session per calling thread

    def _headers(self) -> dict:
        h = {"Content-Type": "application/json"}
        if self.admin_key:
            h["Authorization"] = f"Bearer {self.admin_key}"
        return h

    def _http(self):
        """This thread's ``requests.Session`` (calls run concurrently from several threads; a
        session per thread keeps its connection alive: no TCP connect per call)."""
        import requests

        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
        return s

    def _call(self, method: str, route: str, body: dict | None = None, timeout_s: float | None = None) -> dict:
        import requests

        url = f"{self.base_url}{route}"
        timeout = (self.connect_timeout_s, max(self.timeout_s, timeout_s or 0.0))
        # the standard library's C encoder: requests' own json= path may pick simplejson, which
        # took ~4 ms for an update_info of 399 ipc handles
        data = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        try:
            r = self._http().request(method, url, data=data, headers=self._headers(), timeout=timeout)
        except requests.Timeout as e:
            raise TransferTimeoutError(f"{route}: no answer from {self.base_url} within {timeout[1]:.0f} s") from e
        except requests.RequestException as e:
            raise WeightTransferFailedError(f"{route}: cannot reach {self.base_url}: {e}") from e
        if r.status_code >= 400:
            msg, etype, code = r.text[:2000], None, None
            try:
                j = r.json()
                err = j.get("error", j) if isinstance(j, dict) else {}
                if isinstance(err, dict):
                    msg = err.get("message") or err.get("detail") or msg
                    etype = err.get("type")
                    code = err.get("code") if isinstance(err.get("code"), str) else None
                elif isinstance(err, str):
                    msg = err
            except ValueError:
                pass
            cls = WeightSyncConflictError if r.status_code == 409 else WeightSyncHTTPError
            raise cls(route, r.status_code, str(msg), etype, code)
        try:
            return r.json() if r.content else {}
        except ValueError:
            return {"text": r.text}

    # vLLM-style control plane
    def get_world_size(self) -> int:
        """Server workers (TP * DP); the transfer group is this + 1."""
        return int(self._call("GET", "/get_world_size")["world_size"])

    def init_weight_transfer_engine(self, init_info: dict, timeout_s: float | None = None) -> dict:
        return self._call("POST", "/init_weight_transfer_engine", {"init_info": init_info}, timeout_s)

    #: The transfer group incarnation (``init_info.session``) this client's update calls belong
    #: to; the trainer engine sets it at each init. The server refuses (409 ``stale_session``)
    #: calls of a session another init has replaced. ``None``: not sent.
    session: str | None = None

    def _session_body(self, body: dict) -> dict:
        if self.session:
            body["session"] = self.session
        return body

    def start_weight_update(self, update_info: dict | None = None) -> dict:
        return self._call("POST", "/start_weight_update",
                          self._session_body({"update_info": update_info} if update_info else {}))

    def update_weights(self, update_info: dict, timeout_s: float | None = None) -> dict:
        return self._call("POST", "/update_weights", self._session_body({"update_info": update_info}), timeout_s)

    def sync_weights(self, update_info: dict, weight_version: str | None = None,
                     timeout_s: float | None = None) -> dict:
        """rlserve's one-call update (start + update + finish): ``POST /sync_weights``."""
        body = {"update_info": update_info}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return self._call("POST", "/sync_weights", self._session_body(body), timeout_s)

    def finish_weight_update(self, weight_version: str | None = None, timeout_s: float | None = None) -> dict:
        body = {} if weight_version is None else {"weight_version": str(weight_version)}
        return self._call("POST", "/finish_weight_update", self._session_body(body), timeout_s)

    def shutdown_weight_transfer_engine(self) -> dict:
        return self._call("POST", "/shutdown_weight_transfer_engine", {})

    def weight_info(self) -> dict:
        return self._call("GET", "/weight_info")

    def weight_checker(self, compare: dict[str, str] | None = None) -> dict:
        return self._call("POST", "/weight_checker", {"compare": compare} if compare else {})

    def pause(self, mode: str = "abort", clear_cache: bool = False) -> dict:
        """``POST /pause``; the same default as the route (and vLLM's): ``abort`` ends the requests in
        flight; ``keep`` freezes them and continues them after :meth:`resume`; ``wait`` lets them
        finish first."""
        return self._call("POST", f"/pause?mode={mode}&clear_cache={str(clear_cache).lower()}", {})

    def resume(self) -> dict:
        return self._call("POST", "/resume", {})

    # TRL-style
    def init_communicator(self, host: str, port: int, world_size: int, wire: str | None = None) -> dict:
        body = {"host": host, "port": port, "world_size": world_size}
        if wire is not None:
            body["wire"] = wire  # "rlserve": rlserve's data plane, not vLLM's (see TRLWeightSyncClient)
        return self._call("POST", "/init_communicator/", body)

    def update_named_param(self, name: str, dtype: str, shape: list[int]) -> dict:
        return self._call("POST", "/update_named_param/", {"name": name, "dtype": dtype, "shape": list(shape)})

    def reset_prefix_cache(self) -> dict:
        return self._call("POST", "/reset_prefix_cache/", {})

    def close_communicator(self) -> dict:
        return self._call("POST", "/close_communicator/", {})


#: vLLM's name, for scripts ported from vLLM.
HTTPVLLMWeightSyncClient = HTTPWeightSyncClient


# ============================================================================ sources
_WRAPPER_PARTS = ("module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def hf_name(name: str) -> str:
    """Strip wrapper components (``module.`` from DDP, ``_orig_mod.`` from torch.compile,
    ``_fsdp_wrapped_module.`` / ``_checkpoint_wrapped_module.``) from a parameter name."""
    parts = name.split(".")
    while parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(p for p in parts if p not in _WRAPPER_PARTS[1:])


class ModuleSource:
    """Yields ``(hf_name, full tensor)`` of a Hugging Face-style ``nn.Module``.

    Args:
        module: a plain module, DDP / torch.compile wrapped, or FSDP2 (DTensor parameters).
        dtype: cast floating tensors to this dtype before sending (e.g. ``torch.bfloat16`` to
            halve the bytes of a float32 trainer); ``None`` sends them as they are.
        include: optional predicate on the HF name (partial updates).

    Names are Hugging Face checkpoint names: wrapper prefixes are stripped, and a tied
    ``lm_head.weight`` is skipped (``named_parameters()`` already dedups the shared tensor; with
    ``tie_word_embeddings`` an explicitly listed head is dropped too). Buffers are not sent.

    DTensor parameters: :meth:`named_tensors` calls ``full_tensor()`` per parameter (a
    collective), so every rank of the trainer must iterate in the same order; metadata
    (:meth:`metadata`) needs no communication.
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype | None = None,
                 include: Callable[[str], bool] | None = None):
        self.module = module
        self.dtype = dtype
        self.include = include

    def _params(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        seen: set[str] = set()
        tied = bool(getattr(getattr(self.module, "config", None), "tie_word_embeddings", False))
        for raw, p in self.module.named_parameters():
            name = hf_name(raw)
            if name in seen:
                continue
            if tied and name == "lm_head.weight":
                continue
            if self.include is not None and not self.include(name):
                continue
            seen.add(name)
            out.append((name, p))
        return out

    def _out_dtype(self, t: torch.Tensor) -> torch.dtype:
        return self.dtype if (self.dtype is not None and t.is_floating_point()) else t.dtype

    def metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``[(hf_name, dtype on the wire, full shape)]`` in send order; no communication."""
        return [(n, self._out_dtype(p), tuple(p.shape)) for n, p in self._params()]

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full contiguous tensor)`` in :meth:`metadata` order."""
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # pragma: no cover
            DTensor = ()  # type: ignore[assignment]
        for name, p in self._params():
            t = p.detach()
            if DTensor and isinstance(t, DTensor):
                t = t.full_tensor()
            if self.dtype is not None and t.is_floating_point() and t.dtype != self.dtype:
                t = t.to(self.dtype)
            yield name, t.contiguous()


class TensorListSource:
    """A source over explicit ``(name, tensor)`` pairs (tests, benchmarks, custom exporters)."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]):
        self.items = [(n, t.detach()) for n, t in named]

    def metadata(self):
        return [(n, t.dtype, tuple(t.shape)) for n, t in self.items]

    def named_tensors(self):
        for n, t in self.items:
            yield n, t.contiguous()


# ============================================================================ init infos
@dataclass
class TrainerInitInfo:
    """Common fields of the trainer-side init infos.

    Attributes:
        master_address / master_port: the TCPStore the trainer hosts (rank 0). ``master_port=0``
            picks a free port.
        world_size: server workers + 1 (``client.get_world_size() + 1``).
        rank: this trainer process's rank in its own job; only rank 0 talks to the server and
            sends (FSDP: the others only take part in ``full_tensor()`` gathers).
        packed / packed_buffer_size_bytes / packed_num_buffers: bucket layout (bytes).
        timeout_s: seconds for the rendezvous, every collective wait and every HTTP call.
        checksums: compute and announce per-bucket checksums (costs one extra pass over the
            tensors).
    """

    master_address: str = "127.0.0.1"
    master_port: int = 0
    world_size: int = 2
    rank: int = 0
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    timeout_s: float = DEFAULT_TIMEOUT_S
    checksums: bool = True

    backend: ClassVar[str] = ""

    def to_server_init_info(self) -> dict:
        """The ``init_info`` JSON the server receives."""
        d = InitInfo(backend=self.backend, master_address=self.master_address, master_port=self.master_port,
                     rank_offset=1, world_size=self.world_size, packed=self.packed,
                     packed_buffer_size_bytes=self.packed_buffer_size_bytes,
                     packed_num_buffers=self.packed_num_buffers, timeout_s=float(self.timeout_s))
        d.validate()
        return d.to_dict()


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """gloo data plane (CPU tensors; GPU tensors are staged through host memory)."""

    backend: ClassVar[str] = "gloo"


@dataclass
class NCCLTrainerInitInfo(TrainerInitInfo):
    """NCCL data plane. ``device``: the trainer's GPU (default: the current device). NCCL
    refuses two ranks on one GPU: use ``IPCTrainerInitInfo`` when sharing the server's GPU."""

    device: str | None = None
    backend: ClassVar[str] = "nccl"


@dataclass
class IPCTrainerInitInfo(TrainerInitInfo):
    """CUDA IPC data plane: trainer and server on one GPU; no process group (``master_*`` and
    ``world_size`` are unused). ``device``: the GPU of the trainer's buffers.

    ``packed`` defaults to ``False`` here (``True`` for gloo / NCCL): the server then copies
    straight out of the trainer's own tensors, whose handles travel once, and a sync of a plain
    module is one ``/sync_weights`` call (Qwen3-8B on one H200: ~15 ms against 0.4-0.8 s packed,
    BENCHMARKS.md). ``packed=True`` copies every tensor into a bucket first and maps a fresh
    handle per bucket."""

    device: str | None = None
    packed: bool = False
    backend: ClassVar[str] = "ipc"

    def to_server_init_info(self) -> dict:
        d = InitInfo(backend="ipc", master_address=self.master_address, master_port=0, rank_offset=1,
                     world_size=max(2, self.world_size), packed=self.packed,
                     packed_buffer_size_bytes=self.packed_buffer_size_bytes,
                     packed_num_buffers=self.packed_num_buffers, timeout_s=float(self.timeout_s))
        d.validate()
        return d.to_dict()


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# ============================================================================ engines
class TrainerWeightTransferEngine:
    """What :meth:`WeightTransferTrainerFactory.trainer_init` returns.

    Attributes:
        init_info: the trainer init info.
        client: the HTTP client (``None`` on ranks != 0).
        source: the weight source.
        last_stats: ``{"bytes", "buckets", "seconds", "gbps", "phases_s", ...}`` of the last
            ``send_weights``; ``phases_s`` (seconds): ``metadata``, ``checksum_pass`` (gloo / NCCL:
            the per-tensor checksums before the data), ``start_call``, ``send`` (data + the
            ``update_weights`` call(s)), ``finish_call``.
    """

    def __init__(self, init_info: TrainerInitInfo, client: HTTPWeightSyncClient | None, source):
        self.init_info = init_info
        self.client = client
        self.source = source
        self.last_stats: dict = {}
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlserve-weight-sync-http")
        self._closed = False

    # subclasses
    def _connect(self) -> None:
        raise NotImplementedError

    def _send(self, info: UpdateInfo, declared: dict) -> dict:
        raise NotImplementedError

    def _teardown(self) -> None:
        pass

    def _send_one_call(self, partial: bool, weight_version: str | None) -> tuple[dict, dict] | None:
        """Subclasses that can push the whole update in one ``/sync_weights`` call do it here and
        return ``(stats, finish answer)``; ``None``: use start / update / finish."""
        return None

    @property
    def is_sender(self) -> bool:
        return self.init_info.rank == 0

    # public
    def reinit(self) -> None:
        """Tear down and redo the init handshake (server + own group)."""
        self._teardown()
        if self.is_sender:
            self._connect()

    def _metadata_info(self, partial: bool) -> UpdateInfo:
        meta = self.source.metadata()
        info = UpdateInfo(
            names=[m[0] for m in meta], dtype_names=[dtype_to_name(m[1]) for m in meta],
            shapes=[list(m[2]) for m in meta], packed=self.init_info.packed,
            packed_buffer_size_bytes=self.init_info.packed_buffer_size_bytes,
            packed_num_buffers=self.init_info.packed_num_buffers, partial=partial)
        info.validate()
        return info

    def _source_is_persistent(self) -> bool:
        """Whether the source yields tensors that exist anyway (a plain module's parameters with
        no dtype cast, a TensorListSource's tensors): listing them all at once costs no memory.
        FSDP (DTensor) parameters and casts create a tensor per item: those are streamed."""
        if isinstance(self.source, TensorListSource):
            return True
        mod = getattr(self.source, "module", None)
        if mod is None or getattr(self.source, "dtype", None) is not None:
            return False
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # pragma: no cover
            return True
        return not any(isinstance(p, DTensor) for p in mod.parameters())

    def _checksums_after_data(self, info: UpdateInfo) -> bool:
        """gloo / NCCL packed with checksums: each bucket's checksum is taken from the packed buffer
        and sent after the data (``update_info.checksums_after_data``), with no pass over the
        tensors before the update. SmolLM2-135M in fp32 on the H200 host's 16 cores: that pass
        took 15-75 ms before any byte moved."""
        return bool(self.init_info.checksums and self.init_info.backend != "ipc" and info.packed)

    def _checksum_pass(self, info: UpdateInfo) -> list[int] | None:
        if not self.init_info.checksums or self.init_info.backend == "ipc" or info.checksums_after_data:
            return None  # ipc: checksummed per packed bucket, right before its call
        tensors = (t for _n, t in self.source.named_tensors())
        if self._source_is_persistent():
            tensors = list(tensors)  # the module's own tensors: one Triton launch on a GPU
        per_tensor = tensor_checksums(tensors)
        if not self.is_sender:
            return None
        if not info.packed:
            return per_tensor
        plan = plan_buckets(info.names, info.dtypes(), info.shapes, info.packed_buffer_size_bytes)
        return bucket_checksums_from_tensors(plan, per_tensor)

    def send_weights(self, weight_version: str | None = None, partial: bool = False) -> dict:
        """Push the source's current weights: start → update (+ data) → finish.

        Args:
            weight_version: version label to commit; ``None``: the server increments its own.
            partial: the source holds only some parameters (e.g. ``ModuleSource(include=...)``).
        Returns:
            The server's ``finish_weight_update`` answer (``{"weight_version": ...}``) on rank 0,
            ``{}`` on other ranks. Timing in :attr:`last_stats`.
        Raises:
            WeightSyncHTTPError (server refused; 400 = bad metadata, nothing changed),
            WeightTransferFailedError / TransferTimeoutError (the transfer broke; the group was
            torn down and the next call re-initialises).
        """
        if self._closed:
            raise WeightUpdateStateError("this trainer engine was shut down")
        t0 = time.perf_counter()
        if not self.is_sender:
            # follow rank 0's collectives (FSDP full_tensor gathers) in the same order
            info = self._metadata_info(partial)
            info.checksums_after_data = self._checksums_after_data(info)
            self._checksum_pass(info)
            for _ in self.source.named_tensors():
                pass
            return {}
        if getattr(self, "_broken", False):
            self.reinit()
        one = self._guarded(self._send_one_call, partial, weight_version)
        if one is not None:
            stats, fin = one
            return self._done(stats, fin, t0, {})
        info = self._metadata_info(partial)
        info.checksums_after_data = self._checksums_after_data(info)
        t_meta = time.perf_counter()
        info.checksums = self._checksum_pass(info)
        declared = info.to_dict()
        t_ck = time.perf_counter()
        try:
            self.client.start_weight_update(declared)
        except WeightSyncConflictError as e:
            if e.code != "no_transfer_engine":
                raise
            # the server dropped its transfer engine (shut down, idle watchdog, restart): nothing
            # of this update has moved yet, so join again and start once more
            logger.warning("%s: re-initialising the transfer engine", e)
            self.reinit()
            self.client.start_weight_update(declared)
        t_start = time.perf_counter()
        stats = self._guarded(self._send, info, declared)
        t_send = time.perf_counter()
        fin = self.client.finish_weight_update(weight_version)
        return self._done(stats, fin, t0, {"metadata": t_meta - t0, "checksum_pass": t_ck - t_meta,
                                           "start_call": t_start - t_ck, "send": t_send - t_start,
                                           "finish_call": time.perf_counter() - t_send})

    def _guarded(self, fn, *args):
        """``fn(*args)``; if it raises, the transfer is broken: tear down (the next
        ``send_weights`` re-initialises) and re-raise."""
        try:
            return fn(*args)
        except BaseException:
            self._broken = True
            self._teardown()
            raise

    def _done(self, stats: dict, fin: dict, t0: float, phases: dict) -> dict:
        """Complete :attr:`last_stats` (totals, version, GB/s, ``phases_s``); returns ``fin``."""
        stats.update(total_seconds=time.perf_counter() - t0, weight_version=fin.get("weight_version"))
        stats["phases_s"] = {**stats.get("phases_s", {}), **phases}
        if stats.get("bytes") and stats.get("seconds"):
            stats["gbps"] = stats["bytes"] / stats["seconds"] / 1e9
        self.last_stats = stats
        return fin

    def shutdown(self) -> None:
        """Leave the transfer group (server and trainer sides). Never raises for a dead server."""
        if self._closed:
            return
        self._closed = True
        if self.is_sender and self.client is not None:
            try:
                self.client.shutdown_weight_transfer_engine()
            except Exception as e:
                logger.warning("shutdown_weight_transfer_engine: %s", e)
        self._teardown()
        self._pool.shutdown(wait=False, cancel_futures=True)


#: Seconds a trainer whose broadcast failed waits for the server's answer to ``update_weights``
#: (its error says why, e.g. a refused update; gloo's only says the connection closed).
_SERVER_ANSWER_WAIT_S = 30.0


def _raise_if_failed(fut: cf.Future) -> Callable[[], None]:
    """A ``check`` for :meth:`TransferGroup.wait`: raise the HTTP call's error as soon as it
    failed (a server that refused the update never joins the broadcast)."""
    def check() -> None:
        if fut.done() and fut.exception() is not None:
            raise fut.exception()
    return check


class GroupTrainerEngine(TrainerWeightTransferEngine):
    """gloo / NCCL: the trainer is rank 0 of a process group with every server worker."""

    def __init__(self, init_info, client, source):
        super().__init__(init_info, client, source)
        self.group: TransferGroup | None = None
        self._buffers = BucketBuffers()  # packed send buffers, kept across syncs
        self._broken = False
        self._port_busy = False
        if init_info.backend == "nccl":
            dev = getattr(init_info, "device", None)
            self.device = torch.device(dev) if dev else torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        if self.is_sender:
            self._connect()

    def _connect(self) -> None:
        ii = self.init_info
        if not ii.master_port or self._port_busy:
            if self._port_busy:
                logger.warning("the previous transfer group may still hold port %s (a broken transfer: an "
                               "operation can stay pending until its timeout); re-initialising on a fresh port",
                               ii.master_port)
            ii.master_port = _free_port()
            self._port_busy = False
        server_init = ii.to_server_init_info()
        server_init["session"] = uuid.uuid4().hex
        self.client.session = None  # the init itself, and a failed one, carry no session
        http = self._pool.submit(self.client.init_weight_transfer_engine, server_init, ii.timeout_s + 30)
        # a daemon thread, not a pool: when the server refuses (e.g. 404, no transfer config) the
        # rendezvous waits for ranks that never come, and a pool thread would hold the
        # interpreter's exit for up to timeout_s
        grp = _run_in_daemon_thread("rlserve-transfer-rendezvous", TransferGroup.create, ii.backend,
                                    ii.master_address, ii.master_port, 0, ii.world_size, ii.timeout_s,
                                    self.device, session=server_init["session"])
        try:
            done, _ = cf.wait([http, grp], timeout=ii.timeout_s + 60, return_when=cf.FIRST_EXCEPTION)
            if http.done() and http.exception() is not None:
                raise http.exception()
            if grp.done() and grp.exception() is not None:
                # the server's answer usually says more
                try:
                    http.result(timeout=min(10.0, ii.timeout_s))
                except Exception as e:
                    raise e from grp.exception()
                raise grp.exception()
            self.group = grp.result(timeout=ii.timeout_s + 60)
            http.result(timeout=ii.timeout_s + 60)
            self.client.session = server_init["session"]
        except BaseException:
            def _cleanup(f=grp):
                try:
                    f.result().destroy()
                except BaseException:
                    pass
            threading.Thread(target=_cleanup, daemon=True).start()
            self.group = None
            raise
        self._broken = False

    def _teardown(self) -> None:
        self._buffers.release()
        if self.group is not None:
            self.group.destroy(wait_s=5.0)  # free the store's port for a re-init
            # after a broken transfer the old store can outlive the teardown (a pending gloo
            # operation, or an exception's traceback, still holds the process group): never
            # rebind its port
            self._port_busy = self._broken or not self.group.torn_down
        self.group = None

    def _send(self, info: UpdateInfo, declared: dict) -> dict:
        if self.group is None:
            raise TransferAbortedError("not connected: call reinit()")
        ii = self.init_info
        n_buckets = len(plan_buckets(info.names, info.dtypes(), info.shapes, info.packed_buffer_size_bytes)) \
            if info.packed else len(info.names)
        http = self._pool.submit(self.client.update_weights, declared, ii.timeout_s * (n_buckets + 2))
        check = _raise_if_failed(http)
        fn = send_packed if info.packed else send_unpacked
        try:
            kw = {"buffers": self._buffers} if info.packed else {}
            stats = fn(self.group, info, self.source.named_tensors(), self.device, check=check, **kw)
        except Exception as e:
            # Prefer the server's explanation: a server that refuses the update (e.g. a layout
            # mismatch, 400) tears the group down before it answers, so the broadcast often
            # fails first ("Connection closed by peer"); its answer follows within moments. (An
            # error of this side -- a source yielding other tensors, a timeout -- is raised at once.)
            closed = isinstance(e, WeightTransferFailedError) and \
                not isinstance(e, (TransferTimeoutError, TransferAbortedError))
            try:
                http.result(timeout=min(ii.timeout_s, _SERVER_ANSWER_WAIT_S) if closed else 0)
            except Exception as he:  # noqa: BLE001 - the server's error wins
                if he is not e and not isinstance(he, cf.TimeoutError):
                    raise he from e
            raise
        ans = http.result(timeout=ii.timeout_s * (n_buckets + 2))
        stats["server"] = ans
        return stats


def _liveness_store(host: str, timeout_s: float):
    """A ``TCPStore`` this process hosts on a free port (``.port``) for the server's liveness
    watch of an ipc trainer (no process group there): its connection closes when this process
    dies, which the server notices within about a second (:mod:`rlserve.transfer.liveness`)."""
    import torch.distributed as dist
    from datetime import timedelta

    return dist.TCPStore(host, 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)


def _run_in_daemon_thread(name: str, fn, *args, **kwargs) -> cf.Future:
    """``fn(*args, **kwargs)`` on a daemon thread; its result or exception in the returned future."""
    fut: cf.Future = cf.Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            fut.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


class IPCTrainerEngine(TrainerWeightTransferEngine):
    """CUDA IPC: trainer and server share a GPU; no process group.

    The update is cut by the bucket plan (calls are sequential: the server answers once it has
    read the memory):

    - packed (default): one ``update_weights`` call per bucket; the bucket is packed into one of
      ``packed_num_buffers`` CUDA buffers and the call carries that buffer's IPC handle; packing
      bucket ``i+1`` overlaps the server's copy of bucket ``i``. Trainer memory: the buffers. GPU
      traffic: the trainer's pack copy plus the server's load copy.
    - unpacked: one handle per tensor; the server reads the trainer's tensors in place: one copy
      in all (the server's). The module's own parameters (exported once per session) travel in
      a single call for the whole update, which the server loads by replaying a recorded copy
      plan (:mod:`rlserve.transfer.copy_plan`); tensors the source creates (dtype casts, FSDP
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
        # the server watches this process through the store's connection (rlserve.transfer.liveness)
        server_init["master_port"] = self._liveness_store.port
        self.client.init_weight_transfer_engine(server_init, self.init_info.timeout_s)
        self._exported: dict[tuple, tuple[torch.Tensor, dict]] = {}
        self._batch_ref: tuple[tuple, str] | None = None  # (batch key, ipc_handles_ref the server holds)
        self._fast: dict | None = None  # the one-call path's registration (see _send_one_call)

    def _teardown(self) -> None:
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
        from rlserve.transfer.ipc import export_handle

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
                                          device_checksums=fast["sums"] is not None))
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
                    device_checksums=fast["sums"] is not None)
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
        from rlserve.transfer.ipc import export_handle

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
        from rlserve.transfer.ipc import export_handle
        from rlserve.transfer.packing import pack
        from rlserve.transfer.sender import take_bucket_tensors

        t0 = time.perf_counter()
        ii = self.init_info
        dtypes = info.dtypes()
        plan = plan_buckets(info.names, dtypes, info.shapes, info.packed_buffer_size_bytes)
        nbuf = max(1, min(info.packed_num_buffers, len(plan)))
        bufs = []
        if info.packed and plan:
            # fresh buffers per sync: torch's IPC bookkeeping on a shared block is freed with it
            size = max_bucket_bytes(plan)
            bufs = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(nbuf)]
        futs: dict[int, tuple[cf.Future, list]] = {}
        it = iter(self.source.named_tensors())
        total = 0
        persistent = self._persistent_storages() if not info.packed else set()
        batch: list[tuple] = []  # (slot, tensor) of persistent tensors: one call at the end
        phases: dict[str, float] = {}

        def submit(key: int, slots, handles, checksums, keep) -> None:
            sub = UpdateInfo(
                names=[s.name for s in slots], dtype_names=[dtype_to_name(s.dtype) for s in slots],
                shapes=[list(s.shape) for s in slots], packed=info.packed,
                packed_buffer_size_bytes=info.packed_buffer_size_bytes, packed_num_buffers=nbuf,
                checksums=checksums, partial=True, ipc_handles=handles)
            futs[key] = (self._pool.submit(self.client.update_weights, sub.to_dict(), ii.timeout_s), keep)

        answers: dict[int, dict] = {}

        def wait(bi: int) -> None:
            fut, _keep = futs.pop(bi)
            answers[bi] = fut.result(timeout=ii.timeout_s + 30)

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
                    pack(buf, b, take_bucket_tensors(it, b))
                    checksums = [checksum(buf[: b.nbytes])] if ii.checksums else None
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
        finally:
            for f, _keep in futs.values():  # never free memory the server may still read
                try:
                    f.result(timeout=ii.timeout_s + 30)
                except BaseException:
                    pass
        return {"bytes": total, "buckets": len(plan), "seconds": time.perf_counter() - t0, "ipc_phases_s": phases,
                "server": answers[max(answers)] if answers else {}}


class FollowerTrainerEngine(TrainerWeightTransferEngine):
    """Ranks != 0 of a sharded trainer: iterate the source (collectives) and send nothing."""


class WeightTransferTrainerFactory:
    """Entry point, named as in vLLM."""

    @staticmethod
    def trainer_init(init_info: TrainerInitInfo, client: HTTPWeightSyncClient | None = None,
                     source=None) -> TrainerWeightTransferEngine:
        """Initialise the server's transfer engine and this trainer's end, together.

        gloo / NCCL: ``POST /init_weight_transfer_engine`` runs on a background thread while this
        thread hosts the TCPStore and joins the group: both ends rendezvous together; returns
        once both succeeded (at most ``timeout_s``). ipc: the HTTP call only.

        Args:
            init_info: :class:`GlooTrainerInitInfo`, :class:`NCCLTrainerInitInfo` or
                :class:`IPCTrainerInitInfo`.
            client: the server's :class:`HTTPWeightSyncClient` (required on rank 0).
            source: :class:`ModuleSource` (or anything with ``metadata()`` and
                ``named_tensors()``).
        Raises:
            WeightSyncHTTPError: the server refused the init_info.
            TransferTimeoutError / WeightTransferFailedError: the rendezvous failed.
        """
        if source is None:
            raise ValueError("trainer_init needs a source (e.g. ModuleSource(model))")
        if init_info.rank != 0:
            return FollowerTrainerEngine(init_info, None, source)
        if client is None:
            raise ValueError("trainer_init needs a client on rank 0")
        if init_info.backend in ("gloo", "nccl"):
            return GroupTrainerEngine(init_info, client, source)
        if init_info.backend == "ipc":
            return IPCTrainerEngine(init_info, client, source)
        raise ValueError(f"unknown backend {init_info.backend!r}")
