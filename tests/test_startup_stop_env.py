"""benchmarks/startup_stop.py starts each checkout's server with that checkout first on PYTHONPATH and
the caller's entries after it (the GPU machine's dependencies live on PYTHONPATH: a server environment
without them died at ``import msgspec``, window 2 of 2026-12-06)."""

from __future__ import annotations

import os

from benchmarks.startup_stop import server_env


def test_the_checkout_comes_first_and_the_callers_pythonpath_is_kept(tmp_path):
    env = server_env(str(tmp_path), {"PYTHONPATH": "/tmp/site:/work/repo", "HOME": "/root"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path), "/tmp/site", "/work/repo"]
    assert env["HOME"] == "/root" and env["PYTHONUNBUFFERED"] == "1"


def test_no_pythonpath_gives_the_checkout_alone(tmp_path):
    assert server_env(str(tmp_path), {})["PYTHONPATH"] == str(tmp_path)
