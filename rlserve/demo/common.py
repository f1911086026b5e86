"""The demo's constants and errors: the default prompts (vLLM's RLHF example), exit codes, the
environment of multi-GPU runs, the backends ``rlserve demo`` takes."""

from __future__ import annotations

PROMPTS = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
DEFAULT_MAX_TOKENS = 32

#: Set in the environment of every process of a multi-GPU run (server included): NVLink
#: multicast (NVLS) and symmetric-memory multicast are off, as the device machines need.
NCCL_SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_MISMATCH = 3

BACKENDS = ("auto", "gloo", "ipc", "nccl")


class DemoError(RuntimeError):
    """A step of the demo failed (the message says which and why)."""


class ServerStartError(DemoError):
    """The server exited or did not become healthy in time (the message has its log's tail)."""


def log(msg: str) -> None:
    print(msg, flush=True)


