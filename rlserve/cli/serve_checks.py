"""``rlserve serve``'s checks before any engine starts, each refusing a bad setting with one line (exit 2) rather
than after the model loaded: the model's path (:func:`resolve_model_name`), the CUDA device asked for
(:func:`check_device`, the driver's device count without torch: :func:`driver_device_count`), the KV cache's size
(:func:`check_kv_cache`), the CPU engine's environment (:func:`check_cpu_environment`), and the listening address,
bound now (:func:`bind_listen_socket`). Starting and serving: :mod:`rlserve.cli.serve`."""

from __future__ import annotations

import logging
import re

from rlserve.kv_size import CPU_KV_CACHE_BYTES, check_kv_cache_bytes
from rlserve.model_len import AUTO_MAX_MODEL_LEN

logger = logging.getLogger("rlserve.serve")


def resolve_model_name(name: str) -> str:
    """``name`` as a local path (:func:`rlserve.download.resolve_model`: the default model's build, a directory);
    ``name`` itself where that module cannot be imported."""
    try:
        from rlserve.download import resolve_model
    except ImportError:
        return name
    return resolve_model(name)


def check_cpu_environment(config) -> None:
    """A CPU engine's environment (thread count, micro-batches), refused here rather than by an
    engine process after the model loaded. Not on GPUs: there ``OMP_NUM_THREADS`` may hold
    values (``"4,2"``) the CPU engine rule does not take.

    Raises:
        ValueError: a setting the CPU engine would refuse.
    """
    from rlserve.config import resolve_device

    if config.device.startswith("cuda") or resolve_device(config.device).type != "cpu":  # (cuda: no torch import)
        return
    from rlserve.engine.cpu import cpu_microbatch, cpu_threads

    cpu_threads.engine_cpu_threads(config)
    cpu_microbatch.check_environment(config)


def driver_device_count() -> int | None:
    """CUDA devices the driver sees (``cuInit`` + ``cuDeviceGetCount`` of ``libcuda.so.1`` through ctypes,
    ``CUDA_VISIBLE_DEVICES`` honoured), without importing torch (1.5-2.5 s that delayed the engine-core
    process's arguments); None without the library or when a call fails."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
        n = ctypes.c_int(0)
        if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(n)) != 0:
            return None
        return n.value
    except (OSError, AttributeError):
        return None


def cpu_only(config) -> bool:
    """Whether the engine will run on the CPU, told without importing torch: ``--device cpu``, or ``auto`` where
    the driver sees no CUDA device (:func:`driver_device_count` None or 0: torch's ``cuda.is_available()`` is
    False then, :func:`rlserve.config.resolve_device`). ``auto`` on a machine whose driver sees a device but whose
    torch has no CUDA also runs on the CPU: False here, the engine's start checks the cache then."""
    return config.device == "cpu" or (config.device == "auto" and not driver_device_count())


def check_kv_cache(config, model_path: str, max_model_len: int) -> None:
    """The KV cache's size checked before any engine starts (:func:`rlserve.kv_size.check_kv_cache_bytes`):
    ``--num-kv-blocks`` anywhere; ``--kv-cache-bytes`` (unset: the 512 MiB CPU default) only where the engine will
    run on the CPU (:func:`cpu_only`). A GPU ignores ``--kv-cache-bytes`` (``--gpu-memory-utilization`` sizes it):
    one warning where it came without ``--num-kv-blocks``. ``max_model_len``: the checkpoint-checked length.

    Raises:
        InvalidRequestError: the cache cannot hold one sequence (one line with the bytes)."""
    if config.num_kv_blocks is None and not cpu_only(config):
        if config.kv_cache_bytes is not None:
            logger.warning("--kv-cache-bytes %d is ignored on a CUDA device (--device %s): the GPU sizes its KV cache "
                           "from --gpu-memory-utilization; use --num-kv-blocks to fix its size",
                           config.kv_cache_bytes, config.device)
        return
    check_kv_cache_bytes(config.kv_cache_bytes, model_path, config.block_size,
                         None if config.max_model_len == AUTO_MAX_MODEL_LEN else max_model_len, config.dtype,
                         config.kv_cache_dtype, config.tensor_parallel_size, config.num_kv_blocks, CPU_KV_CACHE_BYTES)


def check_device(config) -> None:
    """A CUDA device asked for (``--device cuda[:N]``) must exist, found here rather than by the
    engine after the model loaded. Raises ValueError. (``auto`` takes what there is: nothing to check.)
    Where the driver already sees the device (:func:`driver_device_count`), torch is not imported here (a
    CPU-only torch on a GPU machine then fails in the engine's start: exit 1, not 2)."""
    m = re.fullmatch(r"cuda(?::(\d+))?", config.device)
    if m is None:
        return
    n = driver_device_count()
    if n is not None and n > int(m.group(1) or 0):
        return
    from rlserve.config import resolve_device

    device = resolve_device(config.device)
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"--device {config.device}: no CUDA device is available here (torch "
                         f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}); use --device cpu")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {config.device}: there are {torch.cuda.device_count()} CUDA device(s)")


def bind_listen_socket(host: str, port: int):
    """The listening address, bound now (as vLLM does) so that a port in use or a host that
    is not ours fails before any engine starts; uvicorn is handed the socket.

    Raises:
        OSError: the address cannot be resolved or bound (the message names it).
    """
    import socket

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise OSError(f"cannot resolve --host {host!r}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(False)
    return sock


