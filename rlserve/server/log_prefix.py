"""The process prefix of every log line of an ``rlserve serve`` API process, vLLM's:
``(APIServer pid=1234)`` with one API process, ``(ApiServer_0 pid=1234)``, ``(ApiServer_1 pid=1240)``, ...
with ``--api-server-count N`` > 1 (vLLM 0.32's names: ``run_server`` calls ``decorate_logs("APIServer")``;
``run_api_server_worker_proc`` names its processes ``ApiServer_{i}``, ``vllm/v1/utils.py``). The prefix comes
first, before rlserve's own format (``(APIServer pid=1234) 2026-12-08 00:10:00,123 INFO rlserve.serve: ...``)
and before uvicorn's (``(ApiServer_1 pid=1240) INFO:     127.0.0.1:50312 - "POST /v1/completions HTTP/1.1"
200``): with N processes on one socket a line says which process logged it.

vLLM 0.32 leaves uvicorn's own lines without it (uvicorn's default ``log_config``); rlserve prefixes them
too, as their lines are the ones that tell which process served a request. ``%(process)d`` is the logging
record's own pid (a forked child's lines carry its pid). The engine-core processes keep their
``[engine-core N]`` tag (:mod:`rlserve.engine.core.core_proc`).
"""

from __future__ import annotations

import copy

#: rlserve's log format after the prefix (API processes)
RLSERVE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def process_name(count: int, index: int) -> str:
    """vLLM's name of API process ``index`` of ``count`` (``--api-server-count``)."""
    return "APIServer" if count <= 1 else f"ApiServer_{index}"


def prefix(name: str) -> str:
    """``(NAME pid=%(process)d) ``: a logging format's process prefix (``%`` in ``name`` escaped)."""
    return f"({name.replace('%', '%%')} pid=%(process)d) "


def log_format(name: str) -> str:
    """The ``logging.basicConfig`` format of API process ``name``."""
    return prefix(name) + RLSERVE_FORMAT


def uvicorn_log_config(name: str) -> dict:
    """uvicorn's default ``log_config`` (``uvicorn.config.LOGGING_CONFIG``, copied) with the process
    prefix before each of its formatters' ``fmt``; the rest (handlers, levels, streams) as uvicorn's."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    for formatter in config.get("formatters", {}).values():
        if "fmt" in formatter:
            formatter["fmt"] = prefix(name) + formatter["fmt"]
    return config
