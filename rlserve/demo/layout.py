"""Where the demo's server and trainer run (:func:`choose_layout`): gloo on CPU, CUDA IPC on one
GPU, NCCL with a spare GPU for the trainer."""

from __future__ import annotations

from dataclasses import dataclass

from rlserve.demo.common import BACKENDS, DemoError


@dataclass
class Layout:
    """Where the server and the trainer run.

    Attributes:
        backend: ``gloo`` | ``ipc`` | ``nccl``.
        server_device: ``cpu`` or ``cuda``.
        server_device_ids: GPUs of the server (``--device-ids``), ``None`` on CPU.
        trainer_device: ``cpu`` or ``cuda:N``.
        dtype: the server's ``--dtype`` and the trainer model's dtype.
        tensor_parallel_size: the server's TP.
    """

    backend: str
    server_device: str
    server_device_ids: list[int] | None
    trainer_device: str
    dtype: str
    tensor_parallel_size: int = 1

    def describe(self) -> str:
        srv = "CPU" if self.server_device == "cpu" else f"GPU {','.join(map(str, self.server_device_ids or []))}"
        trn = "CPU" if self.trainer_device == "cpu" else f"GPU {self.trainer_device.split(':')[-1]}"
        tp = f", TP={self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else ""
        return f"backend {self.backend}: server on {srv}{tp}, trainer on {trn}, {self.dtype}"


def cuda_device_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA install means "no GPU" here
        return 0


def choose_layout(backend: str = "auto", tensor_parallel_size: int = 1, num_gpus: int | None = None,
                  dtype: str | None = None) -> Layout:
    """Pick the data plane and the devices.

    ``auto``: gloo without GPUs; NCCL when there is a GPU for the trainer beside the server's
    ``tensor_parallel_size`` GPUs (two or more GPUs); CUDA IPC otherwise (the trainer shares
    GPU 0 with the server). ``gloo`` always runs server and trainer on the CPU. The server takes
    GPUs ``0..TP-1``; an NCCL trainer takes the last GPU. ``dtype``: float32 on CPU, bfloat16 on
    GPU unless given. Raises :class:`DemoError` for a layout the machine cannot hold.
    """
    tp = int(tensor_parallel_size)
    if tp < 1:
        raise DemoError(f"--tensor-parallel-size must be >= 1, got {tp}")
    if backend not in BACKENDS:
        raise DemoError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    n = cuda_device_count() if num_gpus is None else int(num_gpus)
    if backend == "auto":
        backend = "gloo" if n == 0 else ("nccl" if n >= 2 and n >= tp + 1 else "ipc")
    if backend == "gloo":
        return Layout("gloo", "cpu", None, "cpu", dtype or "float32", tp)
    if n == 0:
        need = (f"{tp + 1} CUDA GPUs (the server's TP={tp} and one of its own for the trainer)" if backend == "nccl"
                else f"{tp} CUDA GPU{'s' if tp > 1 else ''} (the trainer shares GPU 0 with the server)")
        raise DemoError(f"--backend {backend} needs {need} and this machine has none; use --backend gloo "
                        "(server and trainer on the CPU)")
    if tp > n:
        raise DemoError(f"TP={tp} needs {tp} GPUs; this machine has {n}")
    server_ids = list(range(tp))
    if backend == "ipc":
        return Layout("ipc", "cuda", server_ids, "cuda:0", dtype or "bfloat16", tp)
    if n < tp + 1:
        raise DemoError(f"nccl puts the trainer on its own GPU (NCCL refuses two ranks on one GPU): TP={tp} "
                        f"needs {tp + 1} GPUs, this machine has {n}; use --backend ipc")
    return Layout("nccl", "cuda", server_ids, f"cuda:{n - 1}", dtype or "bfloat16", tp)


