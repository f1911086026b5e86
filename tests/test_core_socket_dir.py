"""rlserve.engine.front.core_spawn.socket_dir: the engine cores' ZMQ socket directories are named
after the creating process, and the ones a killed server left behind are removed."""

from __future__ import annotations

import os
import subprocess
import sys

from rlserve.engine.front.core_spawn import SOCKET_DIR_PREFIX, socket_dir


def test_socket_dirs_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid no longer exists (a reuse within this test would only keep the dir)
    stale = tmp_path / f"{SOCKET_DIR_PREFIX}{dead.pid}-abc123"
    stale.mkdir()
    (stale / "in").write_text("")
    live = tmp_path / f"{SOCKET_DIR_PREFIX}{os.getppid()}-def456"  # the parent of this test process is alive
    live.mkdir()
    older = tmp_path / f"{SOCKET_DIR_PREFIX}xyz"  # the layout before pids: owner unknown
    older.mkdir()
    other = tmp_path / "unrelated-123-x"
    other.mkdir()

    new = socket_dir(str(tmp_path))

    assert os.path.basename(new).startswith(f"{SOCKET_DIR_PREFIX}{os.getpid()}-")
    assert os.path.isdir(new)
    assert not stale.exists()
    assert live.is_dir() and older.is_dir() and other.is_dir()
    second = socket_dir(str(tmp_path))  # this process's own directories are kept
    assert os.path.isdir(new) and os.path.isdir(second) and new != second
