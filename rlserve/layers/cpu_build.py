"""Build and load the CPU path's C kernels (``rlserve/layers/csrc/*.c``) at first use.

A kernel source is compiled with the system C compiler (``$CC``, else ``cc``, ``gcc`` or
``clang``: the same requirement ``torch.compile`` has on CPU), with ``-O3 -march=native``
plus the caller's flags and ``-fopenmp`` when the compiler has it, and cached under
``<rlserve cache>/kernels/`` (see :func:`rlserve.cache_root.default_cache_root`) by a hash of
the source, the flags, the compiler and the CPU's flags; later starts load it in
milliseconds. A build takes ~1 s. Without a compiler, or if the build fails,
:func:`load_library` returns ``None`` (one warning per library is logged) and the caller
keeps PyTorch.

With ``-fopenmp`` a library links ``libgomp.so.1``; torch's own ``libgomp.so.1`` is already
loaded under that name, so the dynamic loader binds the kernels to torch's OpenMP runtime
(one thread pool, sized by ``torch.set_num_threads``), not a second one.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
BASE_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-std=c11"]

_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL | None] = {}


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU model and flags (``/proc/cpuinfo``)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build(cc: str, src_path: Path, flags: list[str], out: Path) -> None:
    """Compile ``src_path`` into ``out`` (atomically: a temp file renamed into place), with
    OpenMP when the compiler has it. Raises ``RuntimeError`` with the compiler's output."""
    out.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for extra in (["-fopenmp"], []):
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        cmd = [cc, *flags, *extra, str(src_path), "-o", tmp, "-lm"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if r.returncode == 0:
            os.replace(tmp, out)
            return
        os.unlink(tmp)
        errors.append(f"{' '.join(cmd)}: {r.stderr.strip()[-500:]}")
    raise RuntimeError("; ".join(errors))


def _source_bytes(src_path: Path, seen: frozenset = frozenset()) -> bytes:
    """``src_path``'s bytes followed by those of every file it ``#include "..."`` s from its own
    folder (recursively): what the build's output depends on, for the cache key. (cpu_team.c
    includes paged_decode.c: a changed paged_decode.c kept serving the old cpu_team build.)"""
    src = src_path.read_bytes()
    out = [src]
    for name in re.findall(rb'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"', src, flags=re.M):
        dep = src_path.parent / name.decode()
        if dep.is_file() and dep not in seen:
            out.append(_source_bytes(dep, seen | {src_path}))
    return b"\0".join(out)


def load_library(source: str, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The shared library built from ``csrc/<source>`` (building it on first use), or
    ``None`` when it cannot be built or loaded on this machine (logged once).

    Args:
        source: file name under ``rlserve/layers/csrc`` (e.g. ``"paged_decode.c"``).
        extra_flags: compiler flags added to :data:`BASE_FLAGS` (part of the cache key).
    """
    key = f"{source}|{' '.join(extra_flags)}"
    if key in _libs:
        return _libs[key]
    with _lock:
        if key in _libs:
            return _libs[key]
        lib = None
        try:
            cc = _compiler()
            if cc is None:
                raise RuntimeError("no C compiler found ($CC, cc, gcc, clang)")
            src_path = CSRC / source
            flags = [*BASE_FLAGS, *extra_flags]
            src = _source_bytes(src_path)
            digest = hashlib.sha256(b"\0".join([src, " ".join(flags).encode(), cc.encode(),
                                                _cpu_signature().encode()])).hexdigest()[:20]
            from rlserve.cache_root import default_cache_root  # (not rlserve.download: the model fetch's modules)

            lib_path = default_cache_root() / "kernels" / f"{src_path.stem}-{digest}.so"
            if not lib_path.exists():
                _build(cc, src_path, flags, lib_path)
                logger.info("built CPU kernels %s: %s", source, lib_path)
            lib = ctypes.CDLL(str(lib_path))
        except Exception as e:  # noqa: BLE001 - any failure means "use PyTorch"
            logger.warning("CPU kernels %s unavailable, using PyTorch: %s", source, e)
            lib = None
        _libs[key] = lib
        return lib
