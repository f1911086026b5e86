"""One tensor-parallel rank: model, KV cache and model runner (see docs/INTERFACES.md)."""

from __future__ import annotations

import importlib
import logging

import torch
from transformers import AutoConfig

from rlserve.config import EngineConfig, resolve_device, resolve_dtype
from rlserve.distributed.parallel_state import tp_context
from rlserve.layers.attention import get_attention_backend
from rlserve.engine.worker import prefill_graphs as pg
from rlserve.engine.worker.model_runner import ModelRunner, StepInput, kv_cache_bytes_per_block
from rlserve.errors import InvalidRequestError
from rlserve.kv_size import CPU_KV_CACHE_BYTES, blocks_for
from rlserve.lora import lora_of
from rlserve.distributed.head_partition import attention_head_partition

logger = logging.getLogger(__name__)

# Memory kept free on GPU for activations beyond the measured profile peak.
_GPU_HEADROOM_BYTES = 512 * 1024**2


def resolve_rpc_target(target: str):
    """``"package.module:function"`` → the function.

    Raises:
        ValueError: malformed target; ImportError / AttributeError: not found.
    """
    if ":" not in target:
        raise ValueError(f"rpc target must look like 'package.module:function', got {target!r}")
    mod, fn = target.split(":", 1)
    return getattr(importlib.import_module(mod), fn)


class Worker:
    """Owns one TP rank's model, KV cache and runner.

    Args:
        config: engine configuration.
        tp_rank / tp_size: this rank and the TP size (the TP group is set up by the caller
            through ``rlserve.distributed.parallel_state`` before construction).
        dp_index: data-parallel replica index.
        device: torch device for this rank (default: from ``config.device``).
    """

    def __init__(
        self, config: EngineConfig, tp_rank: int = 0, tp_size: int = 1, dp_index: int = 0, device=None, tp_group=None
    ):
        from rlserve.loader import load_model
        from rlserve.startup_log import Phases

        phases = Phases(logger)
        self.config = config
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.tp_group = tp_group
        self.dp_index = dp_index
        self.transfer_rank = 1 + dp_index * tp_size + tp_rank
        self.device = torch.device(device) if device is not None else resolve_device(config.device)
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
            torch.cuda.synchronize(self.device)  # the CUDA context exists from here: its own line below
            phases.mark(f"CUDA init ({self.device})")
        if self.device.type == "cpu":
            from rlserve.engine.cpu.cpu_malloc import tune_malloc
            from rlserve.engine.cpu.cpu_threads import configure_engine_threads

            from rlserve.layers import cpu_gemm

            configure_engine_threads(config)  # this thread runs the forward passes
            cpu_team = cpu_gemm.current()  # this engine's (the runner makes it current for every step)
            tune_malloc()  # keep freed step tensors instead of faulting them in again
        self.hf_config = AutoConfig.from_pretrained(config.model)
        phases.mark("model config (AutoConfig)")
        self.dtype = resolve_dtype(config.dtype, self.device, self.hf_config)
        self.extension_state: dict = {}
        torch.manual_seed(config.seed)
        with self.tp():
            self.model = load_model(config, self.hf_config, self.device, self.dtype)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the dummy weights' kernels included
            phases.mark("model build + weights", f"load format {config.load_format}, {self.dtype}")
            if getattr(config, "enable_lora", False):
                from rlserve.lora.model import LoRAModel

                LoRAModel.install(self.model, config.max_lora_rank, self.dtype, self.device, config.max_loras)
        self.sleep = None  # sleep mode's memory regions (rlserve.engine.worker.sleep_memory)
        if config.enable_sleep_mode:
            from rlserve.engine.worker.sleep_memory import WorkerSleep

            self.sleep = WorkerSleep(self)  # on CUDA: the parameters move into a VMM arena now
        self.runner = ModelRunner(self.model, self.device, self.dtype, config.block_size, config=config)
        if self.device.type == "cpu":
            self.runner.cpu_team = cpu_team

    #: ``execute`` accepts ``StepInput.input_ids_from`` (device tensors: in-process only).
    supports_device_input_ids = True

    def tp(self):
        """Context manager: this worker's TP state for the current thread."""
        return tp_context(self.tp_rank, self.tp_size, self.tp_group)

    def set_token_limits(self, max_model_len: int, max_num_batched_tokens: int) -> None:
        """Take the engine's resolved token limits: ``max_model_len`` (``--max-model-len auto`` / -1 resolved to
        the model's length, then cut to the KV cache) and ``max_num_batched_tokens`` (None resolved to the
        device's default): a TP follower's config is a copy made before rank 0 resolved them
        (:meth:`rlserve.engine.worker.tp_executor.TPExecutor.set_token_limits`), and its KV sizing (activation
        estimate) and warm-up read them."""
        self.config.max_model_len = int(max_model_len)
        self.config.max_num_batched_tokens = int(max_num_batched_tokens)

    # ---- KV cache sizing -------------------------------------------------------------
    def bytes_per_block(self) -> int:
        return kv_cache_bytes_per_block(self.model, self.config.block_size, self.runner.kv_cache_dtype)

    def determine_num_blocks(self) -> int:
        """Number of KV blocks this rank can hold.

        ``config.num_kv_blocks`` wins; on CPU ``config.kv_cache_bytes`` (default 512 MiB, at most
        ``max_num_seqs`` sequences of ``max_model_len`` tokens);
        on GPU, ``gpu_memory_utilization`` x total memory minus what is in use after loading
        the weights, minus 512 MiB of activation headroom and, with the LoRA one-adapter fast path
        on, the memory a merge holds (:func:`rlserve.lora.merge.kv_budget`, which also decides
        ``RLSERVE_LORA_MERGE=auto``), and with the prefill CUDA graphs on, what they will hold once
        captured after the cache (:func:`rlserve.engine.worker.prefill_graphs.kv_reserve`: under the default,
        nothing and the graphs off where that is more than a tenth of the cache's budget).

        Raises:
            InvalidRequestError: not one block fits (a setting: ``rlserve serve`` exits 2).
        """
        if self.config.num_kv_blocks is not None:
            lora = lora_of(self.model)
            if lora is not None and lora.merge is not None and lora.merge.auto:
                lora.merge = None  # (auto: the memory left beside a set KV size is not known)
            return self.config.num_kv_blocks
        per_block = self.bytes_per_block()
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * self.config.gpu_memory_utilization) - used - _GPU_HEADROOM_BYTES
            budget -= self._activation_estimate()
            budget -= pg.kv_reserve(self.runner, budget)  # (the decode graphs reserve nothing: a few MiB)
            lora = lora_of(self.model)
            if lora is not None and lora.merge is not None:
                from rlserve.lora.merge import kv_budget

                mml = self.config.max_model_len
                budget = kv_budget(lora, budget, per_block,
                                   self.config.max_num_seqs * blocks_for(mml, self.config.block_size) if mml else None)
        else:
            budget = self.config.kv_cache_bytes or CPU_KV_CACHE_BYTES
        n = budget // per_block
        if self.device.type == "cpu" and self.config.kv_cache_bytes is None and self.config.max_model_len:
            # the default budget, never more than every sequence of a full batch at full length
            # can use: a small model's 512 MiB would be tens of thousands of blocks that take
            # seconds to zero and to index at start-up and to free at exit
            n = min(n, self.config.max_num_seqs * blocks_for(self.config.max_model_len, self.config.block_size))
        if n < 1:
            fix = ("raise --kv-cache-bytes to at least one block" if self.device.type == "cpu"
                   else "raise --gpu-memory-utilization or lower --max-model-len")
            raise InvalidRequestError(  # (a setting, a ValueError: vLLM's "No available memory for the cache blocks")
                f"no memory left for the KV cache ({budget} bytes for blocks of {per_block} bytes); {fix}"
            )
        return int(n)

    def _activation_estimate(self) -> int:
        """Bytes of activations for a prefill of ``max_num_batched_tokens`` tokens: logits
        rows are few, so the largest terms are the MLP intermediate (x2 for gate/up) and the
        attention scores of the torch backend (heads x tokens^2 for one long prompt, float32;
        the Triton backend streams over tiles and materialises none)."""
        cfg = self.hf_config
        t = self.config.max_num_batched_tokens or 2048
        inter = getattr(cfg, "intermediate_size", None) or getattr(cfg, "ffn_dim", 4 * cfg.hidden_size)
        q = cfg.num_attention_heads
        heads = attention_head_partition(q, getattr(cfg, "num_key_value_heads", None) or q, self.tp_size,
                                         self.tp_rank)[1]  # this rank's query heads (may be uneven)
        item = torch.tensor([], dtype=self.dtype).element_size()
        mlp = 3 * t * inter // self.tp_size * item
        scores = heads * min(t, self.config.max_model_len or t) ** 2 * 4 if get_attention_backend() == "torch" else 0
        return int(mlp + scores)

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache, then warm up (compile kernels, capture the decode CUDA
        graphs: :meth:`ModelRunner.warm_up`) so the first request does not pay for it. In
        sleep mode the cache is cut out of a releasable arena."""
        alloc = self.sleep.kv_allocator(num_blocks * self.bytes_per_block()) if self.sleep is not None else None
        self.runner.allocate_kv_cache(num_blocks, alloc=alloc)
        with self.tp():
            self.warm_up_seconds = self.runner.warm_up()
        if getattr(self.config, "calculate_kv_scales", False):
            self.runner.arm_kv_scale_calculation()

    # ---- execution --------------------------------------------------------------------
    def execute(self, step: StepInput) -> torch.Tensor:
        """Run one step; returns logits ``[len(step.logits_indices), vocab]`` in the model dtype
        (:meth:`ModelRunner.execute`)."""
        with self.tp():
            return self.runner.execute(step)

    def call(self, target: str, *args, **kwargs):
        """Run ``function(self, *args, **kwargs)`` for the ``"module:function"`` target,
        inside this worker's TP context, on the base weights (an adapter merged by the LoRA
        fast path is taken out first: :mod:`rlserve.lora.merge`)."""
        self._unmerge_lora()
        with self.tp():
            return resolve_rpc_target(target)(self, *args, **kwargs)

    def load_weights(self, weights) -> set[str]:
        """``model.load_weights`` inside this worker's TP context (each rank keeps its shard),
        into the base weights (as :meth:`call`)."""
        self._unmerge_lora()
        with self.tp():
            return self.model.load_weights(weights)

    def _unmerge_lora(self) -> None:
        lora = lora_of(getattr(self, "model", None))
        if lora is not None and lora.merge is not None:
            lora.merge.restore()
