"""Restricted unpickling: the only way rlserve reads a pickle.

vLLM's wire carries two pickles that rlserve has to read: the NCCL unique id that a
``StatelessProcessGroup``'s rank 0 stores at ``broadcast_from/0/0`` (a pickle of vLLM's ctypes
``ncclUniqueId``), and ``update_info.ipc_handles_pickled`` (base64 pickles of the arguments
``torch.multiprocessing.reductions.reduce_tensor`` returns). ``pickle.loads`` on either would run
whatever the sender chose (a ``__reduce__`` naming ``os.system``); rlserve never calls it.

:func:`restricted_loads` runs the standard unpickler with ``find_class`` replaced: a global the
pickle names is looked up in an explicit allow-list that maps ``(module, name)`` to a callable of
ours (never the named object itself, unless the caller put exactly that object in the list); any
other global, an extension-registry code and a persistent id are refused with
:class:`UnsafePickleError` before anything is called. The allowed callables check their
arguments' types themselves. Opcodes that build objects without a global (lists, dicts, tuples,
sets, strings, bytes, numbers, ``None``, booleans) call no user code.

:class:`UnsafePickleError` is a ``WeightUpdateError``: the routes answer it with HTTP 400 and the
error code ``"unsafe_pickle"`` (OpenAI-style body), and nothing the pickle named has run.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Callable, Mapping

from rlserve.errors import WeightUpdateError

#: Largest pickle read (bytes). The NCCL unique id's is 247 bytes; an 8B model's per-tensor ipc
#: handles are ~150 KB. Bigger inputs are refused before unpickling.
MAX_PICKLE_BYTES = 64 << 20


class UnsafePickleError(WeightUpdateError):
    """A pickle names something outside the allow-list, carries arguments of the wrong types, or
    is not a valid pickle. Nothing it named was called. HTTP 400, error code ``unsafe_pickle``."""

    code = "unsafe_pickle"


class _Restricted(pickle.Unpickler):
    def __init__(self, data: bytes, allowed: Mapping[tuple[str, str], Any], what: str):
        super().__init__(io.BytesIO(data))
        self._allowed = allowed
        self._what = what

    def find_class(self, module: str, name: str) -> Any:
        obj = self._allowed.get((module, name))
        if obj is None:
            known = ", ".join(f"{m}.{n}" for m, n in self._allowed) or "no global at all"
            raise UnsafePickleError(f"{self._what}: the pickle names {module}.{name}, which is not allowed "
                                    f"(allowed: {known}); nothing was run")
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"{self._what}: the pickle uses a persistent id, which is not allowed")


def restricted_loads(data: bytes, allowed: Mapping[tuple[str, str], Any], what: str,
                     check: Callable[[Any], Any] | None = None, max_bytes: int = MAX_PICKLE_BYTES) -> Any:
    """Unpickle ``data`` admitting only the globals in ``allowed``.

    Args:
        data: the pickle.
        allowed: ``{(module, qualified name): the callable / class to use in its place}``.
        what: names the input in error messages (``"update_info.ipc_handles_pickled"``).
        check: applied to the unpickled object (returns the value to hand back, may raise
            :class:`UnsafePickleError` for a wrong shape or type).
        max_bytes: larger inputs are refused unread.
    Returns:
        ``check(obj)`` or the object.
    Raises:
        UnsafePickleError: a global outside ``allowed``, a persistent id, an allowed callable's
            type check failing, a malformed or oversized pickle.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise UnsafePickleError(f"{what}: expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise UnsafePickleError(f"{what}: {len(data)} bytes is more than the {max_bytes} accepted")
    try:
        obj = _Restricted(bytes(data), allowed, what).load()
    except UnsafePickleError:
        raise
    except RecursionError:
        raise UnsafePickleError(f"{what}: the pickle is nested too deeply") from None
    except Exception as e:  # noqa: BLE001 - truncated / malformed input, a type error in a call
        raise UnsafePickleError(f"{what}: not a pickle this server accepts ({type(e).__name__}: {e})") from None
    return check(obj) if check is not None else obj


def refuse(what: str, why: str) -> UnsafePickleError:
    """The error an allowed callable raises for arguments of the wrong type or value."""
    return UnsafePickleError(f"{what}: {why}; nothing was run")
