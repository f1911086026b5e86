"""Tensor parallelism: one process per TP rank, rank 0 in the engine's own process.

Rank 0 schedules and samples; every step it sends the :class:`StepInput` (plain lists,
a few KB) down a pipe to ranks 1..N-1 and runs its own forward; the ranks meet in the
TP all-reduces, and rank 0 alone computes the sampled tokens. The TP group is a
:class:`~rlserve.distributed.group.StandaloneGroup` (NCCL on GPUs, gloo on CPUs).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import traceback

import torch

from rlserve.config import EngineConfig, resolve_device
from rlserve.distributed.group import StandaloneGroup, get_open_port
from rlserve.engine.worker.step_input import StepInput
from rlserve.engine.worker.worker import Worker

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 600.0
_TP_TIMEOUT_S = 600.0


def _rank_devices(config: EngineConfig, dp_index: int) -> list[str]:
    """Device of each TP rank of replica ``dp_index``: ``device_ids[dp*TP + r]`` on CUDA."""
    tp = config.tensor_parallel_size
    base = resolve_device(config.device)
    if base.type != "cuda":
        return ["cpu"] * tp
    ids = config.device_ids or list(range(torch.cuda.device_count()))
    need = (dp_index + 1) * tp
    if len(ids) < need:
        raise RuntimeError(f"replica {dp_index} with TP={tp} needs {need} GPUs; have device ids {ids}")
    return [f"cuda:{ids[dp_index * tp + r]}" for r in range(tp)]


def _worker_main(config: EngineConfig, rank: int, dp_index: int, device: str, port: int, conn) -> None:
    """Body of a TP worker process (rank >= 1): build the worker, then serve commands."""
    try:
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(torch.device(device))
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // config.tensor_parallel_size))
        group = StandaloneGroup(
            backend, "127.0.0.1", port, rank, config.tensor_parallel_size, timeout_s=_TP_TIMEOUT_S,
            prefix=f"tp{dp_index}", device=torch.device(device),
        )
        worker = Worker(config, rank, config.tensor_parallel_size, dp_index, device=device, tp_group=group)
        conn.send(("ok", None))
    except BaseException as e:  # noqa: BLE001 - reported to rank 0
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        cmd = msg[0]
        try:
            if cmd == "execute":
                worker.execute(msg[1])
                continue  # no reply: rank 0 does not wait for followers
            if cmd == "stop":
                conn.send(("ok", None))
                return
            if cmd == "method":
                result = getattr(worker, msg[1])(*msg[2])
            elif cmd == "call":
                result = worker.call(msg[1], *msg[2], **msg[3])
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", result))
        except BaseException as e:  # noqa: BLE001
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class TPExecutor:
    """Runs a TP>1 model: rank 0 here, ranks 1..N-1 in spawned processes.

    Provides the executor interface :class:`~rlserve.engine.core.llm_engine.LLMEngine` uses:
    ``execute``, ``collective_rpc``, ``set_token_limits``, ``determine_num_blocks``, ``bytes_per_block``,
    ``init_kv_cache``,
    ``load_weights``, ``model``, ``hf_config``, ``dtype``, ``device``.

    Raises:
        RuntimeError: a worker failed to start (its traceback is in the message).
    """

    def __init__(self, config: EngineConfig, dp_index: int = 0):
        self.config = config
        tp = config.tensor_parallel_size
        devices = _rank_devices(config, dp_index)
        port = get_open_port()
        ctx = mp.get_context("spawn")
        self.conns = []
        self.procs = []
        for r in range(1, tp):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(config, r, dp_index, devices[r], port, child), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        try:
            backend = "nccl" if devices[0].startswith("cuda") else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(torch.device(devices[0]))
            group = StandaloneGroup(
                backend, "127.0.0.1", port, 0, tp, timeout_s=_TP_TIMEOUT_S, prefix=f"tp{dp_index}",
                device=torch.device(devices[0]),
            )
            self.worker = Worker(config, 0, tp, dp_index, device=devices[0], tp_group=group)
            for conn in self.conns:
                self._recv(conn, _STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise

    # ---- plumbing -------------------------------------------------------------------
    @staticmethod
    def _recv(conn, timeout_s: float | None):
        if not conn.poll(timeout_s):
            raise TimeoutError(f"TP worker did not answer within {timeout_s} s")
        status, value = conn.recv()
        if status != "ok":
            raise RuntimeError(f"TP worker failed: {value}")
        return value

    def _broadcast_method(self, name: str, *args):
        for conn in self.conns:
            conn.send(("method", name, args))
        local = getattr(self.worker, name)(*args)
        return [local] + [self._recv(c, _TP_TIMEOUT_S) for c in self.conns]

    # ---- executor interface -----------------------------------------------------------
    @property
    def model(self):
        return self.worker.model

    @property
    def hf_config(self):
        return self.worker.hf_config

    @property
    def dtype(self):
        return self.worker.dtype

    @property
    def device(self):
        return self.worker.device

    def determine_num_blocks(self) -> int:
        """The smallest block count any rank can hold (all ranks use the same)."""
        return min(self._broadcast_method("determine_num_blocks"))

    def set_token_limits(self, max_model_len: int, max_num_batched_tokens: int) -> None:
        """Every rank takes rank 0's resolved ``max_model_len`` and ``max_num_batched_tokens`` (the followers'
        configs were pickled at spawn, before the engine resolved them: they kept -1 for ``--max-model-len auto``
        and None for the default step budget)."""
        self._broadcast_method("set_token_limits", max_model_len, max_num_batched_tokens)

    def bytes_per_block(self) -> int:
        """Bytes of one KV block on the rank that holds the most KV heads (the cache's size in messages)."""
        return max(self._broadcast_method("bytes_per_block"))

    def init_kv_cache(self, num_blocks: int) -> None:
        self._broadcast_method("init_kv_cache", num_blocks)

    def execute(self, step: StepInput) -> torch.Tensor:
        """Send the step to every follower, run rank 0; returns rank 0's logits."""
        for conn in self.conns:
            conn.send(("execute", step))
        out = self.worker.execute(step)
        for conn in self.conns:
            if conn.poll(0):  # a follower only speaks unasked when its step failed
                self._recv(conn, 0)
        return out

    def load_weights(self, weights) -> set[str]:
        """Load full HF tensors on every rank (materialised once, sent by pipe)."""
        items = [(n, t.detach().cpu()) for n, t in weights]
        return self._broadcast_method("load_weights", items)[0]

    def collective_rpc(self, target: str, *args, timeout_s: float | None = None, **kwargs) -> list:
        """``function(worker, *args, **kwargs)`` on every rank concurrently; results in rank order."""
        for conn in self.conns:
            conn.send(("call", target, args, kwargs))
        local = self.worker.call(target, *args, **kwargs)
        return [local] + [self._recv(c, timeout_s) for c in self.conns]

    def shutdown(self) -> None:
        """Stop the follower processes (bounded wait, then terminate)."""
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except (OSError, BrokenPipeError):
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        self.conns, self.procs = [], []

    def __del__(self):
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001
            pass
