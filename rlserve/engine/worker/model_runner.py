"""Turns a scheduled batch into model inputs, owns the KV cache, runs the forward pass.

Everything a step needs crosses process boundaries as a :class:`StepInput` of plain
Python lists, so tensor-parallel workers run the same step from a pickled copy.

On CUDA the runner also picks the attention backend and replays decode steps from CUDA
graphs (:mod:`rlserve.engine.worker.cuda_graph`):

- backend: ``RLSERVE_ATTENTION_BACKEND`` (env) or ``config.extra["attention_backend"]``
  when set, else ``"triton"`` when Triton is importable, else ``"torch"``. On CPU nothing
  changes (the torch backend, unless the variable names another).
- CUDA graphs: on when the device is CUDA, ``config.enforce_eager`` is False, the backend
  is graph-safe (``"triton"``) and TP size is 1
  (TP > 1 needs ``RLSERVE_CUDA_GRAPH_TP=1``: capturing the NCCL all-reduce of the TP
  group is untested). Graphs are captured at startup (:meth:`ModelRunner.warm_up`, called by
  the worker once the KV cache exists; again lazily at the next decode step after the cache
  is re-allocated), for the batch sizes of :func:`rlserve.engine.worker.cuda_graph.capture_sizes` or those listed in
  ``config.extra["cuda_graph_sizes"]`` / ``RLSERVE_CUDA_GRAPH_SIZES`` (e.g. ``"1,64,256"``);
  a batch larger than the largest captured size runs eagerly.
- prefill / mixed steps as piecewise CUDA graphs (``RLSERVE_PREFILL_CUDA_GRAPHS``, on by default since
  session 21, ``0``: off; :mod:`rlserve.engine.worker.prefill_graphs`): everything but attention replayed
  from graphs of token buckets, for dense Llama-family models on one GPU with CUDA graphs on
  (:func:`~rlserve.engine.worker.prefill_graphs.why_off`: where not, the start-up log says why); captured
  at the warm-up (lazily at the first prefill step after the cache is re-allocated).

On CPU the runner makes the step's micro-batches current (:mod:`rlserve.engine.cpu.cpu_microbatch`:
two on a 2-core machine): the model splits its sequences between them, the runner the LM
head's rows (none below 16 rows).
"""

from __future__ import annotations

import inspect
import logging
import time

import torch
from torch import nn

from rlserve import envs
from rlserve.batch_invariant import cpu as bi_cpu, mode as bi_mode
from rlserve.engine.cpu import cpu_microbatch
from rlserve.engine.worker.cuda_graph import DecodeCUDAGraphs, specialization_representatives
from rlserve.engine.worker import jit_warmup, prefill_graphs as pg
from rlserve.engine.worker.step_input import StepInput
from rlserve.h2d import fill_rows, gather_rows, to_device
from rlserve.layers import cpu_gemm, cpu_hugepages, kv_quant
from rlserve.layers.attention import Attention, AttentionMetadata, get_attention_backend, set_attention_backend
from rlserve.lora import lora_of
from rlserve.model_len import verify_max_model_len

logger = logging.getLogger(__name__)

# Backends whose KV write and decode attention can be captured in a CUDA graph.
GRAPH_SAFE_BACKENDS = {"triton"}


def kv_cache_bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes across all layers of this rank: 2 (K and V) x layers x
    block_size x kv_heads x head_dim x itemsize (``dtype``: the cache's, 1 byte for fp8)."""
    total = 0
    for m in model.modules():
        if isinstance(m, Attention):
            total += 2 * block_size * m.num_kv_heads * m.head_dim * torch.tensor([], dtype=dtype).element_size()
    return total


class ModelRunner:
    """Runs the model for one TP rank.

    Args:
        model: a model following the contract in docs/INTERFACES.md.
        device / dtype: where the model and KV cache live.
        block_size: tokens per KV block.
        config: the engine config (``enforce_eager``, ``max_num_seqs``, ``max_model_len``,
            ``tensor_parallel_size``, ``extra["attention_backend"]``); without one, no CUDA
            graphs are used.
    """

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype, block_size: int, config=None):
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.config = config
        self.attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        # the KV cache's dtype (--kv-cache-dtype: the model's, or fp8 with per-layer scales)
        self.kv_cache_dtype = kv_quant.cache_dtype(getattr(config, "kv_cache_dtype", "auto") or "auto", dtype)
        self.num_blocks = 0
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.cuda_graphs = None  # DecodeCUDAGraphs once captured
        self.lora_graphs = None  # DecodeCUDAGraphs of decode steps with LoRA adapters (kernel path)
        self._graphs_failed = False
        self.prefill_graphs = None  # prefill_graphs.PrefillCUDAGraphs once captured
        self._prefill_graphs_off: str | None = None  # why prefill steps stay eager (set once decided)
        self._prefill_graphs_reserve: int | None = None  # their bytes, once (prefill_graphs.reserve_once)
        self.precompile_stats = None  # rlserve.engine.worker.triton_precompile's stats of the warm-up
        # logits in the model dtype where the model offers it (no float32 copy of [B, V]; the
        # samplers widen what they read)
        fn = getattr(model, "compute_logits", None)
        self._logits_kw = ({"float32": False} if fn is not None and "float32" in inspect.signature(fn).parameters
                           else {})
        # --batch-invariant (rlserve.batch_invariant): set again before every step (execute)
        self.batch_invariant = bi_mode.from_config(config)
        if self.batch_invariant:
            bi_mode.check_config_supported(config, getattr(model, "config", None))
        if self.batch_invariant and device.type == "cpu":
            bi_cpu.check_engine_supported(dtype)
        bi_mode.set_enabled(self.batch_invariant)
        self._select_backend()
        if self.batch_invariant and device.type == "cuda" and get_attention_backend() != "triton":
            raise ValueError("--batch-invariant on CUDA needs the triton attention backend (Triton installed, "
                             f"RLSERVE_ATTENTION_BACKEND unset or 'triton'), got {get_attention_backend()!r}")
        if self.batch_invariant:
            logger.info("batch-invariant mode on (%s): a request's tokens and logprobs do not depend on the rest "
                        "of the batch (docs/batch_invariant.md)", device.type)
        self.use_cuda_graphs = self._want_cuda_graphs()
        # CPU: steps (sequences) and the LM head (rows) split into micro-batches on threads
        self.microbatches = None
        self.cpu_team = None  # the engine's CPU team (rlserve.layers.cpu_gemm), set by the worker
        if device.type == "cpu":
            n = cpu_microbatch.microbatch_count(config, torch.get_num_threads())
            if n > 1:
                self.microbatches = cpu_microbatch.CPUMicroBatches(n, threads=torch.get_num_threads())
                logger.info("CPU steps of >= %d rows split into %d micro-batches", self.microbatches.min_rows, n)
            else:
                logger.info("CPU steps run whole (1 micro-batch: RLSERVE_CPU_MICROBATCHES=1, several intra-op "
                            "threads, several engine ranks, or one usable CPU)")

    # ---- GPU fast path: backend choice and CUDA graphs ---------------------------------
    def _select_backend(self) -> None:
        """Pick the attention backend (see the module docstring). CPU runners leave the
        process-wide choice alone unless asked explicitly."""
        extra = getattr(self.config, "extra", None) or {}
        name = envs.RLSERVE_ATTENTION_BACKEND or extra.get("attention_backend")
        if name is None and self.device.type != "cuda":
            return
        if name in (None, "triton"):
            from rlserve.layers import triton_attention

            if triton_attention.register() and triton_attention.is_available(self.device):
                name = name or "triton"
            elif name == "triton":
                raise RuntimeError("attention backend 'triton' asked for, but Triton cannot run here")
            else:
                name = "torch"
        set_attention_backend(name)
        logger.info("attention backend: %s", name)

    def _want_cuda_graphs(self) -> bool:
        cfg = self.config
        if cfg is None or self.device.type != "cuda" or cfg.enforce_eager:
            return False
        if get_attention_backend() not in GRAPH_SAFE_BACKENDS:
            logger.info("CUDA graphs off: attention backend %r is not graph-safe", get_attention_backend())
            return False
        if getattr(cfg, "tensor_parallel_size", 1) > 1 and not envs.RLSERVE_CUDA_GRAPH_TP:
            logger.info("CUDA graphs off under tensor parallelism (set RLSERVE_CUDA_GRAPH_TP=1 to try them)")
            return False
        return True

    def _max_batched_tokens(self) -> int:
        """Tokens of one forward step at most: the config's ``max_num_batched_tokens`` (the engine
        resolves it before the warm-up), else its CUDA default ``max(8192, max_model_len)``."""
        n = getattr(self.config, "max_num_batched_tokens", None) if self.config is not None else None
        return int(n or max(8192, self._max_model_len()))

    def _max_model_len(self) -> int:
        cfg = self.config
        if cfg is not None and cfg.max_model_len and cfg.max_model_len > 0:  # (-1: auto, before the engine resolved it)
            return int(cfg.max_model_len)
        return verify_max_model_len(None, getattr(self.model, "config", None))

    def capture_cuda_graphs(self, lora=None) -> None:
        """Capture the decode graphs now (otherwise done at the first decode step). Call
        inside the worker's TP context, after the KV cache is allocated. ``lora`` (a
        :class:`~rlserve.lora.model.LoRAModel` on the kernel path): the graphs of decode steps
        with adapters instead (``lora_graphs``, captured at the first such step)."""
        if not self.kv_caches:
            raise RuntimeError("allocate the KV cache before capturing CUDA graphs")
        graphs = self._new_graphs(lora)
        graphs.capture()
        if lora is None:
            self.cuda_graphs = graphs
        else:
            self.lora_graphs = graphs

    def _new_graphs(self, lora=None) -> DecodeCUDAGraphs:
        """Uncaptured decode graphs for the configured batch sizes (``config.extra["cuda_graph_sizes"]``
        or ``RLSERVE_CUDA_GRAPH_SIZES``, capped at ``max_num_seqs``; else the default ladder).

        Raises:
            ValueError: a size that is not an integer >= 1 (:func:`rlserve.envs.positive_int_list`)."""
        extra = getattr(self.config, "extra", None) or {}
        sizes = extra.get("cuda_graph_sizes")
        sizes = envs.positive_int_list("extra['cuda_graph_sizes']", sizes) if sizes else envs.RLSERVE_CUDA_GRAPH_SIZES
        if sizes:
            sizes = sorted({min(x, self.config.max_num_seqs) for x in sizes})
        return DecodeCUDAGraphs(
            self.model, self.device, self.block_size, self.config.max_num_seqs, self._max_model_len(), sizes=sizes or None,
            lora=lora,
        )

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Before the first request: on CUDA, run prefills (16 and 1024 tokens, and one per launch class
        of the fused q/k-norm + rotary kernel; sequences of at most ``max_model_len``) that write nothing
        (every slot -1) and the Triton decode attention in each variant, so every kernel variant a serving
        step can launch is compiled (:mod:`rlserve.engine.worker.jit_warmup`), then
        capture the decode CUDA graphs (when they are on).
        A model with routed experts first compiles every fused-MoE specialization (:meth:`moe_warm_up`).
        First, unless ``RLSERVE_TRITON_PRECOMPILE=0``, all of it runs once with Triton's compilations
        recorded instead of done (:meth:`_record_pass`: a MoE model's too, its routed experts off), and
        what Triton's on-disk cache lacks compiles in parallel processes
        (:mod:`rlserve.engine.worker.triton_precompile`): a cold start compiles in parallel
        what it compiled one kernel after the other. Returns the seconds spent. A capture
        failure is logged and leaves graphs off, as at a lazy capture.

        Raises:
            RuntimeError: no KV cache allocated yet.
        """
        if not self.kv_caches:
            raise RuntimeError("allocate the KV cache before warming up")
        if self.device.type != "cuda":
            return 0.0
        bi_mode.set_enabled(self.batch_invariant)
        t0 = time.perf_counter()
        capture = self.use_cuda_graphs and self.cuda_graphs is None and not self._graphs_failed
        if envs.RLSERVE_TRITON_PRECOMPILE:
            from rlserve.engine.worker import triton_precompile

            self.precompile_stats = triton_precompile.precompile(lambda: self._record_pass(capture), self.device)
            torch.cuda.synchronize(self.device)
        self.moe_warm_up()
        self._warm_forwards(False)
        if capture:
            self._try_capture()
        self._prefill_graphs_ready()
        torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        logger.info("warm-up (kernel compilation, CUDA graph capture) took %.2fs", dt)
        return dt

    def moe_warm_up(self) -> list[tuple] | None:
        """CUDA, a model with routed experts on the Triton path: compile every fused-MoE kernel
        specialization the dispatcher can pick (:func:`rlserve.layers.moe_kernels.warm_up`: each
        tile class of each expert shape, both GEMMs, routing, permutation); :meth:`warm_up`'s parallel
        precompile (:meth:`_record_pass`) compiled them first, so here they load from Triton's disk cache.
        Without it, a batch of a tile class the 16- and 1,024-token prefills and the graph sizes miss
        compiled in the middle of serving. Returns the launches (None when there is nothing to warm)."""
        from rlserve.layers import moe_kernels

        layers = jit_warmup.moe_layers(self.model, self.device)
        return moe_kernels.warm_up(layers, self.dtype) if layers else None

    def _record_pass(self, capture: bool) -> None:
        """What :meth:`warm_up` launches, once, for the precompile to record
        (:func:`rlserve.engine.worker.triton_precompile.record`: no Triton launch runs, outputs stay
        uninitialized): the fused-MoE warm-up (its routing ids are built by torch), then :meth:`_warm_forwards`
        with every routed-experts layer returning zeros (:func:`jit_warmup.routed_experts_off`): the
        routing kernel's skipped output would be expert indices that torch ops index with. So a MoE model's
        forwards, decode attention and weight-sync kernels compile in the parallel children too (before,
        a MoE model recorded only its MoE kernels and compiled the rest one after the other)."""
        from rlserve.layers import moe_kernels

        layers = jit_warmup.moe_layers(self.model, self.device)
        if layers:
            moe_kernels.warm_up(layers, self.dtype)
        with jit_warmup.routed_experts_off(self.model):
            self._warm_forwards(capture)

    def _warm_forwards(self, graph_sizes: bool) -> None:
        """The warm-up's eager forwards: prefills writing nothing (16 and 1024 tokens, and one per launch
        class of the fused qkv kernels: :func:`jit_warmup.forward_inputs`), each with
        its last row's logits, and the Triton decode attention in each of its variants
        (:func:`jit_warmup.warm_decode_attention`) and the weight sync's copy + checksum kernel
        (:func:`jit_warmup.warm_weight_sync`); ``graph_sizes``: also the decode forward (padding rows: context 0,
        no KV write) with every row's logits, as a capture runs it, of one CUDA-graph batch size per
        class Triton may compile apart (:func:`specialization_representatives`; the recording pass
        of :meth:`warm_up`, which only needs each specialization once)."""
        cap = min(self.block_size * self.num_blocks, self._max_model_len())
        for ids, pos, meta in jit_warmup.forward_inputs(self.model, cap, self._max_batched_tokens(), self.block_size,
                                                        self.device):
            self.model.compute_logits(self.model(ids, pos, meta)[-1:], **self._logits_kw)
        jit_warmup.warm_decode_attention(self.model, self.dtype, self.device)
        jit_warmup.warm_weight_sync(self.device)
        if graph_sizes:
            graphs = self._new_graphs()
            for bs in specialization_representatives(graphs.sizes):
                self.model.compute_logits(graphs.forward_eager(bs), **self._logits_kw)
        if self.batch_invariant and self.device.type == "cuda":  # every GEMM launch the mode can pick
            from rlserve.batch_invariant import gpu as bi_gpu
            from rlserve.layers.embedding import ParallelLMHead
            from rlserve.layers.linear import LinearBase

            layers = [(m.weight, m.bias if isinstance(getattr(m, "bias", None), torch.Tensor) else None)
                      for m in self.model.modules()
                      if isinstance(m, (LinearBase, ParallelLMHead)) and isinstance(getattr(m, "weight", None),
                                                                                    torch.Tensor)]
            bi_gpu.warm_up(layers, self._max_batched_tokens())

    def _try_capture(self, lora=None) -> bool:
        """Capture the decode CUDA graphs (``lora``: those of steps with adapters); on any failure
        log it, decode eagerly from now on (``_graphs_failed``) and return False: a capture
        failure never takes the engine down."""
        try:
            self.capture_cuda_graphs(lora)
            return True
        except Exception:
            logger.exception("CUDA graph capture failed; decoding eagerly from now on")
            self._graphs_failed = True
            self.cuda_graphs = self.lora_graphs = None
            return False

    def _prefill_graph_spec(self) -> tuple:
        """``(value, where)`` of the piecewise prefill graphs' setting: ``config.extra["prefill_cuda_graph_sizes"]``
        when set, else ``RLSERVE_PREFILL_CUDA_GRAPHS`` (default ``"auto"``)."""
        extra = getattr(self.config, "extra", None) or {}
        if extra.get("prefill_cuda_graph_sizes"):
            return extra["prefill_cuda_graph_sizes"], "extra['prefill_cuda_graph_sizes']"
        return envs.RLSERVE_PREFILL_CUDA_GRAPHS, "RLSERVE_PREFILL_CUDA_GRAPHS"

    def _prefill_graphs_auto(self) -> bool:
        """Whether the piecewise prefill graphs follow the default (``auto``) rather than an explicit setting."""
        spec = self._prefill_graph_spec()[0]
        return isinstance(spec, str) and spec.strip() == "auto"

    def _prefill_graph_sizes(self) -> list[int]:
        """Token buckets of the piecewise prefill graphs (:meth:`_prefill_graph_spec`; empty: off), capped at
        the most tokens a step can hold: ``max_num_batched_tokens`` and ``max_num_seqs x max_model_len``.

        Raises:
            ValueError: a bucket that is not a positive integer."""
        spec, what = self._prefill_graph_spec()
        cap = self._max_batched_tokens()
        seqs = getattr(self.config, "max_num_seqs", None) if self.config is not None else None
        if seqs:
            cap = min(cap, int(seqs) * self._max_model_len())
        return pg.parse_sizes(spec, cap, what)

    def _prefill_graphs_ready(self) -> bool:
        """Whether prefill steps may replay piecewise graphs, capturing them first when needed; the
        first time it says no, the reason is logged. A capture failure is logged and leaves them off."""
        if self.prefill_graphs is not None:
            return True
        if self._prefill_graphs_off is not None:
            return False
        sizes = self._prefill_graph_sizes()
        why = pg.why_off(self, sizes)
        if why is None:
            try:
                graphs = pg.PrefillCUDAGraphs(self.model, self.device, sizes)
                graphs.capture(pg.reserve_once(self))
                self.prefill_graphs = graphs
                return True
            except Exception:
                logger.exception("prefill CUDA graph capture failed; prefill steps run eagerly")
                why = "capture failed"
        if why != "no KV cache yet":
            self._prefill_graphs_off = why
            if sizes:  # (off CUDA under the default, where they never apply: not worth an INFO line)
                quiet = self.device.type != "cuda" and self._prefill_graphs_auto()
                logger.log(logging.DEBUG if quiet else logging.INFO, "prefill piecewise CUDA graphs off: %s", why)
        return False

    def _prefill_with_graph(self, step: StepInput, input_ids, positions, meta) -> torch.Tensor | None:
        """Hidden states of a prefill / mixed step from the piecewise graphs, or None when this step runs
        eagerly (graphs off, more tokens than the largest bucket, a layer computing its fp8 KV scales)."""
        if not step.is_prefill or self._prefill_graphs_off is not None or step.lora_ids:
            return None
        if self.prefill_graphs is None and not self._prefill_graphs_ready():
            return None
        graphs = self.prefill_graphs
        if graphs.bucket_for(len(step.input_ids)) is None or any(a.calculate_kv_scales for a in self.attn_layers):
            return None
        return graphs.run(input_ids, positions, meta)

    def _decode_with_graph(self, step: StepInput, lora=None) -> torch.Tensor | None:
        """Hidden states of a decode step replayed from a CUDA graph, or None when this step
        cannot use one (graphs off, batch too large, context past the captured bound).
        ``lora``: the step has adapters (kernel path): the LoRA graphs."""
        if not self.use_cuda_graphs or step.is_prefill or self._graphs_failed:
            return None
        B = len(step.input_ids)
        if len(step.query_lens) != B or any(q != 1 for q in step.query_lens):
            return None
        graphs = self.cuda_graphs if lora is None else self.lora_graphs
        if graphs is None:
            if not self._try_capture(lora):
                torch.cuda.synchronize(self.device)
                return None
            graphs = self.cuda_graphs if lora is None else self.lora_graphs
        if not graphs.can_run(B, max(step.seq_lens)):
            return None
        hidden = graphs.run(step.input_ids, step.seq_lens, step.block_tables, ids_from=step.input_ids_from,
                            lora_ids=step.lora_ids if lora is not None else None)
        replayed = getattr(self.model, "after_graph_replay", None)  # MoE: routed-experts capture rows
        if replayed is not None:
            replayed(B)
        return hidden

    def allocate_kv_cache(self, num_blocks: int, alloc=None) -> None:
        """Allocate and bind ``[num_blocks, block_size, kv_heads, head_dim]`` K and V caches
        for every attention layer (zeros). ``alloc(shape, dtype) -> zeroed tensor`` replaces
        ``torch.zeros`` (sleep mode's arena); on the CPU the default is
        :func:`rlserve.layers.cpu_hugepages.zeros` (2 MiB pages with ``RLSERVE_CPU_HUGEPAGES=1``)."""
        self.num_blocks = num_blocks
        self.kv_caches = []
        if alloc is None and torch.device(self.device).type == "cpu":
            alloc = cpu_hugepages.zeros
        elif alloc is None:
            def alloc(shape, dtype):
                return torch.zeros(shape, dtype=dtype, device=self.device)
        fp8 = kv_quant.is_fp8(self.kv_cache_dtype)
        for layer in self.attn_layers:
            shape = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            k = alloc(shape, self.kv_cache_dtype)
            v = alloc(shape, self.kv_cache_dtype)
            layer.k_cache, layer.v_cache = k, v
            if not fp8:
                layer.k_scale = layer.v_scale = None
            elif layer.k_scale is None or layer.k_scale.device != k.device:  # kept over a re-allocation
                layer.k_scale, layer.v_scale = kv_quant.new_scales(k.device)
            self.kv_caches.append((k, v))
        self.cuda_graphs = self.lora_graphs = None  # graphs captured the old cache tensors
        self.prefill_graphs = None

    def arm_kv_scale_calculation(self) -> bool:
        """``--calculate-kv-scales``: every layer of an fp8 cache sets its ``k_scale`` /
        ``v_scale`` from the next forward's K/V (:func:`rlserve.layers.kv_quant.set_scales_from`;
        called after the warm-up, so the first real batch, a prefill, decides). Returns whether
        anything was armed (False for a cache in the model dtype)."""
        if not kv_quant.is_fp8(self.kv_cache_dtype):
            return False
        for layer in self.attn_layers:
            layer.calculate_kv_scales = True
        return True

    def build_metadata(self, step: StepInput) -> AttentionMetadata:
        return AttentionMetadata.build(step.query_lens, step.seq_lens, step.block_tables, self.block_size, self.device)

    @torch.inference_mode()
    def execute(self, step: StepInput) -> torch.Tensor:
        """Run one forward step.

        Returns:
            ``[len(step.logits_indices), vocab]`` logits (full vocabulary) in the model dtype
            (float32 for a model whose ``compute_logits`` has no ``float32`` argument).
        """
        bi_mode.set_enabled(self.batch_invariant)
        lora = lora_of(self.model)
        if lora is not None and lora.merge is not None and lora.merge.prepare(step.lora_ids):
            lora = None  # the step's one adapter is merged into the weights: the base path
        if lora is None or not step.lora_ids:
            with cpu_microbatch.active(self.microbatches), cpu_gemm.use(self.cpu_team):
                return self._execute(step)
        with lora.step(step.lora_ids, step.query_lens), cpu_microbatch.active(None), cpu_gemm.use(self.cpu_team):
            # kernel path: decode steps replay graphs of their own; dense grouping runs eagerly
            return self._execute(step, graphs=lora.kernel, lora=lora)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``model.compute_logits`` of ``hidden`` ``[N, hidden]``, its rows split into the
        step's CPU micro-batches where they are (rows are independent: bit-equal)."""
        fn = self.model.compute_logits
        out = cpu_microbatch.split(lambda a, b: fn(hidden[a:b], **self._logits_kw), [1.0] * hidden.shape[0])
        return fn(hidden, **self._logits_kw) if out is None else out

    def _execute(self, step: StepInput, graphs: bool = True, lora=None) -> torch.Tensor:
        logits = self._logits
        hidden = self._decode_with_graph(step, lora) if graphs else None
        if hidden is not None:
            B = hidden.shape[0]
            idx = step.logits_indices
            if len(idx) == B and idx[0] == 0 and idx[-1] == B - 1:
                return logits(hidden)
            rows = to_device(idx, torch.long, self.device)
            return logits(hidden.index_select(0, rows))
        ids_from = step.input_ids_from
        if ids_from is not None and len(ids_from) == 3:  # mixed step: some rows from the device
            input_ids = fill_rows(to_device(step.input_ids, torch.long, self.device), *ids_from)
        elif ids_from is not None:
            input_ids = gather_rows(*ids_from).to(self.device)
        else:
            input_ids = to_device(step.input_ids, torch.long, self.device)
        positions = to_device(step.positions, torch.long, self.device)
        meta = self.build_metadata(step)
        hidden = self._prefill_with_graph(step, input_ids, positions, meta) if graphs else None
        if hidden is None:
            hidden = self.model(input_ids, positions, meta)
        idx = to_device(step.logits_indices, torch.long, self.device)
        return logits(hidden.index_select(0, idx))
