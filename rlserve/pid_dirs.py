"""Temporary directories named after the process that made them, ``<tmp>/<prefix><pid>-XXXX``
(:func:`pid_dir`), and the removal of those whose process is gone: a SIGKILLed server cannot
remove its own. Used for the engine cores' socket directories (``rlserve-core-``,
:func:`rlserve.engine.front.core_spawn.socket_dir`: 638 of them had piled up in a CI machine's
``/tmp`` from killed test runs) and ``--api-server-count``'s metric files (``rlserve-metrics-``,
:mod:`rlserve.server.metrics_mp`). Directories without a pid (an older layout), of other users, or
of live processes are left alone; a dead process's pid reused by a live one keeps its directory
until that one ends."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile


def remove_dead(prefix: str, root: str | None = None) -> list[str]:
    """Remove this user's ``<root>/<prefix><pid>-*`` directories whose process ``pid`` no longer
    exists (not this process's); returns their paths. ``root``: default ``tempfile.gettempdir()``."""
    root = root or tempfile.gettempdir()
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            pid = name[len(prefix):].split("-", 1)[0] if name.startswith(prefix) else ""
            if not pid.isdigit() or int(pid) == os.getpid() or pid_exists(int(pid)):
                continue
            path = os.path.join(root, name)
            with contextlib.suppress(OSError):
                if os.path.isdir(path) and not os.path.islink(path) and os.stat(path).st_uid == os.getuid():
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
    return removed


def pid_dir(prefix: str, root: str | None = None) -> str:
    """A new directory ``<root>/<prefix><this pid>-XXXX`` (mode 0700, ``tempfile.mkdtemp``), after
    :func:`remove_dead` of the same prefix."""
    remove_dead(prefix, root)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=root or tempfile.gettempdir())


def pid_exists(pid: int) -> bool:
    """Whether a process ``pid`` exists (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
