"""The pieces of ``--api-server-count N`` that need no server (rlserve/server/log_prefix.py,
rlserve/server/metrics_mp.py's directory, rlserve/pid_dirs.py, rlserve/server/multi_api.py's stop):

* every log line of API process ``i`` starts with vLLM's ``(ApiServer_i pid=P)`` (``(APIServer pid=P)``
  with one process), rlserve's own lines and uvicorn's (its default and access formatters);
* the metric files' directory: the user's ``PROMETHEUS_MULTIPROC_DIR`` is used (made if missing), with
  vLLM's warning, and never removed; else a new ``rlserve-metrics-<pid>-*`` one, made after removing those of
  dead processes (this user's, rlserve's name only), removed at the stop;
* the engine cores' socket directories keep their rule (tests/test_core_socket_dir.py) through the
  shared :func:`rlserve.pid_dirs.pid_dir`."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from rlserve.pid_dirs import pid_dir, remove_dead
from rlserve.server import log_prefix, metrics_mp
from rlserve.server.multi_api import APIServerProcessManager


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # reaped: its pid no longer exists (a reuse within this test would only keep the dir)
    return p.pid


def _record(name: str, msg: str, args=()) -> logging.LogRecord:
    return logging.LogRecord(name, logging.INFO, __file__, 1, msg, args, None)


def test_process_names_are_vllms():
    assert log_prefix.process_name(1, 0) == "APIServer"
    assert [log_prefix.process_name(3, i) for i in range(3)] == ["ApiServer_0", "ApiServer_1", "ApiServer_2"]


def test_rlserve_lines_start_with_the_process_prefix():
    line = logging.Formatter(log_prefix.log_format("ApiServer_1")).format(_record("rlserve.serve", "ready: %s",
                                                                                 ("http://x",)))
    assert line.startswith(f"(ApiServer_1 pid={os.getpid()}) ")
    assert line.endswith(" INFO rlserve.serve: ready: http://x")


def test_uvicorn_lines_start_with_the_process_prefix():
    import uvicorn.logging

    config = log_prefix.uvicorn_log_config("ApiServer_2")
    default = config["formatters"]["default"]
    out = uvicorn.logging.DefaultFormatter(default["fmt"], use_colors=False).format(
        _record("uvicorn.error", "Started server process [%d]", (123,)))
    assert out == f"(ApiServer_2 pid={os.getpid()}) INFO:     Started server process [123]"
    access = config["formatters"]["access"]
    out = uvicorn.logging.AccessFormatter(access["fmt"], use_colors=False).format(
        _record("uvicorn.access", '%s - "%s %s HTTP/%s" %d', ("127.0.0.1:5000", "GET", "/health", "1.1", 200)))
    assert out == f'(ApiServer_2 pid={os.getpid()}) INFO:     127.0.0.1:5000 - "GET /health HTTP/1.1" 200 OK'
    from uvicorn.config import LOGGING_CONFIG  # uvicorn's own dict is left as it was

    assert LOGGING_CONFIG["formatters"]["default"]["fmt"] == "%(levelprefix)s %(message)s"
    assert config["handlers"] == LOGGING_CONFIG["handlers"] and config["loggers"] == LOGGING_CONFIG["loggers"]


def test_a_percent_in_the_name_does_not_break_the_format():
    line = logging.Formatter(log_prefix.log_format("A%B")).format(_record("x", "m"))
    assert line.startswith(f"(A%B pid={os.getpid()}) ")


def test_own_metrics_dir_removes_dead_processes_dirs_only(tmp_path, monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    stale = tmp_path / f"{metrics_mp.DIR_PREFIX}{_dead_pid()}-abc"
    stale.mkdir()
    (stale / "counter_123.db").write_bytes(b"x")
    live = tmp_path / f"{metrics_mp.DIR_PREFIX}{os.getppid()}-def"  # the parent of this test process is alive
    live.mkdir()
    core = tmp_path / f"rlserve-core-{_dead_pid()}-ghi"  # another prefix: the cores' own rule removes those
    core.mkdir()
    other = tmp_path / "rlserve-metricsXYZ"
    other.mkdir()
    path, owned = metrics_mp.setup_dir(str(tmp_path))
    assert owned and os.path.basename(path).startswith(f"{metrics_mp.DIR_PREFIX}{os.getpid()}-")
    assert os.path.isdir(path) and (os.stat(path).st_mode & 0o777) == 0o700
    assert not stale.exists()
    assert live.is_dir() and core.is_dir() and other.is_dir()
    mgr = APIServerProcessManager(2, None, [], path, owned)
    mgr.stop()  # (none started) the stop removes the directory process 0 made
    assert not os.path.exists(path)


def test_the_users_metrics_dir_is_used_and_kept(tmp_path, monkeypatch, caplog):
    user = tmp_path / "prom"  # missing: made
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(user))
    stale = tmp_path / f"{metrics_mp.DIR_PREFIX}{_dead_pid()}-abc"
    stale.mkdir()
    with caplog.at_level(logging.WARNING, logger="rlserve.server.metrics_mp"):
        path, owned = metrics_mp.setup_dir(str(tmp_path))
    assert (path, owned) == (str(user), False) and user.is_dir()
    assert stale.is_dir()  # (nothing of rlserve's own made: nothing cleaned either)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"PROMETHEUS_MULTIPROC_DIR={user}" in warnings[0] and "not cleaned" in warnings[0]
    (user / "counter_1.db").write_bytes(b"x")
    APIServerProcessManager(2, None, [], path, owned).stop()
    assert (user / "counter_1.db").is_file()


def test_pid_dir_keeps_other_users_links_and_files(tmp_path):
    dead = _dead_pid()
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / f"x-{dead}-link").symlink_to(target)  # a link named like one: not followed, not removed
    (tmp_path / f"x-{dead}-file").write_text("")  # a file named like one
    (tmp_path / f"x-{dead}-dir").mkdir()
    assert remove_dead("x-", str(tmp_path)) == [str(tmp_path / f"x-{dead}-dir")]
    assert target.is_dir() and (tmp_path / f"x-{dead}-link").is_symlink() and (tmp_path / f"x-{dead}-file").is_file()
    mine = pid_dir("x-", str(tmp_path))
    assert os.path.basename(mine).startswith(f"x-{os.getpid()}-") and remove_dead("x-", str(tmp_path)) == []
