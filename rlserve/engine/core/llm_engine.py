"""The synchronous engine: add_request / step / abort (see docs/INTERFACES.md). The step itself
is in :mod:`rlserve.engine.core.engine_step`, a request's checks and queueing in
:mod:`rlserve.engine.core.request_admission`, what is decided at construction in
:mod:`rlserve.engine.core.engine_setup`."""

from __future__ import annotations

import logging
import time
from typing import Iterable

import torch

from rlserve import envs
from rlserve.config import EngineConfig
from rlserve.engine.core.block_manager import BlockManager
from rlserve.engine.core.core_tokenizer import DeferredTokenizer, load_tokenizer
from rlserve.engine.core.engine_setup import eos_token_ids, start_sampler_precompile, want_async_scheduling
from rlserve.engine.core.engine_step import EngineStep
from rlserve.engine.outputs import RequestOutput
from rlserve.engine.core.sampler import Sampler
from rlserve.engine.sampling_params import SamplingParams
from rlserve.engine.core.scheduler import Scheduler
from rlserve.engine.core.request_admission import INLINE_COMPILE_S, RequestAdmission, _arrival  # noqa: F401 (INLINE_COMPILE_S: read here by tests)
from rlserve.engine.core.sequence import Request
from rlserve.engine.core.structured import PendingGrammars
from rlserve.engine.worker import triton_precompile
from rlserve.errors import InvalidRequestError
from rlserve.kv_size import CPU_KV_CACHE_BYTES, check_cache_holds_one_sequence, fit_max_model_len
from rlserve.model_len import AUTO_MAX_MODEL_LEN, verify_max_model_len
from rlserve.startup_log import Phases, log_phase

logger = logging.getLogger(__name__)

_CPU_MAX_NUM_BATCHED_TOKENS = 1024  # the CPU default (see _default_max_num_batched_tokens)


def _cache_source(config: EngineConfig, executor) -> str:
    """The setting that sized the KV cache, as the start-up check's message names it."""
    if config.num_kv_blocks is not None:
        return f"--num-kv-blocks {config.num_kv_blocks}"
    if torch.device(executor.device).type == "cuda":
        return f"--gpu-memory-utilization {config.gpu_memory_utilization}"
    if config.kv_cache_bytes is None:
        return f"--kv-cache-bytes {CPU_KV_CACHE_BYTES} (the default)"
    return f"--kv-cache-bytes {config.kv_cache_bytes}"


def _budget_device_type(executor) -> str:
    """The executor's device type (``"cuda"``, ``"cpu"``) as the step budget's default reads it (a seam:
    tests stand a CUDA device in here on a CPU engine)."""
    return torch.device(executor.device).type


def _default_max_num_batched_tokens(device_type: str, enable_chunked_prefill: bool, max_model_len: int) -> int:
    """The step's token budget (``--max-num-batched-tokens``) when the user gave none, in tokens.

    CUDA: vLLM's server default (8192): fewer, larger prefill steps (a prefill step runs eagerly: hundreds
    of kernel launches from Python each); without chunked prefill the longest prompt must fit one step, so
    ``max(8192, max_model_len)`` -- with ``--max-model-len auto`` the length after the KV-cache fit, not the
    model's. CPU: prefill steps of ~1024 tokens keep the linears' activations in cache (a longer prompt
    still runs alone). SmolLM2-135M's 30 layers, one thread, Zen 5 (2026-12-02): 1.03 ms of CPU per token
    at 1,024 rows, 1.31 at 8,192; issue 22's 64 prompts (10,464 tokens) prefilled in 15.8 / 16.6 s of CPU
    instead of 18.1 / 20.2 (BENCHMARKS.md, issue 22, eighth session)."""
    if device_type == "cuda":
        return 8192 if enable_chunked_prefill else max(8192, max_model_len)
    return _CPU_MAX_NUM_BATCHED_TOKENS


class LLMEngine(EngineStep, RequestAdmission):
    """Continuous-batching generation engine (one data-parallel replica).

    Args:
        config: engine configuration.
        executor: optional object with ``workers``-like behaviour for tensor parallelism
            (``execute(step) -> logits``, ``collective_rpc(target, *args)``,
            ``set_token_limits(max_model_len, max_num_batched_tokens)``,
            ``determine_num_blocks()``, ``bytes_per_block()``, ``init_kv_cache(n)``, ``model``, ``hf_config``,
            ``dtype``, ``device``); default: one in-process :class:`Worker`.
        defer_tokenizer: do not load the tokenizer during construction (the engine-core process: it does not
            detokenize, see :mod:`rlserve.engine.core.core_tokenizer`): :meth:`start_tokenizer_load` loads it
            on a thread, and :attr:`tokenizer` waits for that load (or loads it) when first read.

    Raises:
        UnsupportedArchitectureError, InvalidRequestError: bad model or config.
    """

    def __init__(self, config: EngineConfig, executor=None, dp_index: int = 0, defer_tokenizer: bool = False):
        self._defer_tokenizer = defer_tokenizer
        phases = Phases(logger)
        t_init = phases.t
        self.config = config
        # a cold start: the sampler's kernels compile in other processes from here on (one GPU)
        compiling = [start_sampler_precompile(config) if executor is None else None]
        try:
            num_blocks, capture, sampler_warm_up = self._load(config, executor, dp_index, phases, compiling)
        except BaseException:  # a failed start: the compiling children end with it, not after it
            if compiling[0] is not None:
                compiling[0].kill()
            raise
        compiling, executor = compiling[0], self.executor
        phases.mark("KV cache allocation + model warm-up")
        if compiling is not None:
            compiling.wait()
            phases.mark("waiting for the sampler's kernel compilation")
        if sampler_warm_up is not None:
            sampler_warm_up()  # compile now, not in the first step
            phases.mark("sampler warm-up")
        elif torch.device(executor.device).type == "cpu":
            from rlserve.layers import cpu_argmax

            cpu_argmax.warm_up()  # the sampler's C argmax: built (or loaded) now, not in the first step
        if capture is not None:
            from rlserve.engine.routed_experts import RoutedExpertsRecorder

            self.routed_experts = RoutedExpertsRecorder(capture, num_blocks, config.block_size)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_consecutive_prefill_steps,
                                   config.max_prefill_tokens_while_decoding, config.enable_chunked_prefill,
                                   config.long_prefill_token_threshold, config.mixed_prefill_decode)
        self.eos_token_ids = eos_token_ids(config.model, lambda: self.tokenizer, self.hf_config)
        self.sampler = Sampler(self.eos_token_ids, self.vocab_size, generator_seed=config.seed,
                               logprobs_mode=config.logprobs_mode)
        self._overlap = None  # overlapped decode (rlserve.engine.core.overlap)
        if want_async_scheduling(config, executor):
            from rlserve.engine.core.overlap import OverlapScheduler

            self._overlap = OverlapScheduler(self)
        self._grammar_compiler = None  # built on the first structured-output request
        self._grammars = PendingGrammars()  # requests whose constraint compiles beside the steps
        # False: no text here (the engine-core process: the API process detokenizes, matches stop
        # strings and calls finish_sequences); each sequence then keeps its sampled tokens'
        # logprobs (Sequence.sampled_logprobs). Set before the first request.
        self.detokenize = True
        self.requests: dict[str, Request] = {}
        self.sleep_mode = None  # rlserve.engine.core.sleep_mode.EngineSleep with enable_sleep_mode
        if config.enable_sleep_mode:
            from rlserve.engine.core.sleep_mode import EngineSleep

            self.sleep_mode = EngineSleep(self)
        self.stats_counters = {
            "prefill_tokens_computed": 0,
            "decode_tokens": 0,
            "prompt_tokens": 0,
            "generation_tokens": 0,
            "steps": 0,
        }
        logger.info(
            "engine ready: %s on %s (%s), %d KV blocks of %d tokens, max_model_len %d",
            config.model, executor.device, executor.dtype, num_blocks, config.block_size, self.max_model_len,
        )
        log_phase(logger, "engine init (model, tokenizer, KV cache, warm-up)", time.perf_counter() - t_init)

    def _load(self, config: EngineConfig, executor, dp_index: int, phases, compiling: list):
        """:meth:`__init__`'s part that can fail: the executor (model), tokenizer, limits, KV cache and
        warm-up. ``compiling``: ``[the sampler's Compiling or None]``, set here when it starts here (TP).
        Returns ``(num_blocks, routed-experts capture or None, the sampler's warm-up or None)``."""
        if executor is None:
            if config.tensor_parallel_size > 1:
                from rlserve.engine.worker.tp_executor import TPExecutor

                executor = TPExecutor(config, dp_index=dp_index)
            else:
                from rlserve.engine.worker.worker import Worker

                executor = Worker(config, dp_index=dp_index)
        self.executor = executor
        self.hf_config = executor.hf_config
        phases.mark("engine executor (model loaded)")
        path = config.tokenizer or config.model
        if config.skip_tokenizer_init:
            self.tokenizer = None
        elif self._defer_tokenizer:
            self.tokenizer = DeferredTokenizer(path)  # loaded after ready (start_tokenizer_load) or when needed
        else:
            self.tokenizer = load_tokenizer(path)
            phases.mark("engine tokenizer")
        self.vocab_size = int(self.hf_config.vocab_size)
        auto_fit = config.max_model_len == AUTO_MAX_MODEL_LEN  # (vLLM's -1: cut to the KV cache below)
        config.max_model_len = verify_max_model_len(config.max_model_len, self.hf_config)
        self.max_model_len = config.max_model_len
        default_budget = config.max_num_batched_tokens is None
        if default_budget:
            config.max_num_batched_tokens = _default_max_num_batched_tokens(
                _budget_device_type(executor), config.enable_chunked_prefill, self.max_model_len)
        # (TP followers hold a copy of the config made before these were resolved)
        executor.set_token_limits(self.max_model_len, config.max_num_batched_tokens)
        if config.max_consecutive_prefill_steps is None:
            # CUDA: prefill and decode steps alternate while requests wait (a burst of 512-token
            # prompts otherwise decodes in lock-step; BENCHMARKS.md, "Time to first token");
            # CPU: prefill steps first (one costs many decode steps there: little to stagger)
            config.max_consecutive_prefill_steps = 1 if torch.device(executor.device).type == "cuda" else 0
        capture = self._routed_experts_capture(executor, config.max_num_seqs) \
            if config.enable_return_routed_experts else None
        num_blocks = executor.determine_num_blocks()
        logger.info("KV cache: %d blocks of %d tokens (--kv-cache-dtype %s)", num_blocks, config.block_size,
                    config.kv_cache_dtype)
        source = _cache_source(config, executor)
        if auto_fit:
            config.max_model_len = self.max_model_len = fit_max_model_len(
                num_blocks, config.block_size, self.max_model_len, source)
            if default_budget:  # (CUDA without chunked prefill: the budget follows the fitted length)
                config.max_num_batched_tokens = _default_max_num_batched_tokens(
                    _budget_device_type(executor), config.enable_chunked_prefill, self.max_model_len)
            executor.set_token_limits(self.max_model_len, config.max_num_batched_tokens)
        check_cache_holds_one_sequence(num_blocks, config.block_size, self.max_model_len, source,
                                       executor.bytes_per_block())
        phases.mark("KV cache sizing")
        sampler_warm_up = self._sampler_warm_up(executor)
        # a cold start: the sampler's kernels compile in other processes during the model's warm-up
        # (started above already for one GPU; TP: from here)
        if compiling[0] is None and sampler_warm_up is not None and envs.RLSERVE_TRITON_PRECOMPILE:
            compiling[0] = triton_precompile.precompile(sampler_warm_up, executor.device, max_workers=4, wait=False)
        executor.init_kv_cache(num_blocks)
        return num_blocks, capture, sampler_warm_up

    def _sampler_warm_up(self, executor):
        """On CUDA, the one-pass sampler's warm-up (``fused_sampling.warm_up`` over logits in float32 and
        the model dtype, the dtype they come in) as a callable; None elsewhere."""
        if torch.device(executor.device).type != "cuda":
            return None
        from rlserve.engine.core import fused_sampling

        dtypes = (torch.float32,) + ((executor.dtype,) if executor.dtype.is_floating_point else ())
        return lambda: fused_sampling.warm_up(executor.device, self.vocab_size, dtypes)

    @staticmethod
    def _routed_experts_capture(executor, max_num_seqs: int):
        """The rank-0 model's routed-experts capture, switched on (replay; the router is
        replicated, so rank 0 sees every token's routing), with a buffer of ``max_num_seqs``
        rows for the decode CUDA graphs.

        Raises:
            InvalidRequestError: the model has no routed experts.
        """
        enable = getattr(executor.model, "enable_routed_experts_capture", None)
        if enable is None:
            archs = getattr(executor.hf_config, "architectures", None)
            raise InvalidRequestError(f"enable_return_routed_experts needs a mixture-of-experts model; {archs} has "
                                      "no routed experts")
        return enable(reserve_rows=max_num_seqs)

    # ---- properties -------------------------------------------------------------------
    @property
    def tokenizer(self):
        """The Hugging Face tokenizer, or None (``skip_tokenizer_init``); with ``defer_tokenizer``, reading it
        waits for (or does) the load. Raises what loading it raised."""
        tok = self._tokenizer
        if isinstance(tok, DeferredTokenizer):
            tok = self._tokenizer = tok.get()
        return tok

    @tokenizer.setter
    def tokenizer(self, value) -> None:
        self._tokenizer = value

    @property
    def has_tokenizer(self) -> bool:
        """Whether the engine has a tokenizer (not ``skip_tokenizer_init``), without waiting for a deferred load."""
        return self._tokenizer is not None

    def start_tokenizer_load(self) -> None:
        """With ``defer_tokenizer``: start loading the tokenizer on a background thread (the engine-core process
        calls this after its ready message). Otherwise nothing."""
        if isinstance(self._tokenizer, DeferredTokenizer) and not self._tokenizer.loaded:
            self._tokenizer.start()

    @property
    def model(self):
        return self.executor.model

    @property
    def device(self) -> torch.device:
        return self.executor.device

    @property
    def dtype(self) -> torch.dtype:
        return self.executor.dtype

    @property
    def stats(self) -> dict:
        """Counters and gauges: running, waiting, KV usage, prefix-cache hits, ..."""
        return {
            **self.stats_counters,
            "num_running": self.scheduler.num_running,
            "num_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": self.block_manager.usage(),
            "num_kv_blocks": self.block_manager.num_blocks,
            "prefix_cache_hit_tokens": self.block_manager.prefix_hit_tokens,
            "prefix_cache_query_tokens": self.block_manager.prefix_queries,
            "num_preemptions": self.scheduler.num_preemptions,
        }

    # ---- requests ---------------------------------------------------------------------
    def abort_request(self, request_id: str | Iterable[str]) -> list[RequestOutput]:
        """Abort requests (unknown ids are ignored). Returns their final outputs with
        finish_reason "abort" (a request that the overlapped step drained here finished
        anyway: its real final output instead)."""
        self._drain()
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        outs = []
        pending = self._overlap.pending if self._overlap is not None else None
        if pending:  # outputs the drain left for these ids: the finished ones are their answer
            want = set(ids)
            outs = [o for o in pending if o.request_id in want and o.finished]
            self._overlap.pending = [o for o in pending if o.request_id not in want]
        for rid in ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            self._grammars.discard(rid)
            for s in req.seqs:
                if not s.is_finished:
                    s.finish_reason = "abort"
                    s.detokenizer.finish()
                    self._release(s)
            outs.append(self._make_output(req))
        return outs

    def abort_all(self) -> list[RequestOutput]:
        return self.abort_request(list(self.requests))

    def finish_sequences(self, request_id: str, indices: Iterable[int], reason: str = "stop") -> list[RequestOutput]:
        """Finish samples ``indices`` of a request from outside a step, with ``finish_reason``
        ``reason`` (the API process matched a stop string in their text). Unknown ids and
        finished samples are ignored. Returns the request's final output when that finished
        it (the request is then gone), else ``[]``."""
        self._drain()
        req = self.requests.get(request_id)
        if req is None:
            return []
        wanted = set(indices)
        for s in req.seqs:
            if s.index in wanted and not s.is_finished:
                s.finish_reason = reason
                self._release(s)
        if not req.finished:
            return []
        del self.requests[request_id]
        return [self._make_output(req)]

    def has_unfinished_requests(self) -> bool:
        """Requests still running, or outputs not yet returned (an overlapped step finished
        by a drain, e.g. inside an abort or an RPC, hands its outputs to the next ``step``)."""
        return bool(self.requests) or (self._overlap is not None and bool(self._overlap.pending))

    def reset_prefix_cache(self) -> None:
        """Forget cached prefixes (their KV would be stale after a weight update)."""
        self._drain()
        self.block_manager.reset_prefix_cache()

    # ---- weights ----------------------------------------------------------------------
    def load_weights(self, weights) -> set[str]:
        """Load Hugging Face-named full tensors into the model (TP=1 path) and reset the
        prefix cache. Returns the consumed names."""
        self._drain()
        if self.sleep_mode is not None:
            self.sleep_mode.check_weights_writable()
        names = self.executor.load_weights(weights)
        # what every weight-sync path does after writing weights: derived state (fp8 scales,
        # CPU packed linear weights) follows the new values
        rpc = getattr(self.executor, "collective_rpc", None) or self.executor.call
        rpc("rlserve.loader.model_loader:process_worker_weights")
        self.reset_prefix_cache()
        if self.sleep_mode is not None:
            self.sleep_mode.note_weights_loaded()
        return names

    # ---- sleep mode (rlserve.engine.core.sleep_mode; needs enable_sleep_mode) ---------------
    def _sleep(self):
        if self.sleep_mode is None:
            from rlserve.errors import SleepStateError

            raise SleepStateError("sleep mode is off: build the engine with enable_sleep_mode=True",
                                  code="sleep_mode_disabled")
        return self.sleep_mode

    def sleep(self, level: int = 1) -> dict:
        """Give the GPU memory of the weights and KV cache back (level 1: weights to host
        memory; level 2: weights discarded). See :meth:`EngineSleep.sleep`."""
        return self._sleep().sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> dict:
        """Take the memory of ``tags`` (``"weights"``, ``"kv_cache"``; default both) back. See
        :meth:`EngineSleep.wake_up`."""
        return self._sleep().wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.sleep_mode is not None and self.sleep_mode.is_sleeping()

    def checkpoint_spec(self) -> dict[str, tuple[int, ...]]:
        return self.model.checkpoint_spec()

    def required_checkpoint_names(self) -> set[str]:
        return self.model.required_checkpoint_names()

    def tied_checkpoint_names(self) -> dict[str, str]:
        return self.model.tied_checkpoint_names()

    def collective_rpc(self, target: str, *args, timeout_s: float | None = None, **kwargs) -> list:
        """Run ``function(worker, *args, **kwargs)`` on every TP worker (see INTERFACES)."""
        self._drain()
        if hasattr(self.executor, "collective_rpc"):
            return self.executor.collective_rpc(target, *args, timeout_s=timeout_s, **kwargs)
        return [self.executor.call(target, *args, **kwargs)]

    def generate_blocking(self, prompts: list, params: list[SamplingParams], progress: bool = False) -> list[RequestOutput]:
        """Run ``prompts`` to completion (the offline path). Returns outputs in input order."""
        from tqdm.auto import tqdm

        ids = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                rid = f"offline-{next(_arrival)}-{i}"
                self.add_request(rid, p, sp)
                ids.append(rid)
        except Exception:
            self.abort_request(ids)  # all or nothing
            raise
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), disable=not progress, desc="generate", unit="req")
        t0 = time.perf_counter()
        wanted = set(ids)
        while len(final) < len(ids):
            for o in self.step(outputs_for=()):
                if o.finished and o.request_id in wanted:
                    final[o.request_id] = o
                    bar.update(1)
        bar.close()
        logger.debug("generated %d requests in %.2fs", len(ids), time.perf_counter() - t0)
        return [final[r] for r in ids]
