"""Wire protocol of the weight-sync control plane: JSON-only data classes.

Everything that crosses the HTTP control plane is plain JSON (str, int, float, bool, list,
dict). Nothing is ever pickled. Tensors travel on the data plane (gloo / NCCL broadcast, or
CUDA IPC handles whose arguments are themselves JSON, see :mod:`rlserve.transfer.wire.ipc`).

``init_info`` (body of ``POST /init_weight_transfer_engine``)::

    {"backend": "gloo" | "nccl" | "ipc",
     "master_address": "10.0.0.1",       # host of the TCPStore (rank 0 hosts it)
     "master_port": 29555,               # ipc: optional, a store the trainer hosts for liveness only
     "rank_offset": 1,                   # >= 1: trainer is rank 0 (vLLM; > 1: several servers); 0: last rank (TRL)
     "world_size": 2,                    # every server's workers + 1 trainer rank
     "packed": true,                     # default for updates (update_info may override)
     "packed_buffer_size_bytes": 1073741824,
     "packed_num_buffers": 2,
     "timeout_s": 300.0,                 # store, group, every collective and RPC (1 s .. a year)
     "session": "5f0c...",               # optional: names this group incarnation
     "shared_group": false}              # true: other servers share the group (rank_offset > 1 implies it)

``update_info`` (body of ``POST /update_weights``)::

    {"names": ["model.embed_tokens.weight", ...],        # Hugging Face checkpoint names
     "dtype_names": ["bfloat16", ...],                   # "bfloat16" or "torch.bfloat16"
     "shapes": [[49152, 576], ...],
     "packed": true, "packed_buffer_size_bytes": ..., "packed_num_buffers": ...,   # optional
     "checksums": [123456789, ...],      # one per bucket (packed) or per tensor (unpacked); optional
     "checksum_algo": "s64sum",
     "checksums_after_data": false,      # gloo / NCCL packed: the checksums follow the last bucket
     "partial": false,                   # true: a subset of the parameters is fine
     "ipc_handles": [{...}, ...],        # ipc backend only: one handle per bucket (or tensor)
     "ipc_handles_ref": "a1b2...",       # ipc, unpacked: name of this handle list (reuse it later)
     "lora": {"lora_name": ..., "r": 16, "lora_alpha": 32}}  # adapter-only update (rlserve.lora.sync)

Validation raises :class:`rlserve.errors.WeightUpdateError` (HTTP 400) naming the field.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from rlserve.errors import WeightUpdateError
from rlserve.loader.weight_utils import expand_expert_names

BACKENDS = ("gloo", "nccl", "ipc")
#: The largest int a size or shape field may hold: int64's, what torch shapes and the engine-core
#: wire carry (MessagePack stops at 2**64 - 1; a larger one failed there with a 500 OverflowError).
WIRE_INT_MAX = (1 << 63) - 1
_REF_RE = re.compile(r"[A-Za-z0-9_.\-]+")

#: Default bucket size in bytes (1 GiB), vLLM's default.
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1 << 30
#: Buffers in flight round-robin (bucket i+1 travels while bucket i is loaded).
DEFAULT_PACKED_NUM_BUFFERS = 2
#: Seconds any rendezvous / collective / RPC may take by default.
DEFAULT_TIMEOUT_S = 300.0
#: Smallest ``timeout_s`` accepted (seconds). It bounds the rendezvous (TCPStore connect plus the
#: backend's own connect: ~0.1-1 s for gloo on a loaded CPU host, seconds for NCCL) and the wait
#: for every bucket; below a second a healthy update ends in a timeout (``1e-9`` gave a 504). A
#: dead trainer is noticed without it (:mod:`rlserve.transfer.server.liveness`).
MIN_TIMEOUT_S = 1.0
#: Largest ``timeout_s`` accepted (seconds; one year): larger values overflow the store's and the
#: backends' timeouts.
MAX_TIMEOUT_S = 365 * 86400.0

#: Floating dtypes a weight update may carry (the server converts to its own dtype; fp8 as vLLM
#: names them, ``getattr(torch, name)``).
FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
#: All dtypes the wire knows (checksums and byte views work for every one of them).
WIRE_DTYPES: dict[str, torch.dtype] = {
    **FLOAT_DTYPES,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_ALIASES = {"float": "float32", "half": "float16", "double": "float64", "bf16": "bfloat16",
            "fp16": "float16", "fp32": "float32", "long": "int64", "int": "int32"}


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` / ``"torch.bfloat16"`` / ``"bf16"`` → ``torch.bfloat16``.

    Raises:
        WeightUpdateError: unknown name.
    """
    if not isinstance(name, str):
        raise WeightUpdateError(f"dtype name must be a string, got {type(name).__name__}")
    key = name.strip().removeprefix("torch.")
    key = _ALIASES.get(key, key)
    if key not in WIRE_DTYPES:
        raise WeightUpdateError(f"unknown dtype {name!r}; known: {', '.join(WIRE_DTYPES)}")
    return WIRE_DTYPES[key]


def dtype_to_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"`` (the canonical wire name)."""
    return str(dtype).removeprefix("torch.")


def _check_int(name: str, v: Any, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise WeightUpdateError(f"{name} must be an integer, got {v!r}", param=name)
    if lo is not None and v < lo:
        raise WeightUpdateError(f"{name} must be >= {lo}, got {v}", param=name)
    if hi is not None and v > hi:
        raise WeightUpdateError(f"{name} must be <= {hi}, got {v}", param=name)
    return v


def check_group_size(world_size: Any, num_workers: int, rank_offset: int = 0, shared_group: bool = False,
                     field: str = "init_info.world_size") -> None:
    """The transfer group's size fits this server, for every route that opens a group
    (``/init_weight_transfer_engine``, TRL's ``/init_communicator/``): ``world_size`` is this
    server's ``num_workers`` + 1 trainer rank; when other servers share the group
    (``shared_group``, or ``rank_offset`` above 1) it may be larger, but must hold this server's
    ranks (``rank_offset + num_workers <= world_size``). A wrong size is refused here, not left to
    a rendezvous that waits for ranks that never come.

    Args:
        field: how the request names the world size (in the message).

    Raises:
        WeightUpdateError (400): naming ``field`` and the size expected.
    """
    n = int(num_workers)
    if shared_group or rank_offset > 1:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or rank_offset + n > world_size:
            raise WeightUpdateError(f"init_info.rank_offset {rank_offset} + this server's {n} worker(s) exceeds "
                                    f"{field} {world_size}", param=field)
    elif isinstance(world_size, bool) or world_size != n + 1:
        raise WeightUpdateError(f"{field} must be {n + 1} (this server's {n} worker(s) + 1 trainer), got {world_size!r}",
                                param=field)


def _check_bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise WeightUpdateError(f"{name} must be true or false, got {v!r}", param=name)
    return v


def _from_dict(cls, d: Any, what: str, ignored: tuple[str, ...] = ()):
    if not isinstance(d, dict):
        raise WeightUpdateError(f"{what} must be a JSON object, got {type(d).__name__}", param=what)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - known - set(ignored))
    if unknown:
        raise WeightUpdateError(f"{what}: unknown field(s) {unknown}; known: {sorted(known)}",
                                param=f"{what}.{unknown[0]}")
    obj = cls(**{k: v for k, v in d.items() if k in known})
    obj.validate()
    return obj


@dataclass
class InitInfo:
    """Parameters of the transfer group (``init_info``), shared by trainer and server.

    Attributes:
        backend: ``"gloo"`` (CPU tensors), ``"nccl"`` (GPUs, one rank per GPU) or ``"ipc"``
            (trainer and server on one GPU; no process group at all).
        master_address / master_port: the TCPStore; the group's rank 0 hosts it (the trainer
            when ``rank_offset == 1``, server worker 0 when ``rank_offset == 0``, TRL's layout).
        rank_offset: rank of server worker 0. 1 (vLLM): trainer rank 0, worker ranks
            ``1 + dp_index*TP + tp_rank``. Above 1: this server shares the group with others
            (trainer rank 0, the servers one after another: :mod:`rlserve.transfer.sdk.fanout`).
            0 (TRL): workers ``dp_index*TP + tp_rank``, trainer ``world_size - 1``.
        world_size: every server's workers + 1 (a single trainer rank sends; FSDP trainers send
            from their rank 0 only).
        packed / packed_buffer_size_bytes / packed_num_buffers: defaults for updates.
        timeout_s: seconds for the store, the group, each collective wait and each RPC.
        session: optional name of this group incarnation (the SDK sends a random one); the store
            keys live under it, so a re-init never meets a previous group's keys.
        wire: ``"rlserve"`` (the SDK's: layout header, aligned buckets, checksums) or ``"vllm"``
            (NCCL only: vLLM's ``StatelessProcessGroup`` rendezvous and raw buckets, what an
            unmodified vLLM / TRL trainer speaks; :mod:`rlserve.transfer.backends.vllm_group`). The server
            picks ``"vllm"`` for an NCCL ``init_info`` that names no ``backend`` (vLLM's trainer
            never does; the SDK always does) and for TRL's legacy ``/init_communicator/``.
        nccl_unique_id_b64: vLLM's torch-free rendezvous (``wire == "vllm"``): the base64 of the
            128-byte NCCL unique id, instead of ``master_address`` / ``master_port``.
        shared_group: (rlserve extension) other servers share this group, so ``world_size`` may
            exceed this server's workers + 1 (``rank_offset + workers <= world_size``); the
            multi-server SDK sets it. Without it a single server keeps the strict check
            (``world_size == workers + 1``), which catches a wrong world size with a 400 instead
            of a rendezvous that waits for ranks that never come.
    """

    backend: str = "gloo"
    master_address: str = "127.0.0.1"
    master_port: int = 0
    rank_offset: int = 1
    world_size: int = 2
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    timeout_s: float = DEFAULT_TIMEOUT_S
    session: str = ""
    wire: str = "rlserve"
    nccl_unique_id_b64: str | None = None
    shared_group: bool = False

    @classmethod
    def from_dict(cls, d: Any) -> "InitInfo":
        """Parse and validate JSON. Raises WeightUpdateError."""
        return _from_dict(cls, d, "init_info")

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def src_rank(self) -> int:
        """The trainer's (sending) rank: 0 when ``rank_offset >= 1`` (the SDK's and vLLM's layout;
        above 1 when several servers share the group), ``world_size - 1`` when 0 (TRL's)."""
        return 0 if self.rank_offset >= 1 else self.world_size - 1

    def validate(self) -> None:
        if self.backend not in BACKENDS:
            raise WeightUpdateError(f"init_info.backend must be one of {BACKENDS}, got {self.backend!r}", param="init_info.backend")
        if not isinstance(self.master_address, str) or not self.master_address:
            raise WeightUpdateError("init_info.master_address must be a non-empty string", param="init_info.master_address")
        _check_int("init_info.master_port", self.master_port, 0, 65535)
        if self.wire not in ("rlserve", "vllm"):
            raise WeightUpdateError(f"init_info.wire must be 'rlserve' or 'vllm', got {self.wire!r}", param="init_info.wire")
        if self.wire == "vllm" and self.backend != "nccl":
            raise WeightUpdateError(f"init_info.wire 'vllm' is vLLM's NCCL wire; the backend is {self.backend!r}", param="init_info.wire")
        if self.nccl_unique_id_b64 is not None:
            from rlserve.transfer.backends.vllm_group import decode_unique_id_b64

            if self.wire != "vllm":
                raise WeightUpdateError("init_info.nccl_unique_id_b64 belongs to vLLM's NCCL wire (wire 'vllm')", param="init_info.nccl_unique_id_b64")
            decode_unique_id_b64(self.nccl_unique_id_b64)
        elif self.backend != "ipc" and self.master_port == 0:
            raise WeightUpdateError("init_info.master_port must be set (1..65535) for gloo/nccl", param="init_info.master_port")
        _check_int("init_info.world_size", self.world_size, 2)
        _check_int("init_info.rank_offset", self.rank_offset, 0, self.world_size - 1)
        _check_bool("init_info.shared_group", self.shared_group)
        if self.shared_group and self.rank_offset == 0:
            raise WeightUpdateError("init_info.shared_group needs the trainer on rank 0 (rank_offset >= 1)", param="init_info.shared_group")
        _check_bool("init_info.packed", self.packed)
        _check_int("init_info.packed_buffer_size_bytes", self.packed_buffer_size_bytes, 1, WIRE_INT_MAX)
        _check_int("init_info.packed_num_buffers", self.packed_num_buffers, 1, 64)
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) \
                or not math.isfinite(self.timeout_s) or not MIN_TIMEOUT_S <= self.timeout_s <= MAX_TIMEOUT_S:
            raise WeightUpdateError(
                f"init_info.timeout_s must be a number of seconds from {MIN_TIMEOUT_S:g} (it bounds the rendezvous and "
                f"every bucket's wait: less times out a healthy update) to {MAX_TIMEOUT_S:.0f} (a year), "
                f"got {self.timeout_s!r}", param="init_info.timeout_s")
        self.timeout_s = float(self.timeout_s)
        if not isinstance(self.session, str) or len(self.session) > 128:
            raise WeightUpdateError("init_info.session must be a string of at most 128 characters", param="init_info.session")

    def worker_rank(self, dp_index: int, tp_rank: int, tp_size: int) -> int:
        """Rank of a server worker in the transfer group: ``rank_offset + dp_index*TP + tp_rank``."""
        return self.rank_offset + dp_index * tp_size + tp_rank


@dataclass
class UpdateInfo:
    """One weight update (``update_info``): what travels, in order.

    Attributes:
        names: Hugging Face checkpoint names, in the order the trainer sends them.
        dtype_names: dtype of each tensor on the wire (float types only for weights).
        shapes: full (unsharded) shape of each tensor.
        packed / packed_buffer_size_bytes / packed_num_buffers: ``None`` takes the
            ``init_info`` value. Both sides derive the bucket plan from these alone.
        checksums: int64 checksums (:func:`rlserve.transfer.wire.packing.checksum`), one per
            bucket when packed, one per tensor when not; ``None``: not verified.
        checksum_algo: only ``"s64sum"``.
        checksums_after_data: gloo / NCCL, packed (rlserve extension): ``checksums`` stays
            ``None``; after its last bucket the trainer broadcasts one int64 tensor ``[n_buckets]``
            (on the wire device) holding every bucket's checksum, which it took from the packed
            buffer as it went (no separate pass over its tensors before the update). The server
            checks every bucket against it at the end: staged, a mismatch is never committed; in
            place, the buckets were already loaded, so the update fails like a broken one (HTTP 503
            until a full update lands) instead of loading nothing.
        partial: ``True`` allows a subset of the model's parameters.
        ipc_handles: ``ipc`` backend: one JSON handle (:func:`rlserve.transfer.wire.ipc.export_handle`)
            per bucket (packed) or tensor (unpacked) of this call.
        ipc_handles_ref: ``ipc`` backend, unpacked (rlserve extension): a name the trainer gives
            this call's handle list. Sent *with* ``ipc_handles``, the server keeps the mapped
            tensors under it; sent *without*, the server reuses them (a trainer whose parameters
            did not move sends no handles: for an 8B model 399 handles are ~290 KB of JSON and
            ~8 ms per sync). An unknown ref is refused with 400 and the SDK resends the handles.
            At most 1..128 characters of ``[A-Za-z0-9_.-]``. A call with the ref, no handles and
            **no names** means "the same tensors as when the ref was given": names, dtypes and
            shapes come from the server's record of it (already validated then).
        ipc_checksums_handle: with ``ipc_handles`` + ref: the handle of an int64 ``[n]`` tensor in
            which the trainer writes the ``s64sum`` of each tensor before every call under the ref.
        ipc_event_handle: with ``ipc_handles`` + ref: base64 of an interprocess CUDA event the
            trainer records after its writes (and checksums) before every call; the server's
            stream waits on it, so the trainer never waits for its own GPU work before calling.
        device_checksums: compare against the ref's checksum tensor (read on the GPU after the
            event) instead of ``checksums``.
        lora: an adapter-only update (rlserve extension): ``{"lora_name", "r", "lora_alpha",
            "use_rslora", "load_inplace", "version"}``; the tensors are the adapter's
            ``<module>.lora_A.weight`` / ``.lora_B.weight`` factors (:mod:`rlserve.lora.sync`).
    """

    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    packed: bool | None = None
    packed_buffer_size_bytes: int | None = None
    packed_num_buffers: int | None = None
    checksums: list[int] | None = None
    checksum_algo: str = "s64sum"
    checksums_after_data: bool = False
    partial: bool = False
    ipc_handles: list[dict] | None = None
    ipc_handles_ref: str | None = None
    ipc_checksums_handle: dict | None = None
    ipc_event_handle: str | None = None
    device_checksums: bool = False
    lora: dict | None = None

    # vLLM sends these; accepted and checked / ignored.
    _IGNORED = ("is_checkpoint_format", "trainer_args")

    @classmethod
    def from_dict(cls, d: Any) -> "UpdateInfo":
        """Parse and validate JSON. Raises WeightUpdateError."""
        if isinstance(d, dict) and d.get("is_checkpoint_format", True) is not True:
            raise WeightUpdateError("update_info.is_checkpoint_format=false is not supported: "
                                    "send Hugging Face checkpoint names")
        return _from_dict(cls, d, "update_info", ignored=cls._IGNORED)

    def to_dict(self) -> dict:
        """JSON-able dict without ``None`` fields. Shallow: lists and handle dicts are shared with
        this object, not copied (``dataclasses.asdict`` deep-copies: ~10 ms for 399 ipc handles)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def validate(self) -> None:
        for attr in ("names", "dtype_names", "shapes"):
            if not isinstance(getattr(self, attr), list):
                raise WeightUpdateError(f"update_info.{attr} must be a list")
        n = len(self.names)
        if len(self.dtype_names) != n or len(self.shapes) != n:
            raise WeightUpdateError(
                f"update_info: names ({n}), dtype_names ({len(self.dtype_names)}) and shapes "
                f"({len(self.shapes)}) must have the same length")
        seen = set()
        for i, name in enumerate(self.names):
            if not isinstance(name, str) or not name:
                raise WeightUpdateError(f"update_info.names[{i}] must be a non-empty string")
            if name in seen:
                raise WeightUpdateError(f"update_info.names: {name!r} appears twice")
            seen.add(name)
        for i, s in enumerate(self.shapes):
            if not isinstance(s, (list, tuple)) or \
                    any(isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= WIRE_INT_MAX for x in s):
                raise WeightUpdateError(f"update_info.shapes[{i}] ({self.names[i]}) must be a list of ints from 0 to "
                                        f"{WIRE_INT_MAX}, got {s!r}")
        self.shapes = [list(s) for s in self.shapes]
        for dn in self.dtype_names:
            dtype_from_name(dn)
        if self.packed is not None:
            _check_bool("update_info.packed", self.packed)
        if self.packed_buffer_size_bytes is not None:
            _check_int("update_info.packed_buffer_size_bytes", self.packed_buffer_size_bytes, 1, WIRE_INT_MAX)
        if self.packed_num_buffers is not None:
            _check_int("update_info.packed_num_buffers", self.packed_num_buffers, 1, 64)
        _check_bool("update_info.partial", self.partial)
        if self.checksum_algo != "s64sum":
            raise WeightUpdateError(f"update_info.checksum_algo must be 's64sum', got {self.checksum_algo!r}")
        if self.checksums is not None:
            if not isinstance(self.checksums, list):
                raise WeightUpdateError("update_info.checksums must be a list of ints or null")
            for c in self.checksums:
                _check_int("update_info.checksums[]", c, -(1 << 63), (1 << 63) - 1)
        if self.ipc_handles is not None:
            if not isinstance(self.ipc_handles, list) or not all(isinstance(h, dict) for h in self.ipc_handles):
                raise WeightUpdateError("update_info.ipc_handles must be a list of objects")
        if self.ipc_handles_ref is not None:
            r = self.ipc_handles_ref
            if not isinstance(r, str) or not 1 <= len(r) <= 128 or not _REF_RE.fullmatch(r):
                raise WeightUpdateError("update_info.ipc_handles_ref must be 1-128 characters of [A-Za-z0-9_.-]")
        _check_bool("update_info.device_checksums", self.device_checksums)
        _check_bool("update_info.checksums_after_data", self.checksums_after_data)
        if self.checksums_after_data and (self.checksums is not None or self.packed is False):
            raise WeightUpdateError("update_info.checksums_after_data is for packed updates and comes without a "
                                    "checksums list")
        if (self.ipc_checksums_handle is not None or self.ipc_event_handle is not None) and \
                (self.ipc_handles is None or self.ipc_handles_ref is None):
            raise WeightUpdateError("update_info.ipc_checksums_handle / ipc_event_handle come with ipc_handles "
                                    "and an ipc_handles_ref")
        if self.ipc_checksums_handle is not None and not isinstance(self.ipc_checksums_handle, dict):
            raise WeightUpdateError("update_info.ipc_checksums_handle must be an object")
        if self.ipc_event_handle is not None and not isinstance(self.ipc_event_handle, str):
            raise WeightUpdateError("update_info.ipc_event_handle must be a base64 string")
        if self.lora is not None and not isinstance(self.lora, dict):
            raise WeightUpdateError("update_info.lora must be an object or null")
        if self.device_checksums and (self.ipc_handles_ref is None or self.checksums is not None):
            raise WeightUpdateError("update_info.device_checksums needs an ipc_handles_ref and no checksums list")

    @property
    def by_ref(self) -> bool:
        """A call naming its tensors only through ``ipc_handles_ref`` (no names, no handles)."""
        return self.ipc_handles_ref is not None and self.ipc_handles is None and not self.names

    def dtypes(self) -> list[torch.dtype]:
        return [dtype_from_name(d) for d in self.dtype_names]

    def resolved(self, init: InitInfo) -> "UpdateInfo":
        """A shallow copy with ``packed*`` fields filled from ``init`` where ``None``."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        if d["packed"] is None:
            d["packed"] = init.packed
        if d["packed_buffer_size_bytes"] is None:
            d["packed_buffer_size_bytes"] = init.packed_buffer_size_bytes
        if d["packed_num_buffers"] is None:
            d["packed_num_buffers"] = init.packed_num_buffers
        return UpdateInfo(**d)


def validate_against_spec(
    info: UpdateInfo,
    spec: dict[str, tuple[int, ...]],
    required: set[str],
    *,
    allowed_names: set[str] | None = None,
    already_received: set[str] | frozenset = frozenset(),
    check_coverage: bool = True,
    tied: dict[str, str] | None = None,
) -> None:
    """Check an update's metadata against the model before any parameter changes.

    Args:
        info: the (validated) update.
        spec: ``model.checkpoint_spec()``: HF name → full shape.
        required: ``model.required_checkpoint_names()``.
        allowed_names: names declared for this update session (``start_weight_update`` with an
            ``update_info``); when given, every name must be among them.
        already_received: names already received in this session (may not repeat).
        check_coverage: require every ``required`` name unless ``info.partial``.
        tied: ``model.tied_checkpoint_names()``: a name the served model does not hold apart
            (``lm_head.weight`` of a model with ``tie_word_embeddings``) → the name it is. An
            update carrying such a name is refused: the model would ignore it and serve the other
            tensor in its place, so a trainer that untied them would silently get other outputs.

    Raises:
        WeightUpdateError: naming the first few offending tensors (unknown name, wrong shape,
            non-float dtype, repeated, missing, tied).
    """
    problems: list[str] = []
    for name, dn, shape in zip(info.names, info.dtype_names, info.shapes):
        if name not in spec:
            problems.append(f"unknown parameter {name!r}")
            continue
        if tied and name in tied:
            problems.append(
                f"{name}: the served model ties {name} to {tied[name]} (tie_word_embeddings) and serves "
                f"{tied[name]} as both, so a separate {name} cannot be served; a trainer that ties them sends "
                f"the shared tensor once, as {tied[name]} (drop {name}); one that untied them needs a server "
                "whose model config has tie_word_embeddings=false")
            continue
        if tuple(shape) != tuple(spec[name]):
            problems.append(f"{name}: shape {list(shape)} != expected {list(spec[name])}")
        dt = dtype_from_name(dn)
        if not dt.is_floating_point or dtype_to_name(dt) not in FLOAT_DTYPES:
            problems.append(f"{name}: dtype {dn!r} is not a float type ({', '.join(FLOAT_DTYPES)})")
        if allowed_names is not None and name not in allowed_names:
            problems.append(f"{name}: not declared in start_weight_update's update_info")
        if name in already_received:
            problems.append(f"{name}: already received in this update")
        if len(problems) >= 8:
            break
    if not problems and check_coverage and not info.partial and allowed_names is None:
        missing = sorted(required - expand_expert_names(info.names, spec))  # MoE: a fused name covers many
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            problems.append(f"missing {len(missing)} required parameter(s): {missing[:5]}{more}; "
                            "send all of them or set update_info.partial=true")
    if problems:
        raise WeightUpdateError("update_info rejected, no weights were changed: " + "; ".join(problems))
