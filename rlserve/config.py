"""Engine configuration (validated dataclasses). Field names follow vLLM's engine args."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rlserve.errors import InvalidRequestError

#: what a step's logprobs hold (vLLM's ``--logprobs-mode`` choices; the sampler's module docstring says each)
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")

if TYPE_CHECKING:
    import torch

# dtype name -> torch's attribute. No torch import here: `rlserve serve`'s API process builds its
# EngineConfig and hands it to the engine-core process before it imports torch (start-up, issue 37)
_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
#: the names ``--dtype`` / ``EngineConfig.dtype`` accept besides "auto"
DTYPE_NAMES = tuple(_DTYPES)


#: the ``max_lora_rank`` values vLLM accepts (``vllm.config.lora.MaxLoRARanks``)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def resolve_device(device: str) -> torch.device:
    """``"auto"`` → ``cuda`` when available, else ``cpu``; anything else is passed to torch."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, hf_config=None) -> torch.dtype:
    """Map a dtype name to a torch dtype.

    ``"auto"`` takes the checkpoint's ``torch_dtype`` on GPU (float32 checkpoints are served
    in bfloat16 there, as vLLM does) and float32 on CPU.

    Raises:
        InvalidRequestError: for an unknown name.
    """
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        ckpt = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
        if isinstance(ckpt, str):
            ckpt = getattr(torch, _DTYPES[ckpt]) if ckpt in _DTYPES else None
        if ckpt in (torch.bfloat16, torch.float16):
            return ckpt
        return torch.bfloat16
    if dtype not in _DTYPES:
        raise InvalidRequestError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(sorted(_DTYPES))}")
    return getattr(torch, _DTYPES[dtype])


@dataclass
class EngineConfig:
    """Everything the engine needs to start.

    Attributes:
        model: path of a Hugging Face model directory (config.json + safetensors).
        tokenizer: tokenizer path (defaults to ``model``).
        dtype: "auto", "float32", "bfloat16" or "float16".
        device: "auto", "cpu", "cuda" or "cuda:N".
        load_format: "auto" (safetensors, else .bin/.pt), "safetensors", "pt" or "dummy"
            (random weights of the right shapes).
        max_model_len: context length in tokens (prompt + output); default: the model's
            ``max_position_embeddings`` capped at 8192; -1 (vLLM's auto-fit): the model's, cut to the
            tokens the KV cache holds (:func:`rlserve.kv_size.fit_max_model_len`).
        max_num_seqs: sequences in one batch at most.
        max_num_batched_tokens: tokens in one forward step at most (default 8192 on CUDA,
            vLLM's server default (``max(8192, max_model_len)`` without chunked prefill); 1024 on
            CPU). A prompt longer than that is prefilled in chunks over several steps (without
            chunked prefill: alone in one step).
        max_consecutive_prefill_steps: prefill steps in a row at most while sequences are
            running, then a decode step (1: they alternate while requests wait; 0: no bound,
            prefill steps first whenever a request can start). Default: 1 on CUDA (measured:
            BENCHMARKS.md, "Time to first token"), 0 on CPU (a CPU prefill step costs many decode
            steps, so alternating staggers little; not measured as a default there). rlserve's
            own knob: vLLM mixes every running request's decode token into its prefill steps
            instead (:mod:`rlserve.engine.core.scheduler` says why the bound exists).
        max_prefill_tokens_while_decoding: tokens of a prefill step at most while a streamed
            request decodes (``--max-prefill-tokens-while-decoding``; capped at
            ``max_num_batched_tokens``; a longer prompt still runs alone). None (default): 2048
            (:data:`rlserve.engine.core.scheduler.DECODING_PREFILL_TOKENS`); set it to
            ``max_num_batched_tokens`` for the policy before session 15.
        enable_chunked_prefill: split a prompt's prefill over steps in chunks of at most a
            step's token budget (vLLM's ``--enable-chunked-prefill``; :mod:`rlserve.engine.core.scheduler`).
            Off by default since session 17 (on in vLLM V1): measured slower on an H100 in session 17's
            window 1 (chunked 3,365 tok/s, mean TTFT 349 ms, p99 ITL 44.5 ms against 4,522 / 263 / 35.1
            unchunked; BENCHMARKS.md, "HTTP serving"); off, a prompt longer than the step's budget runs
            alone in one step (on CUDA ``max_num_batched_tokens`` then defaults to max(8192, max_model_len)).
        long_prefill_token_threshold: with chunked prefill, tokens of one prompt's chunk at most
            (vLLM's ``--long-prefill-token-threshold``); 0 (default): the step's budget.
        mixed_prefill_decode: a prefill step while requests decode also carries every running
            request's decode token (vLLM's mixed steps; ``--mixed-prefill-decode``): the streams
            wait one eager step instead of a prefill step plus a decode step. Off (default): prefill
            and CUDA-graph decode steps stay apart (:mod:`rlserve.engine.core.scheduler`).
        block_size: tokens per KV-cache block.
        num_kv_blocks: force the KV-cache size in blocks (tests use it to force preemption).
        kv_cache_bytes: KV-cache size in bytes on CPU (default 512 MiB).
        gpu_memory_utilization: fraction of GPU memory the engine may use (weights + KV); default
            0.92, vLLM's (``vllm/config/cache.py``, 0.24 and 0.32).
        enable_prefix_caching: reuse KV blocks of identical prompt prefixes.
        kv_cache_dtype: the KV cache's dtype, vLLM's ``--kv-cache-dtype``: "auto" (the model's),
            "fp8" (= "fp8_e4m3"), "fp8_e4m3" or "fp8_e5m2": one byte per element, so twice the
            blocks of a bf16 cache in the same memory (:mod:`rlserve.layers.kv_quant`).
        calculate_kv_scales: with an fp8 cache, set each layer's ``k_scale`` / ``v_scale`` from the
            first batch (vLLM's ``--calculate-kv-scales``); otherwise they are 1.0. No effect with
            "auto" (no scales).
        enforce_eager: no CUDA graphs.
        seed: global seed (dummy weights, unseeded sampling).
        tensor_parallel_size / data_parallel_size: parallelism.
        device_ids: GPUs to use (one per TP rank per replica), e.g. [0, 1].
        quantization: None or "fp8" (online W8A8).
        max_logprobs: largest ``logprobs`` a request may ask for; -1: no limit (vLLM's
            meaning; a request may then also ask -1 = the whole vocabulary).
        logprobs_mode: what logprobs hold: "raw_logprobs" (default), "raw_logits",
            "processed_logprobs" (after penalties, temperature, top-k/top-p/min-p: the
            distribution the token was drawn from) or "processed_logits" (vLLM's
            ``--logprobs-mode``; see :mod:`rlserve.engine.core.sampler`).
        skip_tokenizer_init: no tokenizer: prompts must be token ids, outputs carry token ids
            only (empty text), stop strings are refused. For benchmarks and token-in/token-out
            RL loops.
        enable_sleep_mode: weights and KV cache in releasable memory, so ``sleep(level)`` /
            ``wake_up(tags)`` can give the GPU memory back (vLLM's ``--enable-sleep-mode``;
            :mod:`rlserve.engine.core.sleep_mode`).
        enable_lora / max_loras / max_lora_rank: serve LoRA adapters (vLLM's ``--enable-lora``,
            ``--max-loras``, ``--max-lora-rank``; :mod:`rlserve.lora`): at most ``max_loras``
            adapters loaded at once (every one may be in every batch), each of rank at most
            ``max_lora_rank`` (one of vLLM's values :data:`LORA_RANKS`). Tensor parallel size 1.
        async_scheduling: overlapped decode (vLLM's ``async_scheduling``): step N+1 is
            scheduled and launched before step N's tokens are read
            (:mod:`rlserve.engine.core.overlap`). None (default): on for a single-process CUDA
            engine (TP=1), off elsewhere; the environment variable
            ``RLSERVE_ASYNC_SCHEDULING=0/1`` decides when this field is None.
        batch_invariant: vLLM's batch-invariant mode (``--batch-invariant``; also on with the
            environment variable ``VLLM_BATCH_INVARIANT=1``): a request's tokens and logprobs are
            bitwise the same whatever else shares its steps, prefix-cache hits and chunking
            included (:mod:`rlserve.batch_invariant`). CPU: float32 only.
        enable_return_routed_experts: every sample's final output carries ``routed_experts``,
            the expert ids its tokens were routed to (vLLM's ``--enable-return-routed-experts``;
            mixture-of-experts models only; :mod:`rlserve.engine.routed_experts`). Turns CUDA
            graphs off.
    """

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    load_format: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_consecutive_prefill_steps: int | None = None
    max_prefill_tokens_while_decoding: int | None = None
    enable_chunked_prefill: bool = False
    long_prefill_token_threshold: int = 0
    mixed_prefill_decode: bool = False
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.92
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    enforce_eager: bool = False
    seed: int = 0
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    device_ids: list[int] | None = None
    quantization: str | None = None
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    skip_tokenizer_init: bool = False
    enable_sleep_mode: bool = False
    async_scheduling: bool | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    enable_return_routed_experts: bool = False
    batch_invariant: bool = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises InvalidRequestError naming the bad field."""
        if self.load_format not in ("auto", "safetensors", "pt", "dummy"):
            raise InvalidRequestError(f"load_format must be auto, safetensors, pt or dummy, got {self.load_format!r}")
        if self.max_num_seqs < 1:
            raise InvalidRequestError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            # (0 scheduled no prefill step ever: every request waited forever)
            raise InvalidRequestError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_consecutive_prefill_steps is not None and self.max_consecutive_prefill_steps < 0:
            raise InvalidRequestError("max_consecutive_prefill_steps must be >= 0 (0: no bound), "
                                      f"got {self.max_consecutive_prefill_steps}")
        if self.max_prefill_tokens_while_decoding is not None and self.max_prefill_tokens_while_decoding < 1:
            raise InvalidRequestError("max_prefill_tokens_while_decoding must be >= 1, "
                                      f"got {self.max_prefill_tokens_while_decoding}")
        if self.long_prefill_token_threshold < 0:
            raise InvalidRequestError("long_prefill_token_threshold must be >= 0 (0: no bound), "
                                      f"got {self.long_prefill_token_threshold}")
        if self.block_size < 1:
            raise InvalidRequestError("block_size must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidRequestError("gpu_memory_utilization must be in (0, 1]")
        if self.tensor_parallel_size < 1 or self.data_parallel_size < 1:
            raise InvalidRequestError("parallel sizes must be >= 1")
        if self.kv_cache_dtype != "auto":  # (kv_quant imports torch: only for the other values)
            from rlserve.layers.kv_quant import KV_CACHE_DTYPES
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} (vLLM's "
                                      f"values), got {self.kv_cache_dtype!r}")
        if self.quantization not in (None, "fp8"):
            raise InvalidRequestError(f"quantization must be None or 'fp8', got {self.quantization!r}")
        if self.max_logprobs < -1:
            raise InvalidRequestError(f"max_logprobs must be >= -1 (-1: no limit), got {self.max_logprobs}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise InvalidRequestError("logprobs_mode must be raw_logprobs, raw_logits, processed_logprobs or "
                                      f"processed_logits, got {self.logprobs_mode!r}")
        if self.max_loras < 1:
            raise InvalidRequestError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank not in LORA_RANKS:
            raise InvalidRequestError(f"max_lora_rank must be one of {', '.join(map(str, LORA_RANKS))} (vLLM's values), "
                                      f"got {self.max_lora_rank}")
        if self.enable_lora and self.tensor_parallel_size != 1:
            raise InvalidRequestError("--enable-lora needs --tensor-parallel-size 1 in this version")
        if self.max_model_len is not None and self.max_model_len < 1 and self.max_model_len != -1:
            raise InvalidRequestError("max_model_len must be >= 1, or -1 (the model's length cut to the KV cache)")
