"""vLLM's ``StatelessProcessGroup`` store protocol, spoken with torch's ``TCPStore``.

What vLLM (0.32, ``vllm/distributed/utils.py``) does, and so what rlserve matches:

- **Rendezvous**: rank 0 hosts a ``TCPStore`` built with the group's ``world_size`` that waits
  until ``world_size - 1`` clients registered; a client registers by building its ``TCPStore``
  with the same ``world_size`` and ``wait_for_workers=True`` (it adds 1 to the store's
  ``init/`` counter; a client built without it never counts and rank 0 times out).
- **broadcast_obj(obj, src)**: rank ``src`` stores ``pickle.dumps(obj)`` at
  ``broadcast_from/<src>/<n>``, ``n`` counting that rank's broadcasts from 0; the others read
  the same key with their own counter for ``src``. The NCCL unique id (a pickle of vLLM's ctypes
  ``ncclUniqueId``) is the first one: ``broadcast_from/0/0``.
- **barrier()**: rank 0 broadcasts ``"barrier_<uuid4>"`` (a pickled str) as above; every rank
  sets ``arrival_<id>_<rank>``, waits for all ``world_size`` arrival keys, sets
  ``departure_<id>_<rank>``; rank 0 also waits for every departure key and deletes the keys.
  TRL <= 1.10 runs one after every tensor it broadcasts.

Pickles are read only through :mod:`rlserve.transfer.wire.safe_pickle`: the unique id admits only
``_ctypes._unpickle`` applied to vLLM's ``ncclUniqueId`` class with an empty dict and exactly
128 bytes (:func:`loads_unique_id`); a barrier id admits no global at all. Written pickles are
built here byte by byte (:func:`dumps_unique_id`), so rlserve needs no vLLM to write what vLLM's
``pickle.loads`` turns into its own ``ncclUniqueId``.

Every wait is bounded by ``timeout_s`` and polls the ``abort`` event (at most 0.5 s between
looks).
"""

from __future__ import annotations

import collections
import pickle
import threading
import time
import uuid
from datetime import timedelta

import torch.distributed as dist

from rlserve.transfer.errors import TransferAbortedError, TransferTimeoutError
from rlserve.transfer.wire.store_probe import probe_store
from rlserve.transfer.wire.safe_pickle import refuse, restricted_loads

#: Bytes of an ``ncclUniqueId``.
UNIQUE_ID_BYTES = 128
#: vLLM's ctypes class for the unique id, as its pickle names it.
VLLM_UNIQUE_ID_CLASS = ("vllm.distributed.device_communicators.pynccl_wrapper", "ncclUniqueId")
#: vLLM's ``data_expiration_seconds``: broadcast keys older than this are deleted by their writer.
DATA_EXPIRATION_S = 3600.0
_WHAT_UID = "the NCCL unique id in the rendezvous store (broadcast_from/0/0)"


class _UniqueIdClass:
    """Stands for vLLM's ``ncclUniqueId`` class inside :func:`loads_unique_id`; never built."""

    def __init__(self, *args, **kwargs):
        raise refuse(_WHAT_UID, "the pickle calls ncclUniqueId directly")


class _UniqueId(bytes):
    """The 128 bytes an admitted unique-id pickle carried."""


def _ctypes_unpickle(cls, state):
    """``_ctypes._unpickle(cls, (dict, bytes))`` as a ctypes object's pickle calls it: admitted
    only for the unique id's class, an empty instance dict and 128 raw bytes."""
    if cls is not _UniqueIdClass:
        raise refuse(_WHAT_UID, "_ctypes._unpickle is admitted for vLLM's ncclUniqueId only")
    if not (isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict) and not state[0]
            and isinstance(state[1], bytes)):
        raise refuse(_WHAT_UID, "its state must be ({}, 128 bytes)")
    if len(state[1]) != UNIQUE_ID_BYTES:
        raise refuse(_WHAT_UID, f"it carries {len(state[1])} bytes, an NCCL unique id has {UNIQUE_ID_BYTES}")
    return _UniqueId(state[1])


def loads_unique_id(data: bytes) -> bytes:
    """The 128 bytes of a pickled vLLM ``ncclUniqueId``.

    Raises:
        UnsafePickleError: anything but that one class with exactly 128 bytes.
    """
    def check(obj):
        if not isinstance(obj, _UniqueId):
            raise refuse(_WHAT_UID, f"the pickle holds a {type(obj).__name__}, not vLLM's ncclUniqueId")
        return bytes(obj)

    allowed = {("_ctypes", "_unpickle"): _ctypes_unpickle, VLLM_UNIQUE_ID_CLASS: _UniqueIdClass}
    return restricted_loads(data, allowed, _WHAT_UID, check=check, max_bytes=4096)


def _short_unicode(s: str) -> bytes:
    b = s.encode()
    return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE


def dumps_unique_id(raw: bytes) -> bytes:
    """A pickle that vLLM's ``pickle.loads`` turns into its ``ncclUniqueId`` holding ``raw``
    (what ``pickle.dumps`` of that object gives, minus framing and memo opcodes).

    Raises:
        ValueError: ``raw`` is not 128 bytes.
    """
    if len(raw) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(raw)}")
    return b"".join([
        b"\x80\x04",  # PROTO 4
        _short_unicode("_ctypes"), _short_unicode("_unpickle"), b"\x93",  # STACK_GLOBAL
        _short_unicode(VLLM_UNIQUE_ID_CLASS[0]), _short_unicode(VLLM_UNIQUE_ID_CLASS[1]), b"\x93",
        b"}",  # EMPTY_DICT
        b"C" + bytes([UNIQUE_ID_BYTES]) + bytes(raw),  # SHORT_BINBYTES
        b"\x86\x86R.",  # TUPLE2 TUPLE2 REDUCE STOP
    ])


def loads_str(data: bytes, what: str) -> str:
    """A pickled ``str`` (a barrier id); no global is admitted. Raises UnsafePickleError."""
    def check(obj):
        if not isinstance(obj, str) or len(obj) > 256:
            raise refuse(what, "expected a string of at most 256 characters")
        return obj

    return restricted_loads(data, {}, what, check=check, max_bytes=4096)


class StatelessStore:
    """One rank's end of vLLM's ``StatelessProcessGroup`` (the store part; data goes over NCCL).

    Args:
        store: the connected ``TCPStore``.
        rank / world_size: this rank and the group size.
        timeout_s: the bound of every wait.
        abort: set to make a wait raise :class:`TransferAbortedError` (within 0.5 s).
    """

    def __init__(self, store, rank: int, world_size: int, timeout_s: float, abort: threading.Event | None = None):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.abort = abort or threading.Event()
        self._sent = 0
        self._received = collections.Counter()
        self._entries: collections.deque = collections.deque()

    @classmethod
    def join(cls, host: str, port: int, rank: int, world_size: int, timeout_s: float,
             abort: threading.Event | None = None) -> "StatelessStore":
        """Rank 0: host the store and wait until ``world_size - 1`` clients registered. Others:
        connect and register. Both bounded by ``timeout_s`` (torch raises ``DistStoreError`` /
        ``TimeoutError`` naming how many clients joined)."""
        td = timedelta(seconds=timeout_s)
        if rank != 0:  # torch's client would wait for ever on a listener that never answers its handshake
            probe_store(host, port, timeout_s, f"rank {rank}/{world_size}, vLLM's StatelessProcessGroup")
        store = dist.TCPStore(host, port, world_size, rank == 0, td, wait_for_workers=True)
        return cls(store, rank, world_size, timeout_s, abort)

    # ------------------------------------------------------------------ waits
    def _wait_key(self, key: str, what: str, deadline: float) -> None:
        while True:
            if self.abort.is_set():
                raise TransferAbortedError(f"{what}: aborted")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeoutError(f"{what}: key {key!r} did not appear in the rendezvous store within "
                                           f"{self.timeout_s:.0f} s (rank {self.rank}/{self.world_size}); is the "
                                           "peer alive?")
            try:
                self.store.wait([key], timedelta(seconds=min(0.5, left)))
                return
            except Exception as e:  # noqa: BLE001 - torch raises its own timeout / store errors
                if "timeout" not in str(e).lower() and "timed out" not in str(e).lower():
                    raise TransferAbortedError(f"{what}: the rendezvous store failed: {e}") from e

    # ------------------------------------------------------------------ broadcast_obj
    def broadcast_bytes(self, payload: bytes | None, src: int, what: str) -> bytes:
        """vLLM's ``broadcast_obj`` with the pickle left to the caller: rank ``src`` stores
        ``payload``; the others wait (bounded) for it and return the raw bytes, unread."""
        if self.rank == src:
            self._expire()
            key = f"broadcast_from/{src}/{self._sent}"
            self.store.set(key, payload)
            self._sent += 1
            self._entries.append((key, time.monotonic()))
            return payload
        key = f"broadcast_from/{src}/{self._received[src]}"
        self._wait_key(key, what, time.monotonic() + self.timeout_s)
        data = self.store.get(key)
        self._received[src] += 1
        return data

    def _expire(self) -> None:
        while self._entries and time.monotonic() - self._entries[0][1] > DATA_EXPIRATION_S:
            key, _t = self._entries.popleft()
            self.store.delete_key(key)

    # ------------------------------------------------------------------ barrier
    def barrier(self) -> None:
        """vLLM's ``StatelessProcessGroup.barrier`` (see the module docstring), every phase
        bounded by ``timeout_s``.

        Raises:
            TransferTimeoutError / TransferAbortedError; UnsafePickleError (rank 0's barrier id).
        """
        what = "the rendezvous store barrier"
        if self.rank == 0:
            bid = f"barrier_{uuid.uuid4()}"
            self.broadcast_bytes(pickle.dumps(bid), 0, what)
        else:
            bid = loads_str(self.broadcast_bytes(None, 0, what), "the barrier id in the rendezvous store")
        deadline = time.monotonic() + self.timeout_s
        self.store.set(f"arrival_{bid}_{self.rank}", b"1")
        for i in range(self.world_size):
            self._wait_key(f"arrival_{bid}_{i}", what, deadline)
        self.store.set(f"departure_{bid}_{self.rank}", b"1")
        if self.rank != 0:
            return
        for i in range(self.world_size):
            self._wait_key(f"departure_{bid}_{i}", what, deadline)
        for i in range(self.world_size):
            for k in (f"arrival_{bid}_{i}", f"departure_{bid}_{i}"):
                self.store.delete_key(k)
