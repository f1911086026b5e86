"""The CPU kernels' C sources (``rlserve/layers/csrc``) of one git revision, compiled on their own:
for the A/B scripts that time two revisions of a kernel (``cpu_attn_ab.py``, ``cpu_gemm_ab.py``,
``cpu_decode_step.py``).

A revision's top file is built with the files it ``#include "..."``s (transitively) from the SAME
revision, written into a directory of their own: compiling an old ``cpu_team.c`` with ``-I`` this
tree's ``csrc`` would mix two revisions (this tree's ``paged_decode.c``, ``paged_prefill.c``, ... in
the "old" build). Flags: :mod:`rlserve.layers.cpu_build`'s (``BASE_FLAGS`` plus ``-fopenmp``).
"""

from __future__ import annotations

import ctypes
import re
import subprocess
from pathlib import Path

from rlserve.layers.cpu_build import BASE_FLAGS, CSRC, _compiler

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"', flags=re.M)


def sources(rev: str | None, root: Path, top: str = "paged_decode.c") -> dict[str, str]:
    """``csrc/top`` and the ``csrc`` files it includes (transitively), of git revision ``rev``
    (``None``: this tree's files), by file name; ``root`` is the repository (git's working
    directory).

    Raises:
        subprocess.CalledProcessError: ``rev`` is unknown or lacks one of the files."""
    todo, got = [top], {}
    while todo:
        name = todo.pop()
        if rev is None:
            text = (CSRC / name).read_text()
        else:
            text = subprocess.run(["git", "show", f"{rev}:rlserve/layers/csrc/{name}"], cwd=root, check=True,
                                  capture_output=True, text=True).stdout
        got[name] = text
        todo += [n for n in _INCLUDE.findall(text) if n not in got]
    return got


def compile_lib(files: dict[str, str], top: str, out: Path) -> ctypes.CDLL:
    """Compile ``files`` (:func:`sources`) in a new directory ``out`` of their own, with
    :mod:`rlserve.layers.cpu_build`'s flags, into ``out/lib.so``, and load it (no ``-I``: every
    included file comes from ``files``).

    Raises:
        FileExistsError: ``out`` exists; subprocess.CalledProcessError: the compiler failed."""
    out.mkdir()
    for name, text in files.items():
        (out / name).write_text(text)
    lib = out / "lib.so"
    subprocess.run([_compiler(), *BASE_FLAGS, "-fopenmp", str(out / top), "-o", str(lib), "-lm"], check=True)
    return ctypes.CDLL(str(lib))
